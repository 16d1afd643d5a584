// Request validation: one check per field, in the order of the proto.
#include "coordinator/request_validation.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "common/structured/grammar_cache.h"
#include "proto/step_codec.h"
#include "common/utf8.h"

namespace tandem {
namespace {

// Stop strings: how many, the bytes of each, and their encoding.
absl::Status CheckStopStrings(const v1::GenerateRequest& request) {
  if (request.stop_size() > kMaxStopStrings) {
    return absl::InvalidArgumentError(
        absl::StrFormat("stop: %d stop strings, more than the %d a request may give",
                        request.stop_size(), kMaxStopStrings));
  }
  for (int i = 0; i < request.stop_size(); ++i) {
    const std::string field = absl::StrFormat("stop[%d]", i);
    const std::string& stop = request.stop(i);
    if (stop.empty()) return absl::InvalidArgumentError(field + ": empty stop string");
    if (stop.size() > static_cast<size_t>(kMaxStopStringBytes)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: %d bytes, more than the %d a stop string may have", field,
                          stop.size(), kMaxStopStringBytes));
    }
    RETURN_IF_ERROR(CheckUtf8(field, stop));
  }
  return absl::OkStatus();
}

// The prompt: text (tokenized here) or token ids, inside the vocabulary and the context.
absl::Status CheckPrompt(const v1::GenerateRequest& request, const ModelLimits& limits,
                         const Tokenizer* tokenizer, ValidatedRequest& out) {
  if (!request.prompt().empty() && request.token_ids_size() > 0) {
    return absl::InvalidArgumentError("prompt and token_ids: give one of them, not both");
  }
  if (request.token_ids_size() > 0) {
    for (int i = 0; i < request.token_ids_size(); ++i) {
      const int32_t id = request.token_ids(i);
      if (id < 0 || id >= limits.vocab_size) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "token_ids[%d]: %d is outside the vocabulary [0, %d)", i, id, limits.vocab_size));
      }
    }
    out.prompt.assign(request.token_ids().begin(), request.token_ids().end());
  } else {
    if (request.prompt().empty()) {
      return absl::InvalidArgumentError("prompt: empty (give prompt text or token_ids)");
    }
    // Before the tokenizer: its time and memory grow with the text.
    RETURN_IF_ERROR(CheckPromptText("prompt", request.prompt(), limits));
    if (tokenizer == nullptr) {
      return absl::InvalidArgumentError(
          "prompt: this model has no tokenizer; give token_ids instead");
    }
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Encode(request.prompt());
    if (!ids.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("prompt: ", ids.status().message()));
    }
    out.prompt = *std::move(ids);
    if (out.prompt.empty()) {
      return absl::InvalidArgumentError("prompt: encodes to no tokens");
    }
    // A tokenizer may know more ids than the model embeds (added tokens past the embedding).
    for (size_t i = 0; i < out.prompt.size(); ++i) {
      if (out.prompt[i] < 0 || out.prompt[i] >= limits.vocab_size) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "prompt: token %d is id %d, outside the model's vocabulary [0, %d)", i,
            out.prompt[i], limits.vocab_size));
      }
    }
  }
  if (static_cast<int>(out.prompt.size()) > limits.context_length) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %d tokens, longer than the context of %d tokens",
        request.token_ids_size() > 0 ? "token_ids" : "prompt", out.prompt.size(),
        limits.context_length));
  }
  return absl::OkStatus();
}

// The sampling parameters, each in its range, into out's sampling fields.
absl::Status CheckSampling(const v1::SamplingParams& s, ValidatedRequest& out) {
  if (!std::isfinite(s.temperature()) || s.temperature() < 0.0f) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sampling.temperature: must be a finite number >= 0, got %g", s.temperature()));
  }
  if (s.top_k() < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sampling.top_k: must be >= 0 (0: no limit), got %d", s.top_k()));
  }
  const float top_p = s.has_top_p() ? s.top_p() : 1.0f;
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sampling.top_p: must be in (0, 1], got %g", top_p));
  }
  if (!(s.min_p() >= 0.0f && s.min_p() <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sampling.min_p: must be in [0, 1] (0: off), got %g", s.min_p()));
  }
  if (!(s.presence_penalty() >= -2.0f && s.presence_penalty() <= 2.0f)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sampling.presence_penalty: must be in [-2, 2] (0: off), got %g", s.presence_penalty()));
  }
  if (!(s.frequency_penalty() >= -2.0f && s.frequency_penalty() <= 2.0f)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sampling.frequency_penalty: must be in [-2, 2] (0: off), got %g",
        s.frequency_penalty()));
  }
  const float repetition = s.has_repetition_penalty() ? s.repetition_penalty() : 1.0f;
  if (!(repetition > 0.0f && repetition <= 100.0f)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sampling.repetition_penalty: must be in (0, 100] (1: off), got %g", repetition));
  }
  if (s.n() < 0 || s.n() > kMaxChoices) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sampling.n: must be in [1, %d] (0: 1), got %d", kMaxChoices, s.n()));
  }
  if (s.top_logprobs() < 0 || s.top_logprobs() > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sampling.top_logprobs: must be in [0, %d], got %d", kMaxTopLogprobs, s.top_logprobs()));
  }
  if (s.top_logprobs() > 0 && !s.logprobs()) {
    return absl::InvalidArgumentError("sampling.top_logprobs: needs sampling.logprobs set");
  }
  if (s.prompt_top_logprobs() < 0 || s.prompt_top_logprobs() > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sampling.prompt_top_logprobs: must be in [0, %d], got %d",
                        kMaxTopLogprobs, s.prompt_top_logprobs()));
  }
  if (s.prompt_top_logprobs() > 0 && !s.prompt_logprobs()) {
    return absl::InvalidArgumentError(
        "sampling.prompt_top_logprobs: needs sampling.prompt_logprobs set");
  }
  out.sampling = {.temperature = s.temperature(),
                  .top_k = s.top_k(),
                  .top_p = top_p,
                  .seed = s.seed(),
                  .min_p = s.min_p(),
                  .presence_penalty = s.presence_penalty(),
                  .frequency_penalty = s.frequency_penalty(),
                  .repetition_penalty = repetition};
  if (s.has_seed()) out.seed = s.seed();
  out.n = std::max(1, s.n());
  out.logprobs = s.logprobs() ? s.top_logprobs() : -1;
  out.prompt_logprobs = s.prompt_logprobs() ? s.prompt_top_logprobs() : -1;
  return absl::OkStatus();
}

// Stop token ids, stop strings and the end-of-sequence tokens.
absl::Status CheckStops(const v1::GenerateRequest& request, const ModelLimits& limits,
                        const Tokenizer* tokenizer, ValidatedRequest& out) {
  for (int i = 0; i < request.stop_token_ids_size(); ++i) {
    const int32_t id = request.stop_token_ids(i);
    if (id < 0 || id >= limits.vocab_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "stop_token_ids[%d]: %d is outside the vocabulary [0, %d)", i, id, limits.vocab_size));
    }
    out.stop_token_ids.push_back(id);
  }
  RETURN_IF_ERROR(CheckStopStrings(request));
  if (request.stop_size() > 0 && tokenizer == nullptr) {
    return absl::InvalidArgumentError(
        "stop: this model has no tokenizer, so stop strings cannot be matched");
  }
  out.stop_strings.assign(request.stop().begin(), request.stop().end());
  return absl::OkStatus();
}

}  // namespace

int64_t MaxPromptBytes(const ModelLimits& limits) {
  return std::max<int64_t>(limits.context_length, 1) * kPromptBytesPerToken;
}

int64_t MaxRequestBytes(const ModelLimits& limits) {
  // Token ids take at most 5 bytes each as varints; 1 MiB covers the other fields.
  const int64_t stops = int64_t{kMaxStopStrings} * (kMaxStopStringBytes + 8);
  const int64_t bytes =
      MaxPromptBytes(limits) + 5 * int64_t{limits.context_length} + stops + (int64_t{1} << 20);
  return std::max<int64_t>(bytes, 4 << 20);
}

absl::Status CheckPromptText(std::string_view field, std::string_view text,
                             const ModelLimits& limits) {
  const int64_t max_bytes = MaxPromptBytes(limits);
  if (static_cast<int64_t>(text.size()) > max_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %d bytes, more than the %d this model takes (%d bytes for each of the %d tokens of "
        "its context)",
        field, text.size(), max_bytes, kPromptBytesPerToken, limits.context_length));
  }
  return CheckUtf8(field, text);
}

// The constraint, compiled (and cached) here so that a bad one is refused before scheduling.
absl::StatusOr<std::shared_ptr<const structured::Constraint>> ConstraintOf(
    const v1::OutputConstraint& in) {
  auto c = std::make_shared<structured::Constraint>(ConstraintFromProto(in));
  if (auto grammar = structured::CompileCached(*c); !grammar.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("constraint: ", grammar.status().message()));
  }
  return c;
}

absl::StatusOr<ValidatedRequest> ValidateRequest(const v1::GenerateRequest& request,
                                                 const ModelLimits& limits,
                                                 const Tokenizer* tokenizer) {
  ValidatedRequest out;
  out.request_id = request.request_id();
  const int context = limits.context_length;
  RETURN_IF_ERROR(CheckPrompt(request, limits, tokenizer, out));
  RETURN_IF_ERROR(CheckSampling(request.sampling(), out));
  if (request.has_constraint() &&
      request.constraint().kind_case() != v1::OutputConstraint::KIND_NOT_SET) {
    ASSIGN_OR_RETURN(out.constraint, ConstraintOf(request.constraint()));
  }
  if (request.has_max_new_tokens()) {
    const int n = request.max_new_tokens();
    if (n < 1 || n > context) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "max_new_tokens: must be between 1 and the context length %d, got %d", context, n));
    }
    out.max_new_tokens = n;
  } else {
    out.max_new_tokens = std::min(kDefaultMaxNewTokens, context);
  }

  RETURN_IF_ERROR(CheckStops(request, limits, tokenizer, out));
  out.eos_token_id = request.ignore_eos() ? -1 : limits.eos_token_id;
  if (!request.ignore_eos()) out.eos_token_ids = limits.eos_token_ids;
  if (request.timeout_ms() > 0) out.timeout = absl::Milliseconds(request.timeout_ms());
  return out;
}

}  // namespace tandem
