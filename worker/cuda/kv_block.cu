// KV blocks (worker/stage.h) to and from the KV-cache: one slot's positions regathered between the
// cache's per-head layout and the block's per-position one, so that a block crosses the bus in one
// contiguous copy per tensor instead of one per head.
#include <algorithm>
#include <cstdint>

#include "worker/cuda/cuda_check.h"
#include "worker/cuda/kernels.h"

namespace tandem::cuda {
namespace {

// One thread per pair of elements (head_dim is even, so a pair never straddles two heads and a
// 4-byte word copies it whatever the 16-bit dtype). i indexes the block's words: position p, then
// head h, then pair d within the head.
template <bool kToBlock>
__global__ void KvBlockCopyKernel(uint32_t* __restrict__ k_cache, uint32_t* __restrict__ v_cache,
                                  uint32_t* __restrict__ k_block, uint32_t* __restrict__ v_block,
                                  int64_t words, int head_words, int row_words, int seq_capacity,
                                  int64_t slot_words) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < words;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t p = i / row_words;
    const int r = static_cast<int>(i - p * row_words);
    const int h = r / head_words, d = r - h * head_words;
    const int64_t c = slot_words + (int64_t{h} * seq_capacity + p) * head_words + d;
    if (kToBlock) {
      k_block[i] = k_cache[c];
      v_block[i] = v_cache[c];
    } else {
      k_cache[c] = k_block[i];
      v_cache[c] = v_block[i];
    }
  }
}

}  // namespace

absl::Status LaunchKvBlockCopy(void* k_cache, void* v_cache, int slot, void* k_block,
                               void* v_block, int positions, int num_kv_heads, int head_dim,
                               int seq_capacity, bool to_block, cudaStream_t stream) {
  if (positions == 0) return absl::OkStatus();
  const int head_words = head_dim / 2;
  const int row_words = num_kv_heads * head_words;
  const int64_t words = int64_t{positions} * row_words;
  const int64_t slot_words = int64_t{slot} * num_kv_heads * seq_capacity * head_words;
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((words + kThreads - 1) / kThreads, 4096));
  auto* kc = static_cast<uint32_t*>(k_cache);
  auto* vc = static_cast<uint32_t*>(v_cache);
  auto* kb = static_cast<uint32_t*>(k_block);
  auto* vb = static_cast<uint32_t*>(v_block);
  if (to_block) {
    KvBlockCopyKernel<true><<<blocks, kThreads, 0, stream>>>(kc, vc, kb, vb, words, head_words,
                                                             row_words, seq_capacity, slot_words);
  } else {
    KvBlockCopyKernel<false><<<blocks, kThreads, 0, stream>>>(kc, vc, kb, vb, words, head_words,
                                                              row_words, seq_capacity, slot_words);
  }
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace tandem::cuda
