// KV blocks (worker/stage.h) to and from the KV-cache: one slot's positions regathered between the
// cache's per-head layout and the block's per-position one, so that a block crosses the bus in one
// contiguous copy per tensor instead of one per head. The same for a sequence's pages (kv_pages.h).
#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/kernels.h"
#include "worker/cuda/kv_pages.h"
#include "worker/cuda/kv_view.cuh"

namespace tandem::cuda {
namespace {

// One thread per 4-byte word: a pair of 16-bit elements (head_dim is even, so a pair never
// straddles two heads), or 4 FP8 codes (head_dim % 4 == 0 in pages). i indexes the block's words:
// position p, then head h, then word d within the head. `seq`: the slot (SlotKv) or table row
// (PagedKv); `per_word`: elements per word, 2 or 4.
template <bool kToBlock, typename Kv>
__global__ void KvBlockCopyKernel(uint32_t* __restrict__ k_cache, uint32_t* __restrict__ v_cache,
                                  uint32_t* __restrict__ k_block, uint32_t* __restrict__ v_block,
                                  int64_t words, int head_words, int row_words, Kv kv, int seq,
                                  int per_word) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < words;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t p = i / row_words;
    const int r = static_cast<int>(i - p * row_words);
    const int h = r / head_words, d = r - h * head_words;
    const size_t c = kv.Offset(seq, h, static_cast<int>(p)) / per_word + d;
    if (kToBlock) {
      k_block[i] = k_cache[c];
      v_block[i] = v_cache[c];
    } else {
      k_cache[c] = k_block[i];
      v_cache[c] = v_block[i];
    }
  }
}

template <typename Kv>
absl::Status LaunchCopy(void* k_cache, void* v_cache, Kv kv, int seq, void* k_block, void* v_block,
                        int positions, int num_kv_heads, int head_dim, bool to_block,
                        cudaStream_t stream, int per_word = 2) {
  if (positions == 0) return absl::OkStatus();
  const int head_words = head_dim / per_word;
  const int row_words = num_kv_heads * head_words;
  const int64_t words = int64_t{positions} * row_words;
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((words + kThreads - 1) / kThreads, 4096));
  auto* kc = static_cast<uint32_t*>(k_cache);
  auto* vc = static_cast<uint32_t*>(v_cache);
  auto* kb = static_cast<uint32_t*>(k_block);
  auto* vb = static_cast<uint32_t*>(v_block);
  if (to_block) {
    KvBlockCopyKernel<true, Kv><<<blocks, kThreads, 0, stream>>>(kc, vc, kb, vb, words, head_words,
                                                                 row_words, kv, seq, per_word);
  } else {
    KvBlockCopyKernel<false, Kv><<<blocks, kThreads, 0, stream>>>(kc, vc, kb, vb, words, head_words,
                                                                  row_words, kv, seq, per_word);
  }
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchKvBlockCopy(void* k_cache, void* v_cache, int slot, void* k_block,
                               void* v_block, int positions, int num_kv_heads, int head_dim,
                               int seq_capacity, bool to_block, cudaStream_t stream) {
  return LaunchCopy(k_cache, v_cache, SlotKv{num_kv_heads, seq_capacity, head_dim}, slot, k_block,
                    v_block, positions, num_kv_heads, head_dim, to_block, stream);
}

absl::Status LaunchKvBlockCopyPaged(const KvPages& pages, int seq, void* k_block, void* v_block,
                                    int positions, int num_kv_heads, int head_dim, bool to_block,
                                    cudaStream_t stream) {
  RETURN_IF_ERROR(CheckKvPages(pages, head_dim, "KV block copy to or from pages"));
  if (positions > int64_t{pages.table_stride} * pages.page_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV block copy: ", positions, " positions exceed the block table's ", pages.table_stride,
        " pages of ", pages.page_size));
  }
  // FP8 pages move as their codes, 4 a word.
  return LaunchCopy(pages.k, pages.v, ToPagedKv(pages, num_kv_heads, head_dim), seq, k_block,
                    v_block, positions, num_kv_heads, head_dim, to_block, stream,
                    pages.fp8 ? 4 : 2);
}

}  // namespace tandem::cuda
