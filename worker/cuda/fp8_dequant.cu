// FP8 weights to fp16/bf16 for the GEMM path: one thread per 8 codes, the row's scale applied in
// fp32 and rounded once.
#include <cuda_fp8.h>

#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/device_util.cuh"
#include "worker/cuda/kernels.h"

namespace tandem::cuda {
namespace {

template <typename T>
__global__ void DequantizeFp8RowsKernel(const uint2* __restrict__ codes,
                                        const float* __restrict__ row_scales, T* __restrict__ out,
                                        int64_t groups, int64_t groups_per_row) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const float scale = row_scales[g / groups_per_row];
  const uint2 v = codes[g];
  const uint32_t u[2] = {v.x, v.y};
  alignas(16) T vals[8];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float2 f = Fp8PairToFloat2(u[i] >> (16 * j));
      vals[4 * i + 2 * j] = FromF<T>(f.x * scale);
      vals[4 * i + 2 * j + 1] = FromF<T>(f.y * scale);
    }
  }
  *reinterpret_cast<uint4*>(out + g * 8) = *reinterpret_cast<const uint4*>(vals);
}

}  // namespace

absl::Status LaunchDequantizeFp8Rows(DType dtype, const void* codes, const float* row_scales,
                                     void* out, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows < 0 || cols <= 0 || cols % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FP8 dequantization takes a width that is a positive multiple of 8, got ", cols));
  }
  if ((reinterpret_cast<uintptr_t>(codes) & 7) != 0 ||
      (reinterpret_cast<uintptr_t>(out) & 15) != 0) {
    return absl::InvalidArgumentError(
        "FP8 dequantization needs 8-byte aligned codes and a 16-byte aligned output");
  }
  const int64_t groups = rows * cols / 8;
  if (groups == 0) return absl::OkStatus();
  constexpr int kThreads = 256;
  const int64_t blocks = (groups + kThreads - 1) / kThreads;
  TANDEM_DISPATCH_HALF(dtype, {
    DequantizeFp8RowsKernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<const uint2*>(codes), row_scales, static_cast<T*>(out), groups, cols / 8);
  });
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace tandem::cuda
