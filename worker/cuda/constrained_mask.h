// Constrained decoding on the device: the tokens a row's grammar refuses are set to -inf in its
// logits before the sampler draws (worker/constrained_sampling.h builds the bitmasks on the host).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace tandem::cuda {

// logits (samples, vocab) fp32: for each k < rows, row mask_rows[k]'s id i becomes -inf unless
// bit i % 32 of word i / 32 of masks[k] (words 32-bit words per row) is set.
absl::Status LaunchMaskLogits(float* logits, int vocab, const uint32_t* masks, int words,
                              const int32_t* mask_rows, int rows, cudaStream_t stream);

}  // namespace tandem::cuda
