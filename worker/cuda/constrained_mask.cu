// Constrained decoding's token masks applied to the logits on the device, one thread per
// vocabulary id: a row's 16 KB of bits (128k ids) is read once per warp and its logits written
// coalesced.
#include <cfloat>
#include <cstdint>

#include "worker/cuda/constrained_mask.h"
#include "worker/cuda/cuda_check.h"

namespace tandem::cuda {
namespace {

constexpr int kThreads = 256;

// Grid (mask rows, vocab / kThreads).
__global__ void MaskLogitsKernel(float* __restrict__ logits, int vocab,
                                 const uint32_t* __restrict__ masks, int words,
                                 const int32_t* __restrict__ mask_rows) {
  const int k = blockIdx.x;
  const int id = blockIdx.y * kThreads + threadIdx.x;
  if (id >= vocab) return;
  const int word = id >> 5;
  const bool allowed =
      word < words && ((masks[static_cast<size_t>(k) * words + word] >> (id & 31)) & 1u);
  if (!allowed) logits[static_cast<size_t>(mask_rows[k]) * vocab + id] = -INFINITY;
}

}  // namespace

absl::Status LaunchMaskLogits(float* logits, int vocab, const uint32_t* masks, int words,
                              const int32_t* mask_rows, int rows, cudaStream_t stream) {
  if (rows == 0 || vocab == 0) return absl::OkStatus();
  const dim3 grid(rows, (vocab + kThreads - 1) / kThreads);
  MaskLogitsKernel<<<grid, kThreads, 0, stream>>>(logits, vocab, masks, words, mask_rows);
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace tandem::cuda
