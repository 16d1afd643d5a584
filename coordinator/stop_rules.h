// When a sequence ends: the rules the scheduler applies after every generated token, in order.
//   1. min_tokens: while generated <= min_tokens, neither EOS nor a stop token or string ends it.
//   2. EOS: the token is one of the request's EOS ids -> FinishReason::kEos.
//   3. stop_token_ids: the token is one of them -> FinishReason::kStop.
//   4. stop_strings: the decoded generated text contains one -> FinishReason::kStop, the text cut
//      before the earliest match of any of them (a match may span tokens).
//   5. length: max_new_tokens generated, or prompt + generated > context_length (the next step
//      would feed the newest token at position prompt + generated - 1) -> FinishReason::kLength.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/decode_stream.h"
#include "coordinator/finish_reason.h"
#include "coordinator/request_validation.h"

namespace tandem {

// Decodes generated token ids to text (the model's tokenizer). Left empty when the model has no
// tokenizer; stop strings are then never matched (validation refuses them first).
using TextDecoder = std::function<absl::StatusOr<std::string>(std::span<const int32_t>)>;

// The text of one sequence's generated tokens as it grows, for its stop strings: a few ids are
// decoded per new token (DecodeStream), not all of them, and only text the new tokens may have
// changed is searched.
class StopText {
 public:
  explicit StopText(const TextDecoder& decode) : stream_(decode) {}
  // The byte offset of the earliest match of any of `stops` (none empty) in the text of
  // `generated` (which starts with the tokens of the previous call), or -1.
  int EarliestMatch(const std::vector<std::string>& stops, std::span<const int32_t> generated);

 private:
  DecodeStream stream_;
  size_t search_from_ = 0;  // a match starting before lies in text searched before
};

struct StopDecision {
  FinishReason finish = FinishReason::kNone;  // kNone: the sequence goes on
  int text_limit = -1;  // ended by a stop string: bytes of the decoded text to keep
  bool ends() const { return finish != FinishReason::kNone; }
};

// Whether `request`'s sequence ends now. `generated`: every token it generated, the newest last
// (never empty). `context_length`: positions in the KV-cache. `text`: the sequence's own, kept
// from call to call; null: stop strings are never matched (no tokenizer).
StopDecision CheckStop(const ValidatedRequest& request, std::span<const int32_t> generated,
                       int context_length, StopText* text);

// Rule 5 alone: whether `request`'s sequence has reached its length once it generated `count`
// tokens, whatever they are.
bool ReachesLength(const ValidatedRequest& request, int count, int context_length);

}  // namespace tandem
