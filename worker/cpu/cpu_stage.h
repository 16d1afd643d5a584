// The fp32 reference backend: OpenBLAS GEMMs, a KV-cache on the host. It is what CI and the
// default demo run, and the oracle the CUDA backend is tested against.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/stage.h"

namespace tandem {

absl::StatusOr<std::unique_ptr<Stage>> MakeCpuStage(const StageSpec& spec);

// The ranks of `spec`'s stage split over all_reduce.ranks() ranks (cpu_tensor_parallel.h): rank
// r's stage holds its shard of the weights (worker/tensor_parallel.h) and the KV-cache of its
// heads, and sums its row-parallel outputs with the other ranks' through `all_reduce`, which must
// outlive them. Their config() is the whole model's. INVALID_ARGUMENT where the model does not
// split so (CheckTensorParallel).
class CpuAllReduce;
absl::StatusOr<std::vector<std::unique_ptr<Stage>>> MakeCpuStageRanks(const StageSpec& spec,
                                                                      CpuAllReduce& all_reduce);

// Threads of the process's OpenBLAS GEMMs (process-wide: every CPU stage of the process uses
// them). OpenBLAS's own default takes every core and spins its idle threads, which starves the
// coordinator and front end that share the host; the worker sets 1 unless told more.
// INVALID_ARGUMENT below 1.
absl::Status SetCpuThreads(int threads);
int CpuThreads();

}  // namespace tandem
