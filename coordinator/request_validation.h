// Checks a public GenerateRequest against the model once, at the door, and turns it into the
// scheduler's plain form. Every rejection is INVALID_ARGUMENT naming the field.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/step.h"
#include "common/tokenizer.h"
#include "proto/tandem.pb.h"

namespace tandem {

struct ModelLimits {
  int vocab_size = 0;
  int context_length = 0;  // positions in the KV-cache
  int eos_token_id = -1;   // -1: none
  std::vector<int32_t> eos_token_ids;  // every id generation stops at (eos_token_id among them)
};

struct ValidatedRequest {
  std::string request_id;
  std::vector<int32_t> prompt;  // token ids, 1 .. context_length of them
  SamplingParams sampling;  // sampling.seed: the request's, when `seed` is set
  // The output's grammar (request.constraint), compiled once; null: free text.
  std::shared_ptr<const structured::Constraint> constraint;
  std::optional<uint64_t> seed;  // unset: each sequence samples with a fresh random seed
  int n = 1;                     // sequences to generate, 1 .. kMaxChoices
  int logprobs = -1;         // -1: none; k in [0, 20]: each token's logprob and k alternatives
  int prompt_logprobs = -1;  // -1: none; k in [0, 20]: the prompt's, with k alternatives
  int max_new_tokens = 0;  // 1 .. context_length
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop_strings;
  int32_t eos_token_id = -1;  // -1: none or ignored
  // EOS and stop tokens/strings end the sequence only after this many generated tokens (they are
  // still sampled and kept before that; vLLM masks them instead).
  int min_tokens = 0;
  std::vector<int32_t> eos_token_ids;  // all EOS ids (empty when ignored); eos_token_id is one
  absl::Duration timeout = absl::InfiniteDuration();
};

// The most sequences one request may ask for (sampling.n).
inline constexpr int kMaxChoices = 16;

// Generations without max_new_tokens stop at this many tokens or the end of the context.
inline constexpr int kDefaultMaxNewTokens = 256;

// A text prompt is refused before it is tokenized when it has more bytes than this many per token
// of the context (text averages about 4 bytes a token; long whitespace or symbol runs stay well
// under 32).
inline constexpr int64_t kPromptBytesPerToken = 32;
// Stop strings: how many one request may give, and the bytes of each.
inline constexpr int kMaxStopStrings = 32;
inline constexpr int kMaxStopStringBytes = 1024;

// The most bytes of a text prompt: kPromptBytesPerToken for each token of the context.
int64_t MaxPromptBytes(const ModelLimits& limits);
// The largest legal GenerateRequest (or HTTP body) on the wire, with room for every other field:
// what the coordinator's servers accept, at least gRPC's default of 4 MiB.
int64_t MaxRequestBytes(const ModelLimits& limits);

// A text prompt before it is tokenized: at most MaxPromptBytes and well-formed UTF-8.
// INVALID_ARGUMENT naming `field` (and the offset of the first ill-formed byte).
absl::Status CheckPromptText(std::string_view field, std::string_view text,
                             const ModelLimits& limits);

// Whether generating `token` ends the request with finish reason EOS: it is one of the
// model's EOS ids (generation_config.json may list several) and the request does not ignore EOS.
inline bool IsEos(const ValidatedRequest& request, int32_t token) {
  return (request.eos_token_id >= 0 && token == request.eos_token_id) ||
         std::find(request.eos_token_ids.begin(), request.eos_token_ids.end(), token) !=
             request.eos_token_ids.end();
}

// `tokenizer` may be null (a checkpoint without one): text prompts and stop strings are then
// rejected.
absl::StatusOr<ValidatedRequest> ValidateRequest(const v1::GenerateRequest& request,
                                                 const ModelLimits& limits,
                                                 const Tokenizer* tokenizer);

}  // namespace tandem
