// Residual-stream bias add: x += b on every row. The residual adds themselves are fused into the
// projections (cuBLAS with beta = 1 accumulates into the residual stream).
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/device_util.cuh"
#include "worker/cuda/kernels.h"

namespace tandem::cuda {
namespace {

template <typename T>
__global__ void AddBiasKernel(T* __restrict__ x, const T* __restrict__ bias, int cols) {
  T* row = x + static_cast<size_t>(blockIdx.x) * cols;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) row[i] = FromF<T>(ToF(row[i]) + ToF(bias[i]));
}

}  // namespace

absl::Status LaunchAddBias(DType dtype, void* x, const void* bias, int rows, int cols,
                           cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  TANDEM_DISPATCH_HALF(dtype, {
    AddBiasKernel<T><<<rows, 256, 0, stream>>>(static_cast<T*>(x), static_cast<const T*>(bias),
                                               cols);
  });
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace tandem::cuda
