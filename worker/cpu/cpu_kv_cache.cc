// The CPU stage's KV-cache (worker/cpu/cpu_kv_cache.h): its two layouts and the copies in and
// out of them.
#include "worker/cpu/cpu_kv_cache.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <new>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/fp8_quantize.h"
#include "common/status_macros.h"
#include "worker/context_fit.h"

namespace tandem {
namespace {

// The host's physical memory: no KV-cache larger than it can be served.
int64_t HostMemoryBytes() {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
}

}  // namespace

int64_t HostAvailableBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  int64_t kib = 0;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * sysconf(_SC_PAGESIZE);
}

absl::StatusOr<CpuKvCache> CpuKvCache::Make(CpuKvLayout layout, std::vector<KvScales> scales) {
  const size_t want_scales = layout.fp8 ? static_cast<size_t>(layout.layers) : 0;
  if (scales.size() != want_scales) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV-cache of ", layout.layers, " layers", layout.fp8 ? " in FP8" : "", " given ",
        scales.size(), " pairs of scales (one per layer in FP8, none otherwise)"));
  }
  const int64_t element_bytes = static_cast<int64_t>(layout.element_bytes());
  if (layout.page_size > 0 && layout.num_pages == 0) {
    int64_t pages = static_cast<int64_t>(layout.max_slots) *
                    ((layout.max_seq_len + layout.page_size - 1) / layout.page_size);
    if (layout.budget_bytes > 0) {
      const int64_t page_bytes =
          int64_t{2} * layout.layers * layout.page_size * layout.kv_dim * element_bytes;
      const int64_t fit = layout.budget_bytes / page_bytes;
      if (fit < 1) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "KV-cache: a page of ", layout.page_size, " positions x ", layout.layers,
            " layers takes ", page_bytes, " bytes; the KV memory budget is ", layout.budget_bytes,
            " bytes (kv_memory_fraction of the host memory available)"));
      }
      pages = std::min(pages, fit);
    }
    if (pages > (int64_t{1} << 30)) {
      return absl::InvalidArgumentError(
          absl::StrCat(layout.max_slots, " slots x ", layout.max_seq_len, " positions make ", pages,
                       " pages of ", layout.page_size, "; give kv_pages or fewer slots"));
    }
    layout.num_pages = static_cast<int>(pages);
  }
  if (layout.page_size > 0 && layout.num_pages < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_pages must be >= 1 (or 0: as many as the slots take), got ", layout.num_pages));
  }
  // Paged: num_pages "slots" of page_size positions each.
  const KvCacheShape shape = layout.page_size > 0 ? KvCacheShape{.slots = layout.num_pages,
                                                                 .layers = layout.layers,
                                                                 .positions = layout.page_size,
                                                                 .kv_dim = layout.kv_dim,
                                                                 .element_bytes = element_bytes}
                                                  : KvCacheShape{.slots = layout.max_slots,
                                                                 .layers = layout.layers,
                                                                 .positions = layout.max_seq_len,
                                                                 .kv_dim = layout.kv_dim,
                                                                 .element_bytes = element_bytes};
  ASSIGN_OR_RETURN(const int64_t bytes, KvCacheBytes(shape, HostMemoryBytes(), "host memory"));
  std::unique_ptr<std::byte[]> k, v;
  try {
    k = std::make_unique_for_overwrite<std::byte[]>(static_cast<size_t>(bytes) / 2);
    v = std::make_unique_for_overwrite<std::byte[]>(static_cast<size_t>(bytes) / 2);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV-cache of ", bytes, " bytes (", shape.slots,
                     layout.page_size > 0 ? " pages x " : " slots x ", shape.layers, " layers x ",
                     shape.positions, " positions) does not fit in memory"));
  }
  return CpuKvCache(layout, std::move(scales), std::move(k), std::move(v));
}

size_t CpuKvCache::Offset(int slot, std::span<const int32_t> table, int layer, int pos) const {
  const CpuKvLayout& l = layout_;
  if (l.page_size == 0) {
    return ((static_cast<size_t>(slot) * l.layers + layer) * l.max_seq_len + pos) * l.kv_dim *
           l.element_bytes();
  }
  const size_t page = static_cast<size_t>(table[pos / l.page_size]);
  return ((static_cast<size_t>(layer) * l.num_pages + page) * l.page_size + pos % l.page_size) *
         l.kv_dim * l.element_bytes();
}

template <typename F>
void CpuKvCache::ForRuns(int n, F&& f) const {
  const int run = paged() ? layout_.page_size : n;
  for (int p = 0; p < n; p += run) f(p, std::min(run, n - p));
}

void CpuKvCache::Write(int slot, std::span<const int32_t> table, int layer, int pos, const float* k,
                       const float* v) {
  const size_t at = Offset(slot, table, layer, pos), n = layout_.kv_dim;
  if (!layout_.fp8) {
    std::memcpy(k_.get() + at, k, n * sizeof(float));
    std::memcpy(v_.get() + at, v, n * sizeof(float));
    return;
  }
  EncodeKvE4M3(k, n, scales_[layer].k, reinterpret_cast<uint8_t*>(k_.get() + at));
  EncodeKvE4M3(v, n, scales_[layer].v, reinterpret_cast<uint8_t*>(v_.get() + at));
}

std::pair<const float*, const float*> CpuKvCache::Rows(int slot, std::span<const int32_t> table,
                                                       int layer, int n, std::vector<float>& k_rows,
                                                       std::vector<float>& v_rows) const {
  if (!paged() && !layout_.fp8) {
    const size_t at = Offset(slot, table, layer, 0);
    return {reinterpret_cast<const float*>(k_.get() + at),
            reinterpret_cast<const float*>(v_.get() + at)};
  }
  const size_t row = layout_.kv_dim, floats = static_cast<size_t>(n) * row;
  if (k_rows.size() < floats) k_rows.resize(floats);
  if (v_rows.size() < floats) v_rows.resize(floats);
  if (!layout_.fp8) {
    Gather(slot, table, layer, n, reinterpret_cast<uint8_t*>(k_rows.data()),
           reinterpret_cast<uint8_t*>(v_rows.data()));
    return {k_rows.data(), v_rows.data()};
  }
  const KvScales& s = scales_[layer];
  ForRuns(n, [&](int p, int run) {
    const size_t at = Offset(slot, table, layer, p);
    DecodeKvE4M3(reinterpret_cast<const uint8_t*>(k_.get() + at), run * row, s.k,
                 k_rows.data() + p * row);
    DecodeKvE4M3(reinterpret_cast<const uint8_t*>(v_.get() + at), run * row, s.v,
                 v_rows.data() + p * row);
  });
  return {k_rows.data(), v_rows.data()};
}

void CpuKvCache::Gather(int slot, std::span<const int32_t> table, int layer, int n, uint8_t* k,
                        uint8_t* v) const {
  const size_t row = layout_.kv_dim * layout_.element_bytes();
  ForRuns(n, [&](int p, int run) {
    const size_t at = Offset(slot, table, layer, p);
    std::memcpy(k + p * row, k_.get() + at, run * row);
    std::memcpy(v + p * row, v_.get() + at, run * row);
  });
}

void CpuKvCache::Scatter(int slot, std::span<const int32_t> table, int layer, int n,
                         const uint8_t* k, const uint8_t* v) {
  const size_t row = layout_.kv_dim * layout_.element_bytes();
  ForRuns(n, [&](int p, int run) {
    const size_t at = Offset(slot, table, layer, p);
    std::memcpy(k_.get() + at, k + p * row, run * row);
    std::memcpy(v_.get() + at, v + p * row, run * row);
  });
}

}  // namespace tandem
