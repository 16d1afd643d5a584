// Qwen3's per-head RMSNorm of q and k (q_norm, k_norm), in place in the QKV projection's rows,
// between the projection and the rotary embedding.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "common/dtype.h"

namespace tandem::cuda {

// qkv (rows, (num_heads + 2 num_kv_heads) * head_dim), dtype kF16 or kBF16: bias (that width)
// added first when given, then every q head RMSNorm-ed over head_dim with q_w (head_dim), every k
// head with k_w (head_dim), eps inside the root; v heads get the bias only.
absl::Status LaunchHeadNorm(DType dtype, void* qkv, const void* bias, const void* q_w,
                            const void* k_w, int rows, int num_heads, int num_kv_heads,
                            int head_dim, float eps, cudaStream_t stream);

}  // namespace tandem::cuda
