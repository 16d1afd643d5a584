// The request fields that constrain the output (OpenAI's response_format; vLLM's guided_json,
// guided_regex, guided_choice and structured_outputs) read into GenerateRequest.constraint. The
// constraint is compiled here (common/structured/grammar_cache.h) so that a schema the grammar
// engine refuses is a 400 naming the field and the keyword before anything is scheduled.
#pragma once

#include "absl/status/status.h"
#include "nlohmann/json.hpp"
#include "proto/tandem.pb.h"

namespace tandem::openai {

// At most one of the fields may be set; `out` is left unset for none (or response_format text).
absl::Status ParseOutputConstraint(const nlohmann::ordered_json& body, v1::OutputConstraint& out);

}  // namespace tandem::openai
