// The launch-time checks that every paged kernel (kv_pages.h) shares.
#include "worker/cuda/kv_pages.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/model_config.h"
#include "worker/cuda/kernels.h"

namespace tandem::cuda {

absl::Status CheckKvPages(const KvPages& pages, int head_dim, const char* what) {
  if (pages.k == nullptr || pages.v == nullptr || pages.block_table == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the K and V page pools and the block table must all be set"));
  }
  const int ps = pages.page_size;
  if (ps < kMinKvPageSize || (ps & (ps - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": page size ", ps, " must be a power of two >= ", kMinKvPageSize,
        " (so that 64-key tiles hold whole pages or lie inside one and 16-byte loads stay in "
        "a page)"));
  }
  if (head_dim <= 0 || head_dim % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": head_dim ", head_dim, " must be a positive multiple of 4 for the paged cache"));
  }
  if (reinterpret_cast<uintptr_t>(pages.k) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(pages.v) % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the K and V page pools must be 16-byte aligned"));
  }
  if (pages.fp8 && !(pages.k_scale > 0.0f && pages.v_scale > 0.0f && pages.k_scale < INFINITY &&
                     pages.v_scale < INFINITY)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": FP8 KV scales k ", pages.k_scale,
                                                   " and v ", pages.v_scale,
                                                   " must be positive and finite"));
  }
  if (pages.num_pages < 1 || pages.table_stride < 1) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", pages.num_pages, " pages and ",
                                                   pages.table_stride,
                                                   " table entries per sequence; both must be "
                                                   ">= 1"));
  }
  return absl::OkStatus();
}

bool Fp8PagedAttentionTakes(int head_dim, int group) {
  return AttentionLanesKernelTakes(head_dim, group);
}

bool PagedDecodeAttentionTakes(int head_dim, int group) {
  return CudaPagesTakeHeads(head_dim, group);
}

}  // namespace tandem::cuda
