// StageLink's frame: one ActivationsMessage carries one step's activations as raw host rows of
// fp32, fp16 or bf16. The sending stage encodes them; the receiving stage decodes what arrives
// from the network, so decoding trusts no field: the dtype must be known and the bytes must be
// exactly rows x cols of it.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "proto/tandem.pb.h"
#include "worker/stage.h"

namespace tandem {

// The message for host activations `a` of step `step` of assignment `assignment`.
v1::ActivationsMessage EncodeActivations(uint64_t assignment, uint64_t step, const Activations& a);

// The host activations a message carries, in a buffer of their own (aligned for every dtype).
// INVALID_ARGUMENT naming the step when the dtype is unknown, rows < 0, cols <= 0, or the data is
// not rows x cols elements of the dtype (products that overflow included).
absl::StatusOr<Activations> DecodeActivations(const v1::ActivationsMessage& msg);

}  // namespace tandem
