// LayerNorm (GPT-2) and RMSNorm (Llama), fp32 statistics, with the pending bias of the previous
// projection folded into the residual stream first and an optional row gather (final norm of the
// last positions only).
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/device_util.cuh"
#include "worker/cuda/kernels.h"

namespace tandem::cuda {
namespace {

constexpr int kNormThreads = 256;
// Elements a thread keeps in registers: cols <= kNormThreads * 8 * kMaxVecs (16384 with 8). The
// kernel is instantiated for 1, 2, 4 and 8 vectors and launched with the fewest that hold a row:
// registers sized for the widest rows would halve the blocks an SM holds at common widths (4,096),
// and the read, reduce, write sequence of a row needs those blocks to keep memory busy.
constexpr int kMaxVecs = 8;
constexpr int kPrefetchVecs = 2;  // of the norm weights, loaded at the start

// One block per output row. The row is read once with 16-byte loads into registers (cols % 8 == 0
// and cols <= 16384, checked by the launcher), so the statistics and the output need no re-read.
template <typename T, bool kRms, int kVecs>
__global__ void __launch_bounds__(kNormThreads)
NormKernel(T* __restrict__ x, const T* __restrict__ bias, const T* __restrict__ w,
           const T* __restrict__ b, const int32_t* __restrict__ gather, T* __restrict__ out,
           int cols, float eps) {
  __shared__ float scratch[32];
  constexpr int kPre = kVecs < kPrefetchVecs ? kVecs : kPrefetchVecs;
  AllowDependentLaunch();  // the projection that reads `out` may start prefetching its weights
  const int nvec = cols / 8;
  // The norm's own weights first (of rows up to kPrefetchVecs * 2048 wide): no kernel writes
  // them, and their loads (from DRAM, as the projections stream through L2) then overlap those
  // of x instead of following the statistics.
  const Vec8<T>* wv = reinterpret_cast<const Vec8<T>*>(w);
  const Vec8<T>* bv = reinterpret_cast<const Vec8<T>*>(b);
  Vec8<T> wreg[kPre], breg[kPre];
#pragma unroll
  for (int k = 0; k < kPre; ++k) {
    const int j = threadIdx.x + k * kNormThreads;
    if (j < nvec) {
      wreg[k] = wv[j];
      if constexpr (!kRms) breg[k] = bv[j];
    }
  }
  WaitForPrerequisites();  // x is the previous kernel's output
  const int i = blockIdx.x;
  const int r = gather != nullptr ? gather[i] : i;
  Vec8<T>* xr = reinterpret_cast<Vec8<T>*>(x + static_cast<size_t>(r) * cols);
  float v[kVecs][8];
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int j = threadIdx.x + k * kNormThreads;
    if (j < nvec) {
      Vec8<T> a = xr[j];
      if (bias != nullptr) {
        const Vec8<T> bb = reinterpret_cast<const Vec8<T>*>(bias)[j];
#pragma unroll
        for (int e = 0; e < 8; ++e) a.v[e] = FromF<T>(ToF(a.v[e]) + ToF(bb.v[e]));
        xr[j] = a;
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        v[k][e] = ToF(a.v[e]);
        sum += kRms ? v[k][e] * v[k][e] : v[k][e];
      }
    }
  }
  sum = BlockSum(sum, scratch);
  float mean = 0.0f, inv;
  if constexpr (kRms) {
    inv = rsqrtf(sum / cols + eps);
  } else {
    mean = sum / cols;
    float sq = 0.0f;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int j = threadIdx.x + k * kNormThreads;
      if (j < nvec) {
#pragma unroll
        for (int e = 0; e < 8; ++e) sq += (v[k][e] - mean) * (v[k][e] - mean);
      }
    }
    sq = BlockSum(sq, scratch);
    inv = rsqrtf(sq / cols + eps);
  }
  Vec8<T>* o = reinterpret_cast<Vec8<T>*>(out + static_cast<size_t>(i) * cols);
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int j = threadIdx.x + k * kNormThreads;
    if (j < nvec) {
      const Vec8<T> ww = k < kPre ? wreg[k] : wv[j];
      Vec8<T> res;
      if constexpr (kRms) {
        // As Hugging Face's LlamaRMSNorm: the normalised value is rounded to the activation type
        // before the weight multiplies it.
#pragma unroll
        for (int e = 0; e < 8; ++e) res.v[e] = FromF<T>(RoundTo<T>(v[k][e] * inv) * ToF(ww.v[e]));
      } else {
        const Vec8<T> bb = k < kPre ? breg[k] : bv[j];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          res.v[e] = FromF<T>((v[k][e] - mean) * inv * ToF(ww.v[e]) + ToF(bb.v[e]));
        }
      }
      o[j] = res;
    }
  }
}

}  // namespace

absl::Status LaunchNorm(DType dtype, bool rms, void* x, const void* bias, const void* w,
                        const void* b, const int32_t* gather, void* out, int rows, int cols,
                        float eps, cudaStream_t stream, bool pdl) {
  if (rows == 0) return absl::OkStatus();
  if (cols % 8 != 0 || cols > kNormThreads * 8 * kMaxVecs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "norm width ", cols, " must be a multiple of 8 and at most ", kNormThreads * 8 * kMaxVecs));
  }
  if (!rms && b == nullptr) return absl::InvalidArgumentError("LayerNorm needs a bias");
  TANDEM_DISPATCH_HALF(dtype, {
    auto* xt = static_cast<T*>(x);
    auto* bt = static_cast<const T*>(bias);
    auto* wt = static_cast<const T*>(w);
    auto* nb = static_cast<const T*>(b);
    auto* ot = static_cast<T*>(out);
    const int vecs = (cols / 8 + kNormThreads - 1) / kNormThreads;
    auto* kernel = rms ? NormKernel<T, true, kMaxVecs> : NormKernel<T, false, kMaxVecs>;
    if (vecs <= 1) {
      kernel = rms ? NormKernel<T, true, 1> : NormKernel<T, false, 1>;
    } else if (vecs <= 2) {
      kernel = rms ? NormKernel<T, true, 2> : NormKernel<T, false, 2>;
    } else if (vecs <= 4) {
      kernel = rms ? NormKernel<T, true, 4> : NormKernel<T, false, 4>;
    }
    CUDA_CHECK(LaunchKernel(kernel, dim3(rows), dim3(kNormThreads), 0, stream, pdl, xt, bt, wt, nb,
                            gather, ot, cols, eps));
  });
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace tandem::cuda
