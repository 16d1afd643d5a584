// A CPU stage split over N tensor-parallel ranks (worker/tensor_parallel.h): one thread per rank,
// each a CPU stage over its shard of the weights and the KV-cache of its heads, their partial
// sums added through a shared-memory all-reduce (cpu_all_reduce.h). The worker sees one stage:
// Step runs every rank on the step and returns rank 0's output (which samples).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "worker/stage.h"

namespace tandem {

// `spec`'s stage over `ranks` ranks (1: a plain CPU stage). INVALID_ARGUMENT where the model does
// not split over `ranks` (CheckTensorParallel). The stage does not move its KV-cache (ExportKv,
// ImportKv and OpenKvOut are UNIMPLEMENTED) with more than one rank.
absl::StatusOr<std::unique_ptr<Stage>> MakeCpuTensorParallelStage(const StageSpec& spec,
                                                                  int ranks);

}  // namespace tandem
