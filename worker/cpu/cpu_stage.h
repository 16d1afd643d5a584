// The fp32 reference backend: OpenBLAS GEMMs, a KV-cache on the host. It is what CI and the
// default demo run, and the oracle the CUDA backend is tested against.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "worker/stage.h"

namespace tandem {

absl::StatusOr<std::unique_ptr<Stage>> MakeCpuStage(const StageSpec& spec);

}  // namespace tandem
