// Device activations to host memory, for links that carry host bytes (the gRPC StageLink). The
// dtype stays as it is: fp16/bf16 rows travel as half the bytes of fp32.
#pragma once

#include "absl/status/statusor.h"
#include "worker/stage.h"

namespace tandem {

// A host copy of `a` ([rows, cols] of a.dtype) made on CUDA device `device`, which must hold a's
// memory; `a` itself when it is already on the host. The device's writes to `a` must be complete
// (as Stage::Step returns them).
absl::StatusOr<Activations> CopyActivationsToHost(const Activations& a, int device);

}  // namespace tandem
