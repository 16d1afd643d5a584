// Residual-stream bias add: x += b on every row, and a gather of rows. The residual adds
// themselves are fused into the projections (cuBLAS with beta = 1 accumulates into the residual
// stream).
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

// Row i of dst = row gather[i] of src, one block per row, in units of U (16 or 1 bytes).
template <typename U>
__global__ void GatherRowsKernel(const U* __restrict__ src, const int32_t* __restrict__ gather,
                                 U* __restrict__ dst, size_t row_units) {
  const U* from = src + static_cast<size_t>(gather[blockIdx.x]) * row_units;
  U* to = dst + static_cast<size_t>(blockIdx.x) * row_units;
  for (size_t i = threadIdx.x; i < row_units; i += blockDim.x) to[i] = from[i];
}

}  // namespace

absl::Status LaunchGatherRows(const void* src, const int32_t* gather, void* dst, int rows,
                              size_t row_bytes, cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  const bool vec = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  if (vec) {
    GatherRowsKernel<<<rows, 128, 0, stream>>>(static_cast<const uint4*>(src), gather,
                                               static_cast<uint4*>(dst), row_bytes / 16);
  } else {
    GatherRowsKernel<<<rows, 128, 0, stream>>>(static_cast<const unsigned char*>(src), gather,
                                               static_cast<unsigned char*>(dst), row_bytes);
  }
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

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
