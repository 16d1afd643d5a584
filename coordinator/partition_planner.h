// Splits a model's layers into contiguous pipeline stages. Embeddings always go with the first
// stage and the final norm + LM head with the last (the engine loads them from the layer range).
#pragma once

#include <vector>

#include "absl/status/statusor.h"

namespace tandem {

struct LayerRange {
  int first = 0;  // inclusive
  int last = 0;   // exclusive
  bool operator==(const LayerRange&) const = default;
};

// Even split of `num_layers` over `num_stages`; the first `num_layers % num_stages` stages get one
// layer more. INVALID_ARGUMENT when num_stages < 1 or num_stages > num_layers.
absl::StatusOr<std::vector<LayerRange>> PlanEvenPartition(int num_layers, int num_stages);

}  // namespace tandem
