// Decode projections for a few rows (M in {1, 2, 4, 8}): y (M, N) = x (M, K) · wᵀ with w (N, K)
// row-major, read once with 16-byte streaming loads. At M <= 8 the product is bound by the weight
// bytes, and cuBLAS's tiled kernels (plus their split-K reduction kernels) leave bandwidth unused.
//
// One warp computes R output rows over all M inputs: each lane takes 8 consecutive elements of
// K per 256-element step, U steps of weights loaded before the first use so that enough bytes are
// in flight; x (a few KB, shared by every warp) comes through L1. fp32 accumulation, a warp
// reduction, then the epilogue (bias, residual add, GELU, SwiGLU or fp32 logits) in registers.
//
// GemvNorm folds the LayerNorm/RMSNorm in front of the QKV, MLP-in and LM-head projections into the
// same kernel: each block copies the un-normalised rows (M x K, at most 4 x 8192, from L2) into
// shared memory, sums their statistics, normalises them in place, then runs the product reading x
// from shared memory. The rows are tiny next to the weights; computing them per block costs a few
// KB of L2 reads per block and saves a kernel (and its launch latency) per norm.
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

// Normalises the M rows of x_s (M, k) in place as norm.cu's NormKernel normalises a row: the
// statistics are summed in that kernel's order (this block's threads stand in for its
// kNormBlockThreads threads, each taking kNormBlockThreads / blockDim.x of them, with the same
// warp and cross-warp reductions), then the same per-element formulas. scratch: M * 8 floats.
template <typename T, int M, bool kRms>
__device__ __forceinline__ void NormalizeRows(T* x_s, const T* __restrict__ gw,
                                              const T* __restrict__ gb, int k, float eps,
                                              float* scratch) {
  constexpr int kThreads = kWarpsPerBlock * 32;
  constexpr int kVirtual = kNormBlockThreads;
  constexpr int kPer = kVirtual / kThreads;        // virtual threads per thread
  constexpr int kVirtualWarps = kVirtual / 32;
  static_assert(kVirtual % kThreads == 0 && kVirtualWarps <= 32, "norm thread layout");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nvec = k / 8;
  const Vec8<T>* xv = reinterpret_cast<const Vec8<T>*>(x_s);
  // Block sums of part[m][i] (virtual thread threadIdx.x + i * kThreads) as BlockSum would give
  // over kVirtual threads: virtual warp warp + i * kWarpsPerBlock, same lane.
  auto block_sums = [&](float (&part)[M][kPer], float (&total)[M]) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) part[m][i] = WarpSum(part[m][i]);
    }
    __syncthreads();
    if (lane == 0) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int i = 0; i < kPer; ++i) scratch[m * kVirtualWarps + warp + i * kWarpsPerBlock] = part[m][i];
      }
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < M; ++m) {
      total[m] = WarpSum(lane < kVirtualWarps ? scratch[m * kVirtualWarps + lane] : 0.0f);
    }
  };
  float part[M][kPer], total[M], mean[M], inv[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      float sum = 0.0f;
      for (int j = threadIdx.x + i * kThreads; j < nvec; j += kVirtual) {
        const Vec8<T> a = xv[m * nvec + j];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float v = ToF(a.v[e]);
          sum += kRms ? v * v : v;
        }
      }
      part[m][i] = sum;
    }
  }
  block_sums(part, total);
  if constexpr (kRms) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      mean[m] = 0.0f;
      inv[m] = rsqrtf(total[m] / k + eps);
    }
  } else {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      mean[m] = total[m] / k;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        float sq = 0.0f;
        for (int j = threadIdx.x + i * kThreads; j < nvec; j += kVirtual) {
          const Vec8<T> a = xv[m * nvec + j];
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float v = ToF(a.v[e]);
            sq += (v - mean[m]) * (v - mean[m]);
          }
        }
        part[m][i] = sq;
      }
    }
    block_sums(part, total);
#pragma unroll
    for (int m = 0; m < M; ++m) inv[m] = rsqrtf(total[m] / k + eps);
  }
  // In place: each thread rewrites the vectors it alone read above.
  Vec8<T>* xo = reinterpret_cast<Vec8<T>*>(x_s);
  const Vec8<T>* wv = reinterpret_cast<const Vec8<T>*>(gw);
  const Vec8<T>* bv = reinterpret_cast<const Vec8<T>*>(gb);
  for (int j = threadIdx.x; j < nvec; j += kThreads) {
    const Vec8<T> ww = wv[j];
    Vec8<T> bb;
    if constexpr (!kRms) bb = bv[j];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const Vec8<T> a = xo[m * nvec + j];
      Vec8<T> res;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float v = ToF(a.v[e]);
        if constexpr (kRms) {
          res.v[e] = FromF<T>(RoundTo<T>(v * inv[m]) * ToF(ww.v[e]));
        } else {
          res.v[e] = FromF<T>((v - mean[m]) * inv[m] * ToF(ww.v[e]) + ToF(bb.v[e]));
        }
      }
      xo[m * nvec + j] = res;
    }
  }
  __syncthreads();
}

// N != kNone: x holds the residual rows (gathered through `gather` when given) and is normalised
// into dynamic shared memory (M * k elements) with nw, nb and eps first.
template <typename T, int M, int R, GemvEpilogue E, NormKind N>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    GemvKernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
               void* __restrict__ y, int n, int k, int units, const int32_t* __restrict__ gather,
               const T* __restrict__ nw, const T* __restrict__ nb, float eps) {
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  const int lane = threadIdx.x & 31;
  const bool active = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5) < units;
  // Every warp takes part in the norm's barriers; an idle warp of the last block mirrors the last
  // unit and stores nothing.
  if constexpr (N == NormKind::kNone) {
    if (!active) return;
  }
  const int unit = min(blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5), units - 1);
  // Rows past N (the last unit of an odd N with R = 2) read row N - 1 and are not stored.
  const int rows_total = E == GemvEpilogue::kSwiGlu ? 2 * n : n;
  const T* wrow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = min(WeightRow<E, R>(unit, r, n), rows_total - 1);
    wrow[r] = w + static_cast<size_t>(row) * k;
  }
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
  }
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
  const T* xs = x;  // the rows multiplied: global x, or the normalised rows in shared memory
  if constexpr (N != NormKind::kNone) {
    __shared__ float scratch[M * 8];
    T* x_s = reinterpret_cast<T*>(gemv_smem);
    const int nvec = k / 8;
    // From L2: the rows were written by the kernel this one waited for.
    for (int i = threadIdx.x; i < M * nvec; i += kWarpsPerBlock * 32) {
      const int m = i / nvec, j = i % nvec;
      const int row = gather != nullptr ? gather[m] : m;
      reinterpret_cast<uint4*>(x_s)[i] =
          __ldcg(reinterpret_cast<const uint4*>(x + static_cast<size_t>(row) * k) + j);
    }
    __syncthreads();
    NormalizeRows<T, M, N == NormKind::kRms>(x_s, nw, nb, k, eps, scratch);
    xs = x_s;
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
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float xf[8];
        const uint4* xp = reinterpret_cast<const uint4*>(xs + static_cast<size_t>(m) * k + kk);
        if constexpr (N == NormKind::kNone) {
          Unpack<T>(__ldg(xp), xf);
        } else {
          Unpack<T>(*xp, xf);
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
  if (!active) return;
  // Every lane holds every sum; lane (r', m) stores output (r', m) (one per lane).
  if constexpr (E == GemvEpilogue::kSwiGlu) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (lane != m) continue;
      // As Hugging Face: both projections rounded, silu(gate) rounded, then the product.
      const float g = RoundTo<T>(acc[0][m]), up = RoundTo<T>(acc[1][m]);
      const float s = RoundTo<T>(g / (1.0f + expf(-g)));
      static_cast<T*>(y)[static_cast<size_t>(m) * n + unit] = FromF<T>(s * up);
    }
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const int col = unit * R + r;
        if (lane != r * M + m || col >= n) continue;
        float v = acc[r][m];
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
  const void* w = nullptr;
  const void* b = nullptr;
  float eps = 0.0f;
};

template <typename T, int M, int R, GemvEpilogue E, NormKind N>
cudaError_t Launch(const void* x, const void* w, const void* bias, void* y, int n, int k,
                   const NormArgs& norm, cudaStream_t stream, bool pdl) {
  const int units = E == GemvEpilogue::kSwiGlu ? n : (n + R - 1) / R;
  const int blocks = (units + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const size_t smem = N == NormKind::kNone ? 0 : static_cast<size_t>(M) * k * sizeof(T);
  auto* kernel = GemvKernel<T, M, R, E, N>;
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  // With pdl: start before the previous kernel ends (see WaitForPrerequisites).
  return LaunchKernel(kernel, dim3(blocks), dim3(kWarpsPerBlock * 32), smem, stream, pdl,
                      static_cast<const T*>(x), static_cast<const T*>(w),
                      static_cast<const T*>(bias), y, n, k, units, norm.gather,
                      static_cast<const T*>(norm.w), static_cast<const T*>(norm.b), norm.eps);
}

template <typename T, GemvEpilogue E, NormKind N>
cudaError_t LaunchForRows(int m, const void* x, const void* w, const void* bias, void* y, int n,
                          int k, const NormArgs& norm, cudaStream_t stream, bool pdl) {
  // Two weight rows per warp at M >= 4 halve the x traffic through L1 per weight byte; SwiGLU
  // already reads two rows (gate and up) per warp.
  constexpr int R1 = E == GemvEpilogue::kSwiGlu ? 2 : 1;
  constexpr int R2 = 2;
  switch (m) {
    case 1: return Launch<T, 1, R1, E, N>(x, w, bias, y, n, k, norm, stream, pdl);
    case 2: return Launch<T, 2, R1, E, N>(x, w, bias, y, n, k, norm, stream, pdl);
    case 4: return Launch<T, 4, R2, E, N>(x, w, bias, y, n, k, norm, stream, pdl);
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
      return LaunchForRows<T, GemvEpilogue::kSwiGlu, N>(m, x, w, bias, y, n, k, norm, stream,
                                                        pdl);
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

absl::Status GemvNorm(DType dtype, GemvEpilogue epilogue, bool rms, const void* x,
                      const int32_t* gather, const void* norm_w, const void* norm_b, float eps,
                      const void* w, const void* bias, void* y, int rows, int out, int in,
                      cudaStream_t stream, bool pdl) {
  if (!GemvNormSupported(rows, in)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GEMV with a folded norm takes 1, 2 or 4 rows and an input width that is a multiple of 8 "
        "and at most ", kGemvNormMaxIn, ", got rows ", rows, ", in ", in));
  }
  if (out < 1) return absl::InvalidArgumentError(absl::StrCat("GEMV output width ", out, " < 1"));
  if (epilogue == GemvEpilogue::kResidual) {
    return absl::InvalidArgumentError(
        "GEMV with a folded norm does not add into the stream it normalises");
  }
  if (norm_w == nullptr || (!rms && norm_b == nullptr)) {
    return absl::InvalidArgumentError(rms ? "RMSNorm needs a weight"
                                          : "LayerNorm needs a weight and a bias");
  }
  if (!Aligned16(x) || !Aligned16(w) || !Aligned16(norm_w) || (!rms && !Aligned16(norm_b))) {
    return absl::InvalidArgumentError(
        "GEMV with a folded norm needs 16-byte aligned x, w and norm weights");
  }
  NormArgs norm;
  norm.gather = gather;
  norm.w = norm_w;
  norm.b = norm_b;
  norm.eps = eps;
  TANDEM_DISPATCH_HALF(dtype, {
    if (rms) {
      CUDA_CHECK((LaunchEpilogue<T, NormKind::kRms>(epilogue, rows, x, w, bias, y, out, in, norm,
                                                    stream, pdl)));
    } else {
      CUDA_CHECK((LaunchEpilogue<T, NormKind::kLayer>(epilogue, rows, x, w, bias, y, out, in,
                                                      norm, stream, pdl)));
    }
  });
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace tandem::cuda
