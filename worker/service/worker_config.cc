// The worker's settings (worker/service/worker_config.h).
#include "worker/service/worker_config.h"

namespace tandem {

absl::Status ValidateWorkerConfig(const WorkerConfig& c) {
  absl::Status status;
  ForEachWorkerSetting(c, [&](std::string_view name, const auto& value, double least) {
    if (status.ok()) status = CheckSettingAtLeast("--", name, value, least);
  });
  return status;
}

}  // namespace tandem
