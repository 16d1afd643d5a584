// Splits the fused QKV projection into the query buffer and the layer's KV-cache, adding the QKV
// bias (GPT-2, Qwen2) and applying rotary position embeddings (Llama, Hugging Face's rotate-half
// form). Two kernels with the same arithmetic per element: one spreading a few rows' elements over
// many blocks (decode), one taking a row per block with vector loads and each pair index's cos and
// sin computed once per row (prefill).
#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "common/status_macros.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/device_util.cuh"
#include "worker/cuda/kernels.h"
#include "worker/cuda/kv_pages.h"
#include "worker/cuda/kv_view.cuh"

namespace tandem::cuda {
namespace {

// grid (blocks over the work items, row groups): num_heads * half query pairs, num_kv_heads * half
// key pairs, kv_dim value elements; one item per thread, so that a decode step's single row still
// spreads over many multiprocessors; a block takes rows blockIdx.y, + gridDim.y, ..., so that a
// prefill of thousands of rows is not a grid of hundreds of thousands of short blocks (which
// block scheduling, not memory, bounded at 5x the copy time). A pair (i, i + half) of one head
// rotates by angle pos * inv_freq[i].
template <typename T, typename Kv>
__global__ void QkvRopeCacheKernel(const T* __restrict__ qkv, const T* __restrict__ bias,
                                   T* __restrict__ q_out, void* __restrict__ k_cache,
                                   void* __restrict__ v_cache,
                                   const int32_t* __restrict__ positions,
                                   const int32_t* __restrict__ slots, int rows, int num_heads,
                                   int num_kv_heads, int head_dim, Kv kv,
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
      return kv.Offset(slot, kvh, pos) + d;
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
        StoreKv<T>(k_cache, cache_index(head, i), RoundTo<T>(x1), kv, kv.KScale());
        StoreKv<T>(k_cache, cache_index(head, i + half), RoundTo<T>(x2), kv, kv.KScale());
      }
    } else if (w < q_pairs + k_pairs + kv_dim) {
      const int c = w - q_pairs - k_pairs;
      StoreKv<T>(v_cache, cache_index(c / head_dim, c % head_dim),
                 RoundTo<T>(load(q_dim + kv_dim + c)), kv, kv.VScale());
    }
  }
}

// V consecutive elements of T in one load or store.
template <typename T, int V>
struct alignas(sizeof(T) * V) VecN {
  T v[V];
};

constexpr int kRowThreads = 256;
constexpr int kMaxRowHalf = 256;  // head_dim / 2 the row kernel keeps cos and sin of
// From this many rows on, the row kernel; below, a block per row would leave most of the GPU idle.
constexpr int kRowKernelMinRows = 128;

// grid (row blocks): block b takes rows b, b + gridDim.x, ...; per row, V-element vectors: the
// rotary items (num_heads + num_kv_heads heads, whose columns are contiguous in qkv, times
// head_dim / 2 / V: elements [i, i + V) with their partners [i + half, i + half + V)), then the
// value items (kv_dim / V). half % V == 0, and every pointer aligned to V elements.
template <typename T, int V, typename Kv>
__global__ void __launch_bounds__(kRowThreads)
    QkvRopeCacheRowsKernel(const T* __restrict__ qkv, const T* __restrict__ bias,
                           T* __restrict__ q_out, void* __restrict__ k_cache,
                           void* __restrict__ v_cache, const int32_t* __restrict__ positions,
                           const int32_t* __restrict__ slots, int rows, int num_heads,
                           int num_kv_heads, int head_dim, Kv kv,
                           const float* __restrict__ inv_freq) {
  using Vec = VecN<T, V>;
  __shared__ float cos_s[kMaxRowHalf], sin_s[kMaxRowHalf];
  AllowDependentLaunch();
  WaitForPrerequisites();
  const int q_dim = num_heads * head_dim, kv_dim = num_kv_heads * head_dim;
  const int half = head_dim / 2, half_vecs = half / V;
  const int rot_items = (num_heads + num_kv_heads) * half_vecs, items = rot_items + kv_dim / V;
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    const int pos = positions[r], slot = slots[r];
    if (inv_freq != nullptr) {
      for (int i = threadIdx.x; i < half; i += blockDim.x) {
        RotaryCosSin<T>(pos, inv_freq[i], cos_s[i], sin_s[i]);
      }
      __syncthreads();
    }
    const T* in = qkv + static_cast<size_t>(r) * (q_dim + 2 * kv_dim);
    for (int w = threadIdx.x; w < items; w += blockDim.x) {
      if (w < rot_items) {
        const int head = w / half_vecs, i0 = (w - head * half_vecs) * V;
        const int c1 = head * head_dim + i0;  // column of x1; x2 is half further
        Vec a = *reinterpret_cast<const Vec*>(in + c1);
        Vec b = *reinterpret_cast<const Vec*>(in + c1 + half);
        Vec ba, bb;
        if (bias != nullptr) {
          ba = *reinterpret_cast<const Vec*>(bias + c1);
          bb = *reinterpret_cast<const Vec*>(bias + c1 + half);
        }
#pragma unroll
        for (int j = 0; j < V; ++j) {
          float x1 = ToF(a.v[j]), x2 = ToF(b.v[j]);
          // The projection's output with its bias is what Hugging Face rounds and then uses.
          if (bias != nullptr) {
            x1 = RoundTo<T>(x1 + ToF(ba.v[j]));
            x2 = RoundTo<T>(x2 + ToF(bb.v[j]));
          }
          if (inv_freq != nullptr) RotateHalfPairBy<T>(x1, x2, cos_s[i0 + j], sin_s[i0 + j]);
          a.v[j] = FromF<T>(x1);
          b.v[j] = FromF<T>(x2);
        }
        if (head < num_heads) {
          T* dst = q_out + static_cast<size_t>(r) * q_dim + head * head_dim;
          *reinterpret_cast<Vec*>(dst + i0) = a;
          *reinterpret_cast<Vec*>(dst + i0 + half) = b;
        } else if (kv.Fp8()) {
          const size_t at = kv.Offset(slot, head - num_heads, pos) + i0;
#pragma unroll
          for (int j = 0; j < V; ++j) {
            StoreKv<T>(k_cache, at + j, ToF(a.v[j]), kv, kv.KScale());
            StoreKv<T>(k_cache, at + half + j, ToF(b.v[j]), kv, kv.KScale());
          }
        } else {
          T* dst = static_cast<T*>(k_cache) + kv.Offset(slot, head - num_heads, pos);
          *reinterpret_cast<Vec*>(dst + i0) = a;
          *reinterpret_cast<Vec*>(dst + i0 + half) = b;
        }
      } else {
        const int c = (w - rot_items) * V, kvh = c / head_dim;
        Vec x = *reinterpret_cast<const Vec*>(in + q_dim + kv_dim + c);
        if (bias != nullptr) {
          const Vec bx = *reinterpret_cast<const Vec*>(bias + q_dim + kv_dim + c);
#pragma unroll
          for (int j = 0; j < V; ++j) x.v[j] = FromF<T>(ToF(x.v[j]) + ToF(bx.v[j]));
        }
        const size_t at = kv.Offset(slot, kvh, pos) + c - kvh * head_dim;
        if (kv.Fp8()) {
#pragma unroll
          for (int j = 0; j < V; ++j) StoreKv<T>(v_cache, at + j, ToF(x.v[j]), kv, kv.VScale());
        } else {
          *reinterpret_cast<Vec*>(static_cast<T*>(v_cache) + at) = x;
        }
      }
    }
    __syncthreads();  // cos_s and sin_s are the next row's
  }
}

// Elements per vector of the row kernel: the widest of 8, 4, 2, 1 that divides head_dim / 2 and to
// whose size every pointer is aligned.
int RowVector(int half, std::initializer_list<const void*> ptrs) {
  for (int v : {8, 4, 2}) {
    bool ok = half % v == 0;
    for (const void* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % (2 * v) == 0;
    if (ok) return v;
  }
  return 1;
}

// The launch of either kernel for either cache layout; `slots` are the rows' slots (SlotKv) or
// table rows (PagedKv).
template <typename Kv>
absl::Status LaunchQkvRope(DType dtype, const void* qkv, const void* bias, void* q_out,
                           void* k_cache, void* v_cache, const int32_t* positions,
                           const int32_t* slots, int rows, int num_heads, int num_kv_heads,
                           int head_dim, Kv kv, const float* inv_freq, cudaStream_t stream,
                           bool pdl) {
  if (rows == 0) return absl::OkStatus();
  if (head_dim % 2 != 0) return absl::InvalidArgumentError("head_dim must be even");
  const int half = head_dim / 2;
  if (rows >= kRowKernelMinRows && half <= kMaxRowHalf) {
    const int v = RowVector(half, {qkv, bias, q_out, k_cache, v_cache});
    const dim3 grid(std::min(rows, 65535));
    TANDEM_DISPATCH_HALF(dtype, {
      auto* kernel = v == 8   ? QkvRopeCacheRowsKernel<T, 8, Kv>
                     : v == 4 ? QkvRopeCacheRowsKernel<T, 4, Kv>
                     : v == 2 ? QkvRopeCacheRowsKernel<T, 2, Kv>
                              : QkvRopeCacheRowsKernel<T, 1, Kv>;
      CUDA_CHECK(LaunchKernel(kernel, grid, dim3(kRowThreads), 0, stream, pdl,
                              static_cast<const T*>(qkv), static_cast<const T*>(bias),
                              static_cast<T*>(q_out), k_cache, v_cache, positions, slots, rows,
                              num_heads, num_kv_heads, head_dim, kv, inv_freq));
    });
    CUDA_CHECK_LAUNCH();
    return absl::OkStatus();
  }
  TANDEM_DISPATCH_HALF(dtype, {
    const int items =
        num_heads * head_dim / 2 + num_kv_heads * head_dim / 2 + num_kv_heads * head_dim;
    constexpr int kMaxRowGroups = 256;
    const dim3 grid((items + 127) / 128, std::min(rows, kMaxRowGroups));
    CUDA_CHECK(LaunchKernel(QkvRopeCacheKernel<T, Kv>, grid, dim3(128), 0, stream, pdl,
                            static_cast<const T*>(qkv), static_cast<const T*>(bias),
                            static_cast<T*>(q_out), k_cache, v_cache, positions, slots, rows,
                            num_heads, num_kv_heads, head_dim, kv, inv_freq));
  });
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchQkvRopeCache(DType dtype, const void* qkv, const void* bias, void* q_out,
                                void* k_cache, void* v_cache, const int32_t* positions,
                                const int32_t* slots, int rows, int num_heads, int num_kv_heads,
                                int head_dim, int seq_capacity, const float* inv_freq,
                                cudaStream_t stream, bool pdl) {
  return LaunchQkvRope(dtype, qkv, bias, q_out, k_cache, v_cache, positions, slots, rows,
                       num_heads, num_kv_heads, head_dim,
                       SlotKv{num_kv_heads, seq_capacity, head_dim}, inv_freq, stream, pdl);
}

absl::Status LaunchQkvRopeCachePaged(DType dtype, const void* qkv, const void* bias, void* q_out,
                                     const KvPages& pages, const int32_t* positions,
                                     const int32_t* seqs, int rows, int num_heads,
                                     int num_kv_heads, int head_dim, const float* inv_freq,
                                     cudaStream_t stream, bool pdl) {
  RETURN_IF_ERROR(CheckKvPages(pages, head_dim, "QKV into the paged cache"));
  return LaunchQkvRope(dtype, qkv, bias, q_out, pages.k, pages.v, positions, seqs, rows,
                       num_heads, num_kv_heads, head_dim, ToPagedKv(pages, num_kv_heads, head_dim),
                       inv_freq, stream, pdl);
}

}  // namespace tandem::cuda
