#include "worker/step_check.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/sampling.h"

namespace tandem {

absl::Status ValidateStep(const StepDescriptor& step, const Activations& in,
                          const StepLimits& limits, std::span<const int> cached_len) {
  auto error = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step.id, ": ", parts...));
  };
  int64_t total = 0;
  std::vector<bool> slot_used(limits.max_slots, false);
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const SequenceStep& s = step.seqs[i];
    if (s.slot < 0 || s.slot >= limits.max_slots) {
      return error("sequence ", i, ": slot ", s.slot, " is outside [0, ", limits.max_slots, ")");
    }
    if (slot_used[s.slot]) {
      return error("sequence ", i, ": slot ", s.slot, " is used by another sequence of the step");
    }
    slot_used[s.slot] = true;
    if (s.num_tokens < 1) {
      return error("sequence ", i, ": num_tokens must be >= 1, got ", s.num_tokens);
    }
    if (s.position < 0) return error("sequence ", i, ": position must be >= 0, got ", s.position);
    if (static_cast<int64_t>(s.position) + s.num_tokens > limits.max_seq_len) {
      return error("sequence ", i, ": position ", s.position, " + num_tokens ", s.num_tokens,
                   " exceeds the context of ", limits.max_seq_len, " tokens");
    }
    if (s.position > cached_len[s.slot]) {
      return error("sequence ", i, ": position ", s.position, " is past the ",
                   cached_len[s.slot], " tokens cached in slot ", s.slot);
    }
    if (absl::Status st = ValidateSamplingParams(s.sampling); !st.ok()) {
      return error("sequence ", i, ": ", st.message());
    }
    for (const SeenToken& t : s.seen) {
      if (t.id < 0 || t.id >= limits.vocab_size || t.output_count < 0) {
        return error("sequence ", i, ": seen token ", t.id, " (count ", t.output_count,
                     ") is outside the vocabulary [0, ", limits.vocab_size,
                     ") or counted below 0");
      }
    }
    if (s.logprobs < -1 || s.logprobs > kMaxTopLogprobs) {
      return error("sequence ", i, ": logprobs must be -1 (none) or in [0, ", kMaxTopLogprobs,
                   "], got ", s.logprobs);
    }
    if (s.prompt_logprobs < -1 || s.prompt_logprobs > kMaxTopLogprobs) {
      return error("sequence ", i, ": prompt_logprobs must be -1 (none) or in [0, ",
                   kMaxTopLogprobs, "], got ", s.prompt_logprobs);
    }
    if (s.prompt_logprobs >= 0 && step.tokens.empty()) {
      return error("sequence ", i, ": prompt_logprobs needs the step's tokens");
    }
    if (s.next_prompt_token >= limits.vocab_size) {
      return error("sequence ", i, ": next_prompt_token ", s.next_prompt_token,
                   " is outside the vocabulary [0, ", limits.vocab_size, ")");
    }
    total += s.num_tokens;
  }
  if ((limits.reads_tokens || !step.tokens.empty()) &&
      static_cast<int64_t>(step.tokens.size()) != total) {
    return error("tokens has ", step.tokens.size(), " ids but the sequences' num_tokens sum to ",
                 total);
  }
  if (limits.reads_tokens) {
    for (size_t i = 0, r = 0; i < step.seqs.size(); ++i) {
      for (int t = 0; t < step.seqs[i].num_tokens; ++t, ++r) {
        const int32_t id = step.tokens[r];
        if (id < 0 || id >= limits.vocab_size) {
          return error("sequence ", i, ": token ", t, " (id ", id,
                       ") is outside the vocabulary [0, ", limits.vocab_size, ")");
        }
      }
    }
    return absl::OkStatus();
  }
  if (in.rows != total || in.cols != limits.hidden_size) {
    return error("input activations are [", in.rows, ", ", in.cols, "], expected [", total, ", ",
                 limits.hidden_size, "] (tokens, hidden_size)");
  }
  if (total > 0 && in.data == nullptr) return error("input activations have no data");
  return absl::OkStatus();
}

}  // namespace tandem
