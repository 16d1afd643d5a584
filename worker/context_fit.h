// Whether a context fits: a prompt and the tokens generated after it in a model's context (the
// check a benchmark makes before it runs a request it could not finish), and a KV-cache of the
// asked size in 64 bits and in the memory a backend has.
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem {

// A prompt of `prompt` tokens followed by `new_tokens` generated ones takes prompt + new_tokens - 1
// positions (the last new token is never fed back). OK when that is at most `max_positions`;
// otherwise INVALID_ARGUMENT naming the prompt, the new tokens, the positions needed, the context
// and where it comes from (`model_dir`/config.json). prompt and new_tokens must be >= 1.
absl::Status CheckPromptFitsContext(int prompt, int new_tokens, int max_positions,
                                    std::string_view model_dir);

// The shape of a stage's KV-cache: K and V of `positions` positions of `slots` sequences in each
// of `layers` layers, `kv_dim` elements of `element_bytes` each.
struct KvCacheShape {
  int64_t slots = 0;
  int64_t layers = 0;
  int64_t positions = 0;
  int64_t kv_dim = 0;
  int64_t element_bytes = 0;
};

// The cache's bytes (K and V), at most `budget_bytes`. INVALID_ARGUMENT naming every size when
// the product does not fit 64 bits (AssignStage's max_slots and max_seq_len come from the
// network), RESOURCE_EXHAUSTED naming them and the budget (`budget_what`, e.g. "host memory")
// when it does not fit the budget.
absl::StatusOr<int64_t> KvCacheBytes(const KvCacheShape& shape, int64_t budget_bytes,
                                     std::string_view budget_what);

}  // namespace tandem
