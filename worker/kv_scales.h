// The scales of a KV-cache kept in FP8 (--kv_cache_dtype fp8): per layer, the numbers that the
// codes of the layer's K and V are multiples of (common/fp8_quantize.h, EncodeKvE4M3). Read from
// the checkpoint where it publishes them, as vLLM and compressed-tensors FP8 checkpoints with a
// kv_cache_scheme do; otherwise computed from each layer's weights (EstimateKvScales), the same on
// every stage and backend that holds the layer. Every backend takes them from here.
#pragma once

#include <vector>

#include "absl/status/statusor.h"

namespace tandem {

class Checkpoint;  // common/safetensors.h

struct KvScales {
  float k = 1.0f;  // a K element x is stored as E4M3(x / k) and read as E4M3(code) * k
  float v = 1.0f;  // the same for V
  bool operator==(const KvScales&) const = default;
};

// The scales of the model layers [first_layer, last_layer) of `ckpt`, one pair per layer: the
// fp32 scalars KvScaleTensorName (common/model_config.h) names, model.layers.{i}.self_attn.k_scale
// and .v_scale (with or without the "model." prefix), where the checkpoint has them;
// EstimateKvScales where it has none. A checkpoint that has some must have both of every layer of the model.
// INVALID_ARGUMENT naming the tensor for a scale that is not a finite number > 0, not a scalar
// ([] or [1]) or not F32, F16 or BF16, and naming the missing tensor for one that is not there;
// INVALID_ARGUMENT for a layer range outside the model.
absl::StatusOr<std::vector<KvScales>> LoadKvScales(Checkpoint& ckpt, int first_layer,
                                                   int last_layer);

// Where the estimated RMS of a layer's K (or V) lands in codes: E4M3 then holds values up to 112
// times the RMS (448 / 4), at full precision down to 1/256 of it (its smallest normal, 2^-6, over
// 4): room for the outliers of real models' keys, and little of a Gaussian below the normals.
inline constexpr double kKvRmsInCodes = 4.0;

// Scales computed from the weights of layers [first_layer, last_layer), for a checkpoint that
// publishes none: K's and V's RMS estimated as that of their projections' outputs for a normed
// input (unit mean square per element times the norm's weight, plus its bias for LayerNorm), plus
// the projection's bias; a Qwen3 k_norm's weight's RMS for K. Scale = RMS / kKvRmsInCodes (1
// where the estimate is 0). Deterministic: every stage holding a layer computes the same.
absl::StatusOr<std::vector<KvScales>> EstimateKvScales(Checkpoint& ckpt, int first_layer,
                                                       int last_layer);

}  // namespace tandem
