// The cpu backend of a worker (cpu_backend.h).
#include "worker/cpu/cpu_backend.h"

#include "worker/cpu/cpu_stage.h"

namespace tandem {

absl::StatusOr<std::unique_ptr<Stage>> CpuBackend::MakeStage(const StageSpec& spec) {
  return MakeCpuStage(spec);
}

}  // namespace tandem
