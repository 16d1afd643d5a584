// Prompt + new tokens against the model's context (context_fit.h).
#include "worker/context_fit.h"

#include <cstdint>

#include "absl/strings/str_format.h"
#include "common/checked_math.h"

namespace tandem {

absl::Status CheckPromptFitsContext(int prompt, int new_tokens, int max_positions,
                                    std::string_view model_dir) {
  if (prompt < 1 || new_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "prompt length %d and new tokens %d must both be >= 1", prompt, new_tokens));
  }
  // In 64 bits: two lengths near INT_MAX must not wrap into a small sum.
  const int64_t needed = int64_t{prompt} + new_tokens - 1;
  if (needed > max_positions) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--prompt %d with --new_tokens %d needs %d positions, beyond the model's context of %d "
        "(max_position_embeddings in %s/config.json)",
        prompt, new_tokens, needed, max_positions, model_dir));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> KvCacheBytes(const KvCacheShape& shape, int64_t budget_bytes,
                                     std::string_view budget_what) {
  const std::string sizes = absl::StrFormat(
      "%d slots x %d layers x %d positions x %d (kv_dim) x %d bytes x 2 (K and V)", shape.slots,
      shape.layers, shape.positions, shape.kv_dim, shape.element_bytes);
  const std::optional<int64_t> bytes = CheckedProduct(
      {shape.slots, shape.layers, shape.positions, shape.kv_dim, shape.element_bytes, 2});
  if (!bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "KV-cache of %s: the size overflows 64 bits; lower max_slots or max_seq_len", sizes));
  }
  if (*bytes > budget_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "KV-cache of %s needs %d bytes; %d bytes of %s are available; lower max_slots or "
        "max_seq_len",
        sizes, *bytes, budget_bytes, budget_what));
  }
  return *bytes;
}

}  // namespace tandem
