// KvBlock (worker/stage.h): its size and the checks a stage makes before importing one.
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "worker/stage.h"

namespace tandem {

size_t KvBlock::expected_bytes() const {
  if (num_layers < 0 || num_kv_heads < 1 || head_dim < 1 || positions < 0) return 0;
  // In 128 bits: the fields may come from anywhere, and no product of them overflows there.
  const __int128 bytes = static_cast<__int128>(num_layers) * positions * num_kv_heads * head_dim *
                         static_cast<__int128>(DTypeSize(dtype));
  return bytes > static_cast<__int128>(INT64_MAX) ? 0 : static_cast<size_t>(bytes);
}

absl::Status CheckKvBlock(const KvBlock& block, int slot, const ModelConfig& c, DType dtype,
                          int first_layer, int last_layer, int max_slots, int max_seq_len) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("KV block: ", parts...));
  };
  if (block.version != KvBlock::kVersion) {
    return bad("version ", block.version, ", this stage reads version ", KvBlock::kVersion);
  }
  if (slot < 0 || slot >= max_slots) {
    return bad("slot ", slot, " is outside [0, ", max_slots, ")");
  }
  if (block.dtype != dtype) {
    return bad("dtype ", std::string(DTypeName(block.dtype)), ", this stage's KV-cache holds ",
               std::string(DTypeName(dtype)));
  }
  if (block.num_kv_heads != c.num_kv_heads || block.head_dim != c.head_dim) {
    return bad(block.num_kv_heads, " KV heads of ", block.head_dim, ", the model has ",
               c.num_kv_heads, " of ", c.head_dim);
  }
  if (block.num_layers < 1 || block.first_layer < first_layer ||
      block.num_layers > last_layer - block.first_layer) {
    return bad("layers [", block.first_layer, ", ",
               static_cast<int64_t>(block.first_layer) + block.num_layers,
               ") are not within this stage's [", first_layer, ", ", last_layer, ")");
  }
  if (block.positions < 1 || block.positions > max_seq_len) {
    return bad(block.positions, " positions, this stage holds 1 to ", max_seq_len, " per slot");
  }
  const size_t want = block.expected_bytes();
  if (block.k.size() != want || block.v.size() != want) {
    return bad(block.k.size(), " bytes of K and ", block.v.size(), " of V, the fields say ", want,
               " each");
  }
  return absl::OkStatus();
}

}  // namespace tandem
