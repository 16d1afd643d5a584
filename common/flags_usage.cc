// Abseil's usage configuration for tandem's programs (common/flags_usage.h).
#include "common/flags_usage.h"

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"

namespace tandem {

bool IsTandemFlagFile(absl::string_view file) { return !absl::StrContains(file, "absl/"); }

void SetProgramUsage(absl::string_view usage) {
  absl::FlagsUsageConfig config;
  config.contains_help_flags = IsTandemFlagFile;
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);
  absl::SetProgramUsageMessage(usage);
}

}  // namespace tandem
