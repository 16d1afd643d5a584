// The Hopper prefill attention (prefill_attention_sm90.cu: warpgroup MMA, TMA, head_dim 64 and
// 128), which LaunchPrefillAttention takes where it can run.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "worker/cuda/kernels.h"

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

}  // namespace tandem::cuda
