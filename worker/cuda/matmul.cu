// Every projection and the LM head: cuBLAS GEMMs with fp16/bf16 inputs and fp32 accumulation.
#include <cublas_v2.h>

#include "worker/cuda/cuda_check.h"
#include "worker/cuda/kernels.h"

namespace tandem::cuda {

// Row-major y (rows, out) = x (rows, in) · wᵀ is column-major yᵀ (out, rows) = W · xᵀ where the
// row-major (out, in) weight read column-major is Wᵀ (in, out): op(A) = T with lda = in.
absl::Status Gemm(cublasHandle_t handle, DType dtype, const void* x, const void* w, void* y,
                  int rows, int out, int in, float beta, bool y_f32) {
  if (rows == 0) return absl::OkStatus();
  cudaDataType_t t;
  if (dtype == DType::kF16) {
    t = CUDA_R_16F;
  } else if (dtype == DType::kBF16) {
    t = CUDA_R_16BF;
  } else {
    return absl::InvalidArgumentError("GEMM takes fp16 or bf16 operands");
  }
  const float alpha = 1.0f;
  CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, &alpha, w, t, in, x,
                            t, in, &beta, y, y_f32 ? CUDA_R_32F : t, out, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

}  // namespace tandem::cuda
