// The rotary inverse frequencies of a Llama-architecture config: what every backend rotates q and
// k by (the pair (i, i + head_dim / 2) at position p turns by p * inv_freq[i]).
#pragma once

#include <vector>

#include "common/model_config.h"

namespace tandem {

// (head_dim / 2) fp32 frequencies theta^(-2i / head_dim), rescaled as rope_scaling says, computed
// in fp32 in the order of Hugging Face's modeling_rope_utils so that they match its values.
std::vector<float> RopeInverseFrequencies(const ModelConfig& config);

}  // namespace tandem
