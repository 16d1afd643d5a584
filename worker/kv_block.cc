// KvBlock (worker/stage.h): its size and the checks a stage makes before importing one.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "worker/stage.h"

namespace tandem {

size_t KvBlock::expected_bytes() const {
  if (num_kv_heads < 1 || head_dim < 1) return 0;
  const std::optional<int64_t> bytes = CheckedProduct(
      {num_layers, positions, num_kv_heads, head_dim, static_cast<int64_t>(DTypeSize(dtype))});
  return bytes ? static_cast<size_t>(*bytes) : 0;
}

size_t KvBlock::bytes() const { return on_device() ? 2 * expected_bytes() : k.size() + v.size(); }

absl::Status CheckKvRange(const char* what, int slot, int first_layer, int num_layers,
                          int stage_first, int stage_last, int max_slots) {
  if (slot < 0 || slot >= max_slots) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": slot ", slot, " is outside [0, ", max_slots, ")"));
  }
  if (num_layers < 1 || first_layer < stage_first || num_layers > stage_last - first_layer) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": layers [", first_layer, ", ", static_cast<int64_t>(first_layer) + num_layers,
        ") are not within this stage's [", stage_first, ", ", stage_last, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckKvExport(int slot, int positions, int first_layer, int num_layers,
                           int stage_first, int stage_last, int max_slots, int cached) {
  RETURN_IF_ERROR(CheckKvRange("KV export", slot, first_layer, num_layers, stage_first,
                               stage_last, max_slots));
  if (positions < 1 || positions > cached) {
    return absl::InvalidArgumentError(absl::StrCat("KV export: slot ", slot, " holds ", cached,
                                                   " positions, asked for ", positions));
  }
  return absl::OkStatus();
}

absl::Status CheckKvOut(int slot, int positions, int stage_first, int stage_last, int max_slots,
                        int max_seq_len) {
  RETURN_IF_ERROR(CheckKvRange("KV write-out", slot, stage_first, stage_last - stage_first,
                               stage_first, stage_last, max_slots));
  if (positions < 1 || positions > max_seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("KV write-out: positions ", positions,
                                                   " outside [1, ", max_seq_len, "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckBlockTable(std::span<const int32_t> table, int64_t positions, int page_size,
                             int num_pages, int max_seq_len) {
  const int64_t needed = (positions + page_size - 1) / page_size;
  const int64_t most = (static_cast<int64_t>(max_seq_len) + page_size - 1) / page_size;
  const int64_t count = static_cast<int64_t>(table.size());
  if (count < needed) {
    return absl::InvalidArgumentError(absl::StrCat("block table of ", count, " pages holds ",
                                                   count * page_size, " positions, ", positions,
                                                   " need ", needed, " pages of ", page_size));
  }
  if (count > most) {
    return absl::InvalidArgumentError(absl::StrCat("block table of ", count,
                                                   " pages is longer than the context of ",
                                                   max_seq_len, " positions (", most, " pages)"));
  }
  for (int64_t i = 0; i < count; ++i) {
    if (table[i] < 0 || table[i] >= num_pages) {
      return absl::InvalidArgumentError(absl::StrCat("block table entry ", i, ": page ", table[i],
                                                     " is outside the stage's [0, ", num_pages,
                                                     ") pages"));
    }
  }
  // Two positions of one sequence in the same page would overwrite each other's K/V. A stamp per
  // page, kept per thread between calls, finds a repeat in one pass over the table (a step's
  // tables hold thousands of entries).
  thread_local std::vector<uint32_t> seen;
  thread_local uint32_t stamp = 0;
  if (seen.size() < static_cast<size_t>(num_pages)) seen.assign(num_pages, 0);
  if (++stamp == 0) {  // wrapped: no stale stamp may match
    std::fill(seen.begin(), seen.end(), 0);
    stamp = 1;
  }
  for (int64_t i = 0; i < count; ++i) {
    uint32_t& mark = seen[static_cast<size_t>(table[i])];
    if (mark == stamp) {
      const int64_t first = std::find(table.begin(), table.end(), table[i]) - table.begin();
      return absl::InvalidArgumentError(absl::StrCat(
          "block table entries ", first, " and ", i, " both name page ", table[i],
          "; a sequence's pages must be distinct (the coordinator's page owner gives each "
          "position its own row)"));
    }
    mark = stamp;
  }
  return absl::OkStatus();
}

absl::Status CheckKvPlace(const char* what, const KvPlace& place, int64_t positions, int page_size,
                          int num_pages, int max_seq_len) {
  if (page_size <= 0) {
    if (place.block_table.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": slot ", place.slot, " names ", place.block_table.size(),
                     " pages, but this stage's KV-cache is contiguous slots (no kv_page_size)"));
  }
  if (absl::Status st =
          CheckBlockTable(place.block_table, positions, page_size, num_pages, max_seq_len);
      !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": slot ", place.slot, ": ", st.message()));
  }
  return absl::OkStatus();
}

KvBlock KvBlockOf(DType dtype, int first_layer, int num_layers, int num_kv_heads, int head_dim,
                  int positions) {
  KvBlock b;
  b.dtype = dtype;
  b.first_layer = first_layer;
  b.num_layers = num_layers;
  b.num_kv_heads = num_kv_heads;
  b.head_dim = head_dim;
  b.positions = positions;
  return b;
}

KvBlock SizedKvBlock(DType dtype, int first_layer, int num_layers, int num_kv_heads, int head_dim,
                     int positions) {
  KvBlock b = KvBlockOf(dtype, first_layer, num_layers, num_kv_heads, head_dim, positions);
  b.k.resize(b.expected_bytes());
  b.v.resize(b.expected_bytes());
  return b;
}

namespace {

// "k_scale K, v_scale V", each as many digits as tell two floats apart.
std::string ScalesText(const KvScales& s) {
  return absl::StrFormat("k_scale %.9g, v_scale %.9g", s.k, s.v);
}

// A block of dtype F8_E4M3 carries a pair of scales per layer, the stage's for those layers
// (`scales`: the stage's, from first_layer); a block of another dtype none.
absl::Status CheckKvBlockScales(const KvBlock& block, DType dtype, int first_layer,
                                std::span<const KvScales> scales) {
  if (dtype != DType::kF8E4M3) {
    if (block.scales.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "KV block: ", block.scales.size(), " pairs of scales on a ",
        std::string(DTypeName(block.dtype)), " block; only F8_E4M3 blocks have scales"));
  }
  if (block.scales.size() != static_cast<size_t>(block.num_layers)) {
    return absl::InvalidArgumentError(absl::StrCat("KV block: F8_E4M3 with ", block.scales.size(),
                                                   " pairs of scales for its ", block.num_layers,
                                                   " layers (one pair per layer)"));
  }
  for (int l = 0; l < block.num_layers; ++l) {
    const size_t at = static_cast<size_t>(block.first_layer - first_layer + l);
    if (at >= scales.size()) {
      return absl::InternalError(absl::StrCat("KV block: the stage has no scales of its layer ",
                                              block.first_layer + l, " (", scales.size(),
                                              " pairs from layer ", first_layer, ")"));
    }
    if (!(block.scales[l] == scales[at])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "KV block: layer ", block.first_layer + l, " is F8_E4M3 codes of ",
          ScalesText(block.scales[l]), "; this stage's KV-cache of that layer holds codes of ",
          ScalesText(scales[at]), " (the two stages read other scales; no conversion is made)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckKvBlock(const KvBlock& block, int slot, const ModelConfig& c, DType dtype,
                          int first_layer, int last_layer, int max_slots, int max_seq_len,
                          std::span<const KvScales> scales) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("KV block: ", parts...));
  };
  if (block.version != KvBlock::kVersion) {
    return bad("version ", block.version, ", this stage reads version ", KvBlock::kVersion);
  }
  RETURN_IF_ERROR(CheckKvRange("KV block", slot, block.first_layer, block.num_layers, first_layer,
                               last_layer, max_slots));
  if (block.dtype != dtype) {
    return bad("dtype ", std::string(DTypeName(block.dtype)), ", this stage's KV-cache holds ",
               std::string(DTypeName(dtype)), " (no conversion is made)");
  }
  RETURN_IF_ERROR(CheckKvBlockScales(block, dtype, first_layer, scales));
  if (block.num_kv_heads != c.num_kv_heads || block.head_dim != c.head_dim) {
    return bad(block.num_kv_heads, " KV heads of ", block.head_dim, ", the model has ",
               c.num_kv_heads, " of ", c.head_dim);
  }
  if (block.positions < 1 || block.positions > max_seq_len) {
    return bad(block.positions, " positions, this stage holds 1 to ", max_seq_len, " per slot");
  }
  const size_t want = block.expected_bytes();
  if (block.on_device() != (block.device_v != nullptr)) {
    return bad("K and V are not both in device memory");
  }
  if (block.on_device()) {
    if (!block.k.empty() || !block.v.empty()) {
      return bad("in device memory with ", block.k.size() + block.v.size(),
                 " bytes in host memory too");
    }
    return absl::OkStatus();
  }
  if (block.k.size() != want || block.v.size() != want) {
    return bad(block.k.size(), " bytes of K and ", block.v.size(), " of V, the fields say ", want,
               " each");
  }
  return absl::OkStatus();
}

}  // namespace tandem
