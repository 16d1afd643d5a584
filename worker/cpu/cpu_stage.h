// The fp32 reference backend: OpenBLAS GEMMs, a KV-cache on the host. It is what CI and the
// default demo run, and the oracle the CUDA backend is tested against.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "worker/stage.h"

namespace tandem {

absl::StatusOr<std::unique_ptr<Stage>> MakeCpuStage(const StageSpec& spec);

// Threads of the process's OpenBLAS GEMMs (process-wide: every CPU stage of the process uses
// them). OpenBLAS's own default takes every core and spins its idle threads, which starves the
// coordinator and front end that share the host; the worker sets 1 unless told more.
// INVALID_ARGUMENT below 1.
absl::Status SetCpuThreads(int threads);
int CpuThreads();

}  // namespace tandem
