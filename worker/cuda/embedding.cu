// Token (and, for GPT-2, learned position) embedding lookup.
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/device_util.cuh"
#include "worker/cuda/kernels.h"

namespace tandem::cuda {
namespace {

// One block per row; threads stride over the hidden dimension.
template <typename T>
__global__ void EmbeddingKernel(const int32_t* __restrict__ tokens,
                                const int32_t* __restrict__ positions,
                                const T* __restrict__ tok_emb, const T* __restrict__ pos_emb,
                                T* __restrict__ out, int hidden, const int32_t* previous) {
  AllowDependentLaunch();  // the first projection may start prefetching its weights
  WaitForPrerequisites();  // `out` may still be read by the kernel before this one
  const int r = blockIdx.x;
  int32_t token = tokens[r];
  if (token < 0 && previous != nullptr) token = previous[-1 - token];
  const T* te = tok_emb + static_cast<size_t>(token) * hidden;
  const T* pe = pos_emb != nullptr ? pos_emb + static_cast<size_t>(positions[r]) * hidden : nullptr;
  T* o = out + static_cast<size_t>(r) * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = ToF(te[i]);
    if (pe != nullptr) v += ToF(pe[i]);
    o[i] = FromF<T>(v);
  }
}

}  // namespace

absl::Status LaunchEmbedding(DType dtype, const int32_t* tokens, const int32_t* positions,
                             const void* tok_emb, const void* pos_emb, void* out, int rows,
                             int hidden, cudaStream_t stream, bool pdl,
                             const int32_t* previous) {
  if (rows == 0) return absl::OkStatus();
  TANDEM_DISPATCH_HALF(dtype, {
    CUDA_CHECK(LaunchKernel(EmbeddingKernel<T>, dim3(rows), dim3(256), 0, stream, pdl, tokens,
                            positions, static_cast<const T*>(tok_emb),
                            static_cast<const T*>(pos_emb), static_cast<T*>(out), hidden,
                            previous));
  });
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace tandem::cuda
