// Decode projections for a few rows (M in {1, 2, 4, 8}): y (M, N) = x (M, K) · wᵀ with w (N, K)
// row-major, read once with 16-byte streaming loads. At M <= 8 the product is bound by the weight
// bytes, and cuBLAS's tiled kernels (plus their split-K reduction kernels) leave bandwidth unused.
//
// One warp computes R output rows over all M inputs: each lane takes 8 consecutive elements of
// K per 256-element step, U steps of weights loaded before the first use so that enough bytes are
// in flight; x (a few KB, shared by every warp) comes through L1. fp32 accumulation, a warp
// reduction, then the epilogue (bias, residual add, GELU, SwiGLU or fp32 logits) in registers.
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

template <typename T, int M, int R, GemvEpilogue E>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    GemvKernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
               void* __restrict__ y, int n, int k, int units) {
  const int lane = threadIdx.x & 31;
  const int unit = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  if (unit >= units) return;
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
        Unpack<T>(__ldg(reinterpret_cast<const uint4*>(x + static_cast<size_t>(m) * k + kk)), xf);
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

template <typename T, int M, int R, GemvEpilogue E>
cudaError_t Launch(const void* x, const void* w, const void* bias, void* y, int n, int k,
            cudaStream_t stream) {
  const int units = E == GemvEpilogue::kSwiGlu ? n : (n + R - 1) / R;
  const int blocks = (units + kWarpsPerBlock - 1) / kWarpsPerBlock;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kWarpsPerBlock * 32);
  cfg.stream = stream;
  // On a stream of our own: start before the previous kernel ends (see WaitForPrerequisites).
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = stream != nullptr ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, GemvKernel<T, M, R, E>, static_cast<const T*>(x),
                     static_cast<const T*>(w), static_cast<const T*>(bias), y, n, k, units);
}

template <typename T, GemvEpilogue E>
cudaError_t LaunchForRows(int m, const void* x, const void* w, const void* bias, void* y, int n,
                          int k, cudaStream_t stream) {
  // Two weight rows per warp at M >= 4 halve the x traffic through L1 per weight byte; SwiGLU
  // already reads two rows (gate and up) per warp.
  constexpr int R1 = E == GemvEpilogue::kSwiGlu ? 2 : 1;
  constexpr int R2 = 2;
  switch (m) {
    case 1: return Launch<T, 1, R1, E>(x, w, bias, y, n, k, stream);
    case 2: return Launch<T, 2, R1, E>(x, w, bias, y, n, k, stream);
    case 4: return Launch<T, 4, R2, E>(x, w, bias, y, n, k, stream);
    default: return Launch<T, 8, R2, E>(x, w, bias, y, n, k, stream);
  }
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
  TANDEM_DISPATCH_HALF(dtype, {
    switch (epilogue) {
      case GemvEpilogue::kStore:
        CUDA_CHECK(
            (LaunchForRows<T, GemvEpilogue::kStore>(rows, x, w, bias, y, out, in, stream)));
        break;
      case GemvEpilogue::kResidual:
        CUDA_CHECK(
            (LaunchForRows<T, GemvEpilogue::kResidual>(rows, x, w, bias, y, out, in, stream)));
        break;
      case GemvEpilogue::kGelu:
        CUDA_CHECK(
            (LaunchForRows<T, GemvEpilogue::kGelu>(rows, x, w, bias, y, out, in, stream)));
        break;
      case GemvEpilogue::kSwiGlu:
        CUDA_CHECK(
            (LaunchForRows<T, GemvEpilogue::kSwiGlu>(rows, x, w, bias, y, out, in, stream)));
        break;
      case GemvEpilogue::kF32:
        CUDA_CHECK(
            (LaunchForRows<T, GemvEpilogue::kF32>(rows, x, w, bias, y, out, in, stream)));
        break;
    }
  });
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace tandem::cuda
