// The checks every backend makes on a step before touching its KV-cache, so that a rejected step
// leaves no trace and the stage stays usable.
#pragma once

#include <span>

#include "absl/status/status.h"
#include "worker/stage.h"

namespace tandem {

struct StepLimits {
  int max_slots = 0;     // KV-cache slots of the stage
  int max_seq_len = 0;   // positions per slot
  int vocab_size = 0;    // token ids must be below it
  int hidden_size = 0;   // columns of the input activations
  bool reads_tokens = false;  // first stage: embeds step.tokens instead of reading `in`
};

// Slots in range and distinct, positions within the context and not past what each slot has
// cached (`cached_len[slot]`), sampling parameters, token count (first stage, or wherever tokens
// are sent) and ids, input shape on later stages. INVALID_ARGUMENT naming the step, the sequence
// and the field. Where the input lives (host or device) is for the backend to check.
absl::Status ValidateStep(const StepDescriptor& step, const Activations& in,
                          const StepLimits& limits, std::span<const int> cached_len);

}  // namespace tandem
