// The scheduler's plain step types (common/step.h) in and out of the worker service's messages:
// a step descriptor becomes a StepRequest, a StepResult's logprobs become SequenceLogprobs.
#pragma once

#include <cstdint>
#include <vector>

#include "common/step.h"
#include "proto/tandem.pb.h"

namespace tandem {

// `step` for the stages of assignment `assignment_id`. Fields a row leaves off (no logprobs, no
// penalties) stay unset.
v1::StepRequest ToStepRequest(const StepDescriptor& step, uint64_t assignment_id);

// The logprobs of a step's result, one entry per sequence that asked for any.
std::vector<SequenceLogprobs> LogprobsFromProto(const v1::StepResult& result);

}  // namespace tandem
