// Decode projections for a few rows (M in {1, 2, 4, 8}): y (M, N) = x (M, K) · wᵀ with w (N, K)
// row-major, read once with 16-byte streaming loads. At M <= 8 the product is bound by the weight
// bytes, and cuBLAS's tiled kernels (plus their split-K reduction kernels) leave bandwidth unused.
//
// One warp computes R output rows over all M inputs: each lane takes 8 consecutive elements of
// K per 256-element step, U steps of weights loaded before the first use so that enough bytes are
// in flight; x (a few KB, shared by every warp) comes through L1. fp32 accumulation, a warp
// reduction, then the epilogue (bias, residual add, GELU, SwiGLU or fp32 logits) in registers.
//
// GemvNorm folds the LayerNorm/RMSNorm in front of the QKV, MLP-in and LM-head projections into
// the product instead of running a norm kernel first. Every warp reads all of x anyway, so it
// sums each row's statistics (Σx, Σx²) alongside the product, with no shared memory and no
// barrier, and applies the norm to its dot products afterwards (per row of w, per input row):
//   RMSNorm:   W·(g ⊙ x·r)           = r · Σ w·g·x                 r = rsqrt(E[x²] + eps)
//   LayerNorm: W·(g ⊙ (x − μ)·r + b) = r · (Σ w·g·x − μ·wg) + wb   r = rsqrt(E[x²] − μ² + eps)
// with wg = w·g and wb = w·b precomputed per projection (ComputeLayerNormFold). Every warp sums
// the statistics in the same order, so the result does not depend on the grid. The normalised x is
// never rounded to the activation type, which the norm kernel's output is: the two paths differ
// by about one rounding of each normalised element.
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/device_util.cuh"
#include "worker/cuda/kernels.h"

namespace tandem::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kUnroll = 4;  // 256-element steps of K whose weights are loaded together

// Weights are read once per step: keep them out of L1, which x needs.
__device__ __forceinline__ uint4 LoadStreaming(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 8 elements of a 16-byte vector as floats.
template <typename T>
__device__ __forceinline__ void Unpack(const uint4& v, float (&f)[8]) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __half>) {
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&u[i]));
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    } else {
      const float2 p = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u[i]));
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
}

__device__ __forceinline__ float GeluTanh(float x) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

// Rows of w that warp `unit` reads: R consecutive rows, or for SwiGLU the gate row j and the up
// row N + j.
template <GemvEpilogue E, int R>
__device__ __forceinline__ int WeightRow(int unit, int r, int n) {
  if constexpr (E == GemvEpilogue::kSwiGlu) return unit + r * n;
  return unit * R + r;
}

enum class NormKind { kNone, kLayer, kRms };

// N != kNone: x holds the residual stream; input row m is its row gather[m] (m without gather),
// normalised on the fly with the norm weight g (k) and eps, and for LayerNorm wg and wb (fp32, one
// per row of w). N == kNone: x is (M, k) and gather, g, wg, wb and eps are unused.
template <typename T, int M, int R, GemvEpilogue E, NormKind N>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    GemvKernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
               void* __restrict__ y, int n, int k, int units, const int32_t* __restrict__ gather,
               const T* __restrict__ g, const float* __restrict__ wg, const float* __restrict__ wb,
               float eps) {
  constexpr bool kFold = N != NormKind::kNone;
  const int lane = threadIdx.x & 31;
  const int unit = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  if (unit >= units) return;  // the last block's spare warps
  // Rows past N (the last unit of an odd N with R = 2) read row N - 1 and are not stored.
  const int rows_total = E == GemvEpilogue::kSwiGlu ? 2 * n : n;
  const T* wrow[R];
  [[maybe_unused]] float fold_wg[R], fold_wb[R];  // LayerNorm: wg and wb of the rows read
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = min(WeightRow<E, R>(unit, r, n), rows_total - 1);
    wrow[r] = w + static_cast<size_t>(row) * k;
    // Derived from the weights at load time, so read before the wait too.
    if constexpr (N == NormKind::kLayer) {
      fold_wg[r] = wg[row];
      fold_wb[r] = wb[row];
    }
  }
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
  }
  // This lane's share of each row's Σx (LayerNorm) and Σx² (both norms).
  [[maybe_unused]] float sum_x[M], sum_xx[M];
#pragma unroll
  for (int m = 0; m < M; ++m) sum_x[m] = sum_xx[m] = 0.0f;
  constexpr int kStep = 32 * 8;
  constexpr int kStride = kStep * kUnroll;
  // Software pipeline: the weights of the next kUnroll steps are in flight while the current ones
  // are multiplied. The first batch is loaded before waiting for the kernel that writes x (it
  // does not read x), which hides this kernel's start behind the previous one.
  uint4 wv[kUnroll][R];
#define TANDEM_GEMV_LOAD(base_k)                                                  \
  _Pragma("unroll") for (int u = 0; u < kUnroll; ++u) {                           \
    const int kk = (base_k) + u * kStep;                                          \
    _Pragma("unroll") for (int r = 0; r < R; ++r) {                               \
      wv[u][r] = kk < k ? LoadStreaming(wrow[r] + kk) : make_uint4(0, 0, 0, 0);   \
    }                                                                             \
  }
  TANDEM_GEMV_LOAD(lane * 8)
  AllowDependentLaunch();
  WaitForPrerequisites();
  const T* xrow[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int row = kFold && gather != nullptr ? gather[m] : m;
    xrow[m] = x + static_cast<size_t>(row) * k;
  }
  for (int base = lane * 8; base < k; base += kStride) {
    uint4 cur[kUnroll][R];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int r = 0; r < R; ++r) cur[u][r] = wv[u][r];
    }
    if (base + kStride < k) {
      TANDEM_GEMV_LOAD(base + kStride)
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int kk = base + u * kStep;
      if (kk >= k) break;
      float wf[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) Unpack<T>(cur[u][r], wf[r]);
      [[maybe_unused]] float gf[8];
      if constexpr (kFold) Unpack<T>(__ldg(reinterpret_cast<const uint4*>(g + kk)), gf);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float xf[8];
        Unpack<T>(__ldg(reinterpret_cast<const uint4*>(xrow[m] + kk)), xf);
        if constexpr (kFold) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            if constexpr (N == NormKind::kLayer) sum_x[m] += xf[i];
            sum_xx[m] = fmaf(xf[i], xf[i], sum_xx[m]);
            xf[i] *= gf[i];  // exact: a product of two 2-byte floats fits in a float
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r][m] = fmaf(wf[r][i], xf[i], acc[r][m]);
        }
      }
    }
  }
#undef TANDEM_GEMV_LOAD
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = WarpSum(acc[r][m]);
  }
  // The norm of each row, from the whole row's sums (every lane gets them), with eps inside the
  // root as in norm.cu; the variance as E[x²] − μ², clamped at 0 against rounding.
  [[maybe_unused]] float mean[M], inv[M];
  if constexpr (kFold) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float mean_sq = WarpSum(sum_xx[m]) / k;
      if constexpr (N == NormKind::kRms) {
        inv[m] = rsqrtf(mean_sq + eps);
      } else {
        mean[m] = WarpSum(sum_x[m]) / k;
        inv[m] = rsqrtf(fmaxf(mean_sq - mean[m] * mean[m], 0.0f) + eps);
      }
    }
  }
  // The output of weight row r for input row m before the epilogue: the sum, normalised.
  auto project = [&](float a, int m, int r) {
    if constexpr (N == NormKind::kRms) {
      return a * inv[m];
    } else if constexpr (N == NormKind::kLayer) {
      return fmaf(inv[m], fmaf(-mean[m], fold_wg[r], a), fold_wb[r]);
    } else {
      return a;
    }
  };
  // Every lane holds every sum; lane (r', m) stores output (r', m) (one per lane).
  if constexpr (E == GemvEpilogue::kSwiGlu) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (lane != m) continue;
      // As Hugging Face: both projections rounded, silu(gate) rounded, then the product.
      const float gate = RoundTo<T>(project(acc[0][m], m, 0));
      const float up = RoundTo<T>(project(acc[1][m], m, 1));
      const float s = RoundTo<T>(gate / (1.0f + expf(-gate)));
      static_cast<T*>(y)[static_cast<size_t>(m) * n + unit] = FromF<T>(s * up);
    }
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const int col = unit * R + r;
        if (lane != r * M + m || col >= n) continue;
        float v = project(acc[r][m], m, r);
        if (bias != nullptr) v += ToF(bias[col]);
        const size_t at = static_cast<size_t>(m) * n + col;
        if constexpr (E == GemvEpilogue::kF32) {
          static_cast<float*>(y)[at] = v;
        } else if constexpr (E == GemvEpilogue::kStore) {
          static_cast<T*>(y)[at] = FromF<T>(v);
        } else if constexpr (E == GemvEpilogue::kResidual) {
          // The projection's output is rounded before the residual add, as a Linear layer's is.
          T* out = static_cast<T*>(y);
          out[at] = FromF<T>(ToF(out[at]) + RoundTo<T>(v));
        } else {
          static_cast<T*>(y)[at] = FromF<T>(GeluTanh(RoundTo<T>(v)));
        }
      }
    }
  }
}

// The folded norm's inputs (unused without one).
struct NormArgs {
  const int32_t* gather = nullptr;
  const void* g = nullptr;
  const float* wg = nullptr;
  const float* wb = nullptr;
  float eps = 0.0f;
};

template <typename T, int M, int R, GemvEpilogue E, NormKind N>
cudaError_t Launch(const void* x, const void* w, const void* bias, void* y, int n, int k,
                   const NormArgs& norm, cudaStream_t stream, bool pdl) {
  const int units = E == GemvEpilogue::kSwiGlu ? n : (n + R - 1) / R;
  const int blocks = (units + kWarpsPerBlock - 1) / kWarpsPerBlock;
  // With pdl: start before the previous kernel ends (see WaitForPrerequisites).
  return LaunchKernel(GemvKernel<T, M, R, E, N>, dim3(blocks), dim3(kWarpsPerBlock * 32), 0, stream,
                      pdl, static_cast<const T*>(x), static_cast<const T*>(w),
                      static_cast<const T*>(bias), y, n, k, units, norm.gather,
                      static_cast<const T*>(norm.g), norm.wg, norm.wb, norm.eps);
}

template <typename T, GemvEpilogue E, NormKind N>
cudaError_t LaunchForRows(int m, const void* x, const void* w, const void* bias, void* y, int n,
                          int k, const NormArgs& norm, cudaStream_t stream, bool pdl) {
  // Two weight rows per warp at M >= 4 halve the x traffic through L1 per weight byte; SwiGLU
  // already reads two rows (gate and up) per warp.
  constexpr int R1 = E == GemvEpilogue::kSwiGlu ? 2 : 1;
  constexpr int R2 = 2;
  switch (m) {
    case 1:
      return Launch<T, 1, R1, E, N>(x, w, bias, y, n, k, norm, stream, pdl);
    case 2:
      return Launch<T, 2, R1, E, N>(x, w, bias, y, n, k, norm, stream, pdl);
    case 4:
      return Launch<T, 4, R2, E, N>(x, w, bias, y, n, k, norm, stream, pdl);
    default:
      if constexpr (N == NormKind::kNone) {
        return Launch<T, 8, R2, E, N>(x, w, bias, y, n, k, norm, stream, pdl);
      } else {
        return cudaErrorInvalidValue;  // refused by GemvNorm before this point
      }
  }
}

template <typename T, NormKind N>
cudaError_t LaunchEpilogue(GemvEpilogue epilogue, int m, const void* x, const void* w,
                           const void* bias, void* y, int n, int k, const NormArgs& norm,
                           cudaStream_t stream, bool pdl) {
  switch (epilogue) {
    case GemvEpilogue::kStore:
      return LaunchForRows<T, GemvEpilogue::kStore, N>(m, x, w, bias, y, n, k, norm, stream, pdl);
    case GemvEpilogue::kResidual:
      if constexpr (N == NormKind::kNone) {
        return LaunchForRows<T, GemvEpilogue::kResidual, N>(m, x, w, bias, y, n, k, norm, stream,
                                                            pdl);
      } else {
        return cudaErrorInvalidValue;  // refused by GemvNorm before this point
      }
    case GemvEpilogue::kGelu:
      return LaunchForRows<T, GemvEpilogue::kGelu, N>(m, x, w, bias, y, n, k, norm, stream, pdl);
    case GemvEpilogue::kSwiGlu:
      return LaunchForRows<T, GemvEpilogue::kSwiGlu, N>(m, x, w, bias, y, n, k, norm, stream, pdl);
    case GemvEpilogue::kF32:
      return LaunchForRows<T, GemvEpilogue::kF32, N>(m, x, w, bias, y, n, k, norm, stream, pdl);
  }
  return cudaErrorInvalidValue;
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

bool GemvSupported(int rows, int in) {
  return (rows == 1 || rows == 2 || rows == 4 || rows == 8) && in > 0 && in % 8 == 0;
}

absl::Status Gemv(DType dtype, GemvEpilogue epilogue, const void* x, const void* w,
                  const void* bias, void* y, int rows, int out, int in, cudaStream_t stream) {
  if (!GemvSupported(rows, in)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GEMV takes 1, 2, 4 or 8 rows and an input width that is a multiple of 8, got rows ",
        rows, ", in ", in));
  }
  if (out < 1) return absl::InvalidArgumentError(absl::StrCat("GEMV output width ", out, " < 1"));
  if (!Aligned16(x) || !Aligned16(w)) {
    return absl::InvalidArgumentError("GEMV needs 16-byte aligned x and w");
  }
  // On a stream of our own, always as a programmatic dependent launch.
  TANDEM_DISPATCH_HALF(dtype, {
    CUDA_CHECK((LaunchEpilogue<T, NormKind::kNone>(epilogue, rows, x, w, bias, y, out, in,
                                                   NormArgs{}, stream, true)));
  });
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

bool GemvNormSupported(int rows, int in) {
  return (rows == 1 || rows == 2 || rows == 4) && in > 0 && in % 8 == 0 && in <= kGemvNormMaxIn;
}

absl::Status ComputeLayerNormFold(DType dtype, const void* w, const void* norm_w,
                                  const void* norm_b, int w_rows, int in, float* wg, float* wb,
                                  cudaStream_t stream) {
  if (norm_w == nullptr || norm_b == nullptr || wg == nullptr || wb == nullptr) {
    return absl::InvalidArgumentError(
        "a LayerNorm fold needs the norm's weight and bias and two outputs");
  }
  // One-row products: wg = g · wᵀ, wb = b · wᵀ, unrounded.
  absl::Status s = Gemv(dtype, GemvEpilogue::kF32, norm_w, w, nullptr, wg, 1, w_rows, in, stream);
  if (!s.ok()) return s;
  return Gemv(dtype, GemvEpilogue::kF32, norm_b, w, nullptr, wb, 1, w_rows, in, stream);
}

absl::Status GemvNorm(DType dtype, GemvEpilogue epilogue, bool rms, const void* x,
                      const int32_t* gather, const void* norm_w, const LayerNormFold& layer_norm,
                      float eps, const void* w, const void* bias, void* y, int rows, int out,
                      int in, cudaStream_t stream, bool pdl) {
  if (!GemvNormSupported(rows, in)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GEMV with a folded norm takes 1, 2 or 4 rows and an input width that is a multiple of 8 "
        "and at most ",
        kGemvNormMaxIn, ", got rows ", rows, ", in ", in));
  }
  if (out < 1) return absl::InvalidArgumentError(absl::StrCat("GEMV output width ", out, " < 1"));
  if (epilogue == GemvEpilogue::kResidual) {
    return absl::InvalidArgumentError(
        "GEMV with a folded norm does not add into the stream it normalises");
  }
  if (norm_w == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(rms ? "RMSNorm" : "LayerNorm", " folded into a GEMV needs the norm weight"));
  }
  if (!rms && (layer_norm.wg == nullptr || layer_norm.wb == nullptr)) {
    return absl::InvalidArgumentError(
        "LayerNorm folded into a GEMV needs w·g and w·b (ComputeLayerNormFold)");
  }
  if (!Aligned16(x) || !Aligned16(w) || !Aligned16(norm_w)) {
    return absl::InvalidArgumentError(
        "GEMV with a folded norm needs 16-byte aligned x, w and norm weight");
  }
  NormArgs norm;
  norm.gather = gather;
  norm.g = norm_w;
  norm.wg = layer_norm.wg;
  norm.wb = layer_norm.wb;
  norm.eps = eps;
  TANDEM_DISPATCH_HALF(dtype, {
    if (rms) {
      CUDA_CHECK((LaunchEpilogue<T, NormKind::kRms>(epilogue, rows, x, w, bias, y, out, in, norm,
                                                    stream, pdl)));
    } else {
      CUDA_CHECK((LaunchEpilogue<T, NormKind::kLayer>(epilogue, rows, x, w, bias, y, out, in, norm,
                                                      stream, pdl)));
    }
  });
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace tandem::cuda
