// The Hopper prefill attention (prefill_attention_sm90.cu: warpgroup MMA, TMA, head_dim 64 and
// 128), which LaunchPrefillAttention takes where it can run.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "worker/cuda/kernels.h"
#include "worker/cuda/kv_pages.h"

namespace tandem::cuda {

// Whether the current device (compute capability 9.0) and these arguments (head_dim 64 or 128,
// 16-byte aligned q and caches) can take LaunchPrefillAttentionSm90.
bool PrefillAttentionSm90Usable(int head_dim, const void* q, const void* k_cache,
                                const void* v_cache);

// LaunchPrefillAttention's contract for head_dim 64 and 128, with arguments already checked.
absl::Status LaunchPrefillAttentionSm90(DType dtype, const void* q, const void* k_cache,
                                        const void* v_cache, const int32_t* positions,
                                        const int32_t* slots, void* out, int rows, int num_heads,
                                        int num_kv_heads, int head_dim, int seq_capacity,
                                        const AttentionParams& params, cudaStream_t stream,
                                        bool pdl);

// Smallest page the warpgroup-MMA kernel reads (a box per page must start on a 1024-byte swizzle
// atom of its tile); LaunchPrefillAttentionPaged takes the mma.sync kernel for smaller pages.
constexpr int kMinSm90PageSize = 8;

// LaunchPrefillAttentionPaged's contract for head_dim 64 and 128 and pages of at least
// kMinSm90PageSize positions, with arguments already checked.
absl::Status LaunchPrefillAttentionSm90Paged(DType dtype, const void* q, const KvPages& pages,
                                             const int32_t* positions, const int32_t* seqs,
                                             void* out, int rows, int num_heads,
                                             int num_kv_heads, int head_dim,
                                             const AttentionParams& params, cudaStream_t stream,
                                             bool pdl);

}  // namespace tandem::cuda
