// Even layer partitioning.
#include "coordinator/partition_planner.h"

#include "absl/strings/str_format.h"

namespace tandem {

absl::StatusOr<std::vector<LayerRange>> PlanEvenPartition(int num_layers, int num_stages) {
  if (num_layers < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("num_layers must be >= 1, got %d", num_layers));
  }
  if (num_stages < 1 || num_stages > num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "stages must be between 1 and the model's %d layers, got %d", num_layers, num_stages));
  }
  std::vector<LayerRange> ranges;
  const int base = num_layers / num_stages;
  const int extra = num_layers % num_stages;
  int first = 0;
  for (int s = 0; s < num_stages; ++s) {
    const int n = base + (s < extra ? 1 : 0);
    ranges.push_back({first, first + n});
    first += n;
  }
  return ranges;
}

}  // namespace tandem
