// Splits the fused QKV projection into the query buffer and the layer's KV-cache, adding the QKV
// bias (GPT-2, Qwen2) and applying rotary position embeddings (Llama, Hugging Face's rotate-half
// form).
#include <algorithm>

#include "worker/cuda/cuda_check.h"
#include "worker/cuda/device_util.cuh"
#include "worker/cuda/kernels.h"

namespace tandem::cuda {
namespace {

// grid (blocks over the work items, row groups): num_heads * half query pairs, num_kv_heads * half
// key pairs, kv_dim value elements; one item per thread, so that a decode step's single row still
// spreads over many multiprocessors; a block takes rows blockIdx.y, + gridDim.y, ..., so that a
// prefill of thousands of rows is not a grid of hundreds of thousands of short blocks (which
// block scheduling, not memory, bounded at 5x the copy time). A pair (i, i + half) of one head
// rotates by angle pos * inv_freq[i].
template <typename T>
__global__ void QkvRopeCacheKernel(const T* __restrict__ qkv, const T* __restrict__ bias,
                                   T* __restrict__ q_out, T* __restrict__ k_cache,
                                   T* __restrict__ v_cache, const int32_t* __restrict__ positions,
                                   const int32_t* __restrict__ slots, int rows, int num_heads,
                                   int num_kv_heads, int head_dim, int seq_capacity,
                                   const float* __restrict__ inv_freq) {
  AllowDependentLaunch();  // attention may start; it waits for the cache writes below
  WaitForPrerequisites();  // qkv is the previous kernel's output
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    const int pos = positions[r], slot = slots[r];
    const int q_dim = num_heads * head_dim, kv_dim = num_kv_heads * head_dim;
    const int half = head_dim / 2;
    const T* in = qkv + static_cast<size_t>(r) * (q_dim + 2 * kv_dim);
    auto load = [&](int c) {
      float v = ToF(in[c]);
      // The projection's output with its bias is what Hugging Face rounds and then uses.
      if (bias != nullptr) v = RoundTo<T>(v + ToF(bias[c]));
      return v;
    };
    auto cache_index = [&](int kvh, int d) {
      return KvCacheOffset(slot, kvh, pos, num_kv_heads, seq_capacity, head_dim) + d;
    };
    const int q_pairs = num_heads * half, k_pairs = num_kv_heads * half;
    const int w = blockIdx.x * blockDim.x + threadIdx.x;
    if (w < q_pairs + k_pairs) {
      const bool is_q = w < q_pairs;
      const int p = is_q ? w : w - q_pairs;
      const int head = p / half, i = p % half;
      const int base = is_q ? head * head_dim : q_dim + head * head_dim;
      float x1 = load(base + i), x2 = load(base + i + half);
      if (inv_freq != nullptr) RotateHalfPair<T>(x1, x2, pos, inv_freq[i]);
      if (is_q) {
        T* qo = q_out + static_cast<size_t>(r) * q_dim + head * head_dim;
        qo[i] = FromF<T>(x1);
        qo[i + half] = FromF<T>(x2);
      } else {
        k_cache[cache_index(head, i)] = FromF<T>(x1);
        k_cache[cache_index(head, i + half)] = FromF<T>(x2);
      }
    } else if (w < q_pairs + k_pairs + kv_dim) {
      const int c = w - q_pairs - k_pairs;
      v_cache[cache_index(c / head_dim, c % head_dim)] = FromF<T>(load(q_dim + kv_dim + c));
    }
  }
}

}  // namespace

absl::Status LaunchQkvRopeCache(DType dtype, const void* qkv, const void* bias, void* q_out,
                                void* k_cache, void* v_cache, const int32_t* positions,
                                const int32_t* slots, int rows, int num_heads, int num_kv_heads,
                                int head_dim, int seq_capacity, const float* inv_freq,
                                cudaStream_t stream, bool pdl) {
  if (rows == 0) return absl::OkStatus();
  if (head_dim % 2 != 0) return absl::InvalidArgumentError("head_dim must be even");
  TANDEM_DISPATCH_HALF(dtype, {
    const int items = num_heads * head_dim / 2 + num_kv_heads * head_dim / 2 + num_kv_heads * head_dim;
    constexpr int kMaxRowGroups = 256;
    const dim3 grid((items + 127) / 128, std::min(rows, kMaxRowGroups));
    CUDA_CHECK(LaunchKernel(QkvRopeCacheKernel<T>, grid, dim3(128), 0, stream, pdl,
                            static_cast<const T*>(qkv), static_cast<const T*>(bias),
                            static_cast<T*>(q_out), static_cast<T*>(k_cache),
                            static_cast<T*>(v_cache), positions, slots, rows, num_heads,
                            num_kv_heads, head_dim, seq_capacity, inv_freq));
  });
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace tandem::cuda
