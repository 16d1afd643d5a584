// Whether a prompt and the tokens generated after it fit a model's context: the check a benchmark
// makes before it sizes a KV-cache and runs a request it could not finish.
#pragma once

#include <string_view>

#include "absl/status/status.h"

namespace tandem {

// A prompt of `prompt` tokens followed by `new_tokens` generated ones takes prompt + new_tokens - 1
// positions (the last new token is never fed back). OK when that is at most `max_positions`;
// otherwise INVALID_ARGUMENT naming the prompt, the new tokens, the positions needed, the context
// and where it comes from (`model_dir`/config.json). prompt and new_tokens must be >= 1.
absl::Status CheckPromptFitsContext(int prompt, int new_tokens, int max_positions,
                                    std::string_view model_dir);

}  // namespace tandem
