// Prompt + new tokens against the model's context (context_fit.h).
#include "worker/context_fit.h"

#include <cstdint>

#include "absl/strings/str_format.h"

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

}  // namespace tandem
