// The paged KV-cache's kernels: the same operations as the contiguous cache's launchers
// (kernels.h, prefill_attention.h) with each layer's K and V held in pools of pages and each row
// finding its positions through its sequence's block table instead of a slot.
//
// Layout of one layer: K and V are (num_pages, num_kv_heads, page_size, head_dim), page-major, so
// that a page holds every kv head of page_size consecutive positions and one head's part of a page
// (page_size * head_dim elements) is a contiguous run: the attention kernels load their key tiles
// from it with the same vector loads as from a slot's run. Position p of the sequence whose table
// row is s lives in page block_table[s * table_stride + p / page_size], at offset p % page_size.
//
// Page size: a power of two >= 4 (kMinKvPageSize). Every page boundary then falls on a tile
// boundary of the 64-key tiles or a tile lies inside one page, and with head_dim a multiple of 4
// an 8-byte load (16-byte where head_dim % 8 == 0) never straddles two keys. Both are checked at
// launch (CheckKvPages); decode attention with head_dim % 8 != 0 needs its register kernel's
// shapes too (PagedDecodeAttentionTakes).
//
// Numerics: every paged kernel performs the same arithmetic in the same order as its contiguous
// counterpart, so for the same K and V (scattered over pages or held in a slot) the outputs are
// bit-identical. The one exception is the prefill attention on compute capability 9.0 with
// head_dim 64 or 128 and pages of fewer than 8 positions: the paged launcher runs the mma.sync
// kernel there, the contiguous one the warpgroup-MMA kernel; the two agree within fp16/bf16
// rounding of the output. With larger pages both take the warpgroup-MMA kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "worker/cuda/kernels.h"

namespace tandem::cuda {

// Smallest page the kernels take (positions per page); sizes are powers of two from here on.
constexpr int kMinKvPageSize = 4;

// One layer's paged K and V and the block tables that map positions to pages, device memory.
struct KvPages {
  void* k = nullptr;  // (num_pages, num_kv_heads, page_size, head_dim), 16-byte aligned
  void* v = nullptr;  // as k
  int num_pages = 0;
  int page_size = 0;  // positions per page: a power of two >= kMinKvPageSize
  // (sequences, table_stride) page ids; a row r of the launch reads table row seqs[r], which must
  // hold the pages of every position its attention reads (those of [window start, position]).
  const int32_t* block_table = nullptr;
  int table_stride = 0;  // entries per table row: the most pages one sequence may hold
  // FP8 KV-cache (--kv_cache_dtype fp8): k and v hold E4M3 codes, one byte an element, of the
  // values divided by the layer's scales (a value is E4M3(code) * scale); otherwise elements of the
  // activations' dtype and the scales unused.
  bool fp8 = false;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
};

// OK when `pages` suits heads of head_dim (a multiple of 4): pointers set and aligned, page size a
// power of two >= kMinKvPageSize, a table with a positive stride, FP8 scales positive and finite.
// `what` names the caller.
absl::Status CheckKvPages(const KvPages& pages, int head_dim, const char* what);

// Whether LaunchAttentionPaged takes heads of head_dim with `group` query heads per kv head: a
// multiple of 8 whatever the group; otherwise a multiple of 4 up to 128 (OpenLLaMA-3B's 100) with
// at most 8 query heads per kv head (CudaPagesTakeHeads, common/model_config.h).
bool PagedDecodeAttentionTakes(int head_dim, int group);

// Whether the paged kernels take FP8 codes (KvPages::fp8) for heads of head_dim with `group`
// query heads per kv head: decode attention's register kernel only, head_dim a multiple of 4 up to
// 128 and at most 8 query heads per kv head. Prefill over codes runs the mma.sync kernel, which
// converts them to fp16/bf16 as it stages its tiles.
bool Fp8PagedAttentionTakes(int head_dim, int group);

// As LaunchQkvRopeCache, writing k and v of row r at positions[r] through table row seqs[r].
absl::Status LaunchQkvRopeCachePaged(DType dtype, const void* qkv, const void* bias, void* q_out,
                                     const KvPages& pages, const int32_t* positions,
                                     const int32_t* seqs, int rows, int num_heads, int num_kv_heads,
                                     int head_dim, const float* inv_freq, cudaStream_t stream,
                                     bool pdl = false);

// As GemvQkvCache (GemvQkvCacheFp8 with w_scales set), with cache.k_cache, cache.v_cache and
// cache.seq_capacity unused: k and v go through `pages`, row r's table row being cache.slots[r].
absl::Status GemvQkvCachePaged(DType dtype, const void* x, const void* w, const float* w_scales,
                               const void* bias, const QkvCacheArgs& cache, const KvPages& pages,
                               int rows, int in, cudaStream_t stream, GemvTuning tuning = {});

// As LaunchAttention (decode, split-K), row r reading keys [0, positions[r]] through table row
// seqs[r]. Same partials and counters.
absl::Status LaunchAttentionPaged(DType dtype, const void* q, const KvPages& pages,
                                  const int32_t* positions, const int32_t* seqs, float* partials,
                                  void* out, int rows, int num_heads, int num_kv_heads,
                                  int head_dim, int splits, const AttentionParams& params,
                                  cudaStream_t stream, uint32_t* counters, bool pdl = false);

// As LaunchPrefillAttention (runs of rows of one sequence at consecutive positions are fast; any
// rows are correct), through the table rows seqs[r]: the warpgroup-MMA kernel where the contiguous
// launcher takes it and pages hold >= 8 positions (kMinSm90PageSize), the mma.sync kernel
// elsewhere.
absl::Status LaunchPrefillAttentionPaged(DType dtype, const void* q, const KvPages& pages,
                                         const int32_t* positions, const int32_t* seqs, void* out,
                                         int rows, int num_heads, int num_kv_heads, int head_dim,
                                         const AttentionParams& params, cudaStream_t stream,
                                         bool pdl = false);

// As LaunchKvBlockCopy: positions [0, positions) of the sequence whose table row is `seq`, between
// the pages and a KV block layer (positions, kv_heads * head_dim), of FP8 codes (one byte an
// element) where the pages hold them.
absl::Status LaunchKvBlockCopyPaged(const KvPages& pages, int seq, void* k_block, void* v_block,
                                    int positions, int num_kv_heads, int head_dim, bool to_block,
                                    cudaStream_t stream);

}  // namespace tandem::cuda
