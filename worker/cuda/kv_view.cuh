// Where a (sequence, kv head, position) of one layer's K or V lives, for the two cache layouts:
// kernels that read or write the cache take one of these as a template argument, so that the
// contiguous and the paged cache share one kernel body (and one arithmetic). `seq` is the row's
// slot (SlotKv) or its block-table row (PagedKv).
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "worker/cuda/device_util.cuh"
#include "worker/cuda/kv_pages.h"

namespace tandem::cuda {

// (slots, num_kv_heads, seq_capacity, head_dim): every head of a slot is one contiguous run.
struct SlotKv {
  static constexpr bool kPaged = false;
  int num_kv_heads;
  int seq_capacity;
  int head_dim;
  __device__ __forceinline__ bool Fp8() const { return false; }
  __device__ __forceinline__ float KScale() const { return 1.0f; }
  __device__ __forceinline__ float VScale() const { return 1.0f; }
  __device__ __forceinline__ size_t Offset(int seq, int kv_head, int pos) const {
    return ((static_cast<size_t>(seq) * num_kv_heads + kv_head) * seq_capacity + pos) * head_dim;
  }
};

// (num_pages, num_kv_heads, page_size, head_dim) with page_size = 1 << page_shift; position p of
// table row seq is in page table[seq * table_stride + p / page_size]: runs of page_size positions.
struct PagedKv {
  static constexpr bool kPaged = true;
  int num_kv_heads;
  int head_dim;
  const int32_t* table;
  int table_stride;
  int page_shift;
  bool fp8;  // E4M3 codes (KvPages::fp8), one byte an element
  float k_scale, v_scale;
  __device__ __forceinline__ bool Fp8() const { return fp8; }
  __device__ __forceinline__ float KScale() const { return k_scale; }
  __device__ __forceinline__ float VScale() const { return v_scale; }
  __device__ __forceinline__ size_t Offset(int seq, int kv_head, int pos) const {
    return InPage(__ldg(table + static_cast<size_t>(seq) * table_stride + (pos >> page_shift)),
                  kv_head, pos);
  }
  // As Offset, with the page of `pos` already read from the table.
  __device__ __forceinline__ size_t InPage(int page, int kv_head, int pos) const {
    const int in_page = pos & ((1 << page_shift) - 1);
    return (((static_cast<size_t>(page) * num_kv_heads + kv_head) << page_shift) + in_page) *
           head_dim;
  }
};

// The view of pages that CheckKvPages accepted.
inline PagedKv ToPagedKv(const KvPages& pages, int num_kv_heads, int head_dim) {
  int shift = 0;
  while ((1 << shift) < pages.page_size) ++shift;
  return PagedKv{num_kv_heads, head_dim,  pages.block_table, pages.table_stride,
                 shift,        pages.fp8, pages.k_scale,     pages.v_scale};
}

// Writes element `at` of a K or V pool of `kv`'s layout: the value (already rounded to T, as the
// fp16/bf16 cache stores it) as T, or where the pool holds FP8 codes as E4M3(value / scale),
// rounded to nearest even and saturated at +-448.
template <typename T, typename Kv>
__device__ __forceinline__ void StoreKv(void* pool, size_t at, float value, const Kv& kv,
                                        float scale) {
  if (kv.Fp8()) {
    static_cast<__nv_fp8_storage_t*>(pool)[at] =
        __nv_cvt_float_to_fp8(value / scale, __NV_SATFINITE, __NV_E4M3);
  } else {
    static_cast<T*>(pool)[at] = FromF<T>(value);
  }
}

}  // namespace tandem::cuda
