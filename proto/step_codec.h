// The one codec of a step between the plain types of common/step.h and the Worker service's
// messages: the coordinator encodes a step descriptor and decodes a result's logprobs, a worker
// decodes the descriptor and encodes the logprobs. Each pair round-trips (tests/proto).
#pragma once

#include <cstdint>
#include <vector>

#include "common/step.h"
#include "common/structured/grammar_cache.h"
#include "proto/tandem.pb.h"

namespace tandem {

// `step` for the stages of assignment `assignment_id`. Fields a row leaves off (no logprobs, no
// penalties) stay unset. return_logits is not sent: only in-process callers ask for logits.
v1::StepRequest ToStepRequest(const StepDescriptor& step, uint64_t assignment_id);

// The descriptor a StepRequest carries. A repetition_penalty of 0 (unset) reads as 1 (off); seen
// tokens are read up to the shortest of their three parallel lists.
StepDescriptor FromStepRequest(const v1::StepRequest& req);

// An output constraint between its message and its plain form (the request's, and a sampling
// row's).
structured::Constraint ConstraintFromProto(const v1::OutputConstraint& in);
v1::OutputConstraint ConstraintToProto(const structured::Constraint& in);

// Appends one SequenceLogprobs message per entry of `logprobs` to `result`.
void AddLogprobs(const std::vector<SequenceLogprobs>& logprobs, v1::StepResult& result);

// The logprobs of a step's result, one entry per sequence that asked for any.
std::vector<SequenceLogprobs> LogprobsFromProto(const v1::StepResult& result);

}  // namespace tandem
