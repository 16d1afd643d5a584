// Launcher of the tensor-core prefill attention (prefill_attention.cu): the many-rows-per-sequence
// counterpart of LaunchAttention over the same KV-cache layout.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "worker/cuda/kernels.h"

namespace tandem::cuda {

// head_dim values the kernel is compiled for: multiples of 8 up to 128, and 100 and 108 (padded
// to 112 in shared memory).
bool PrefillAttentionSupported(int head_dim);

// As LaunchAttention with one split and the same arguments: each row's query attends to keys
// [0, positions[r]] of its slot (the last params.window of them when a window is set; window 0:
// none), which the rows' own K and V must already be in. q (rows, num_heads * head_dim), out
// (rows, num_heads * head_dim), cache (slots, num_kv_heads, seq_capacity, head_dim), seq_capacity
// a multiple of 64. Fast when rows come in runs of one slot at consecutive positions (a prompt or
// a chunk of one: the chunk's queries see the cached prefix and themselves); any rows are correct,
// a block of 128 rows doing its key loop once per such run. On a device of compute capability 9.0
// with head_dim 64 or 128 the warpgroup-MMA kernel of prefill_attention_sm90.cu runs; elsewhere the
// mma.sync kernel of prefill_attention.cu.
absl::Status LaunchPrefillAttention(DType dtype, const void* q, const void* k_cache,
                                    const void* v_cache, const int32_t* positions,
                                    const int32_t* slots, void* out, int rows, int num_heads,
                                    int num_kv_heads, int head_dim, int seq_capacity,
                                    const AttentionParams& params, cudaStream_t stream,
                                    bool pdl = false);

}  // namespace tandem::cuda
