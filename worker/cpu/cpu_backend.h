// The cpu backend of a worker: stages of the fp32 reference forward on the host (cpu_stage.h),
// nothing on a device.
#pragma once

#include <memory>

#include "worker/backend.h"

namespace tandem {

class CpuBackend final : public Backend {
 public:
  absl::StatusOr<std::unique_ptr<Stage>> MakeStage(const StageSpec& spec) override;
};

}  // namespace tandem
