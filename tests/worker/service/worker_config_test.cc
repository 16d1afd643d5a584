#include "worker/service/worker_config.h"

#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/flags_usage.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/setting_values.h"

// The worker's flags, made as tandem-worker makes them.
TANDEM_DEFINE_SETTING_FLAGS(TANDEM_WORKER_SETTINGS, tandem::WorkerConfig, SetFromFlags)

namespace tandem {
namespace {

using ::testing::HasSubstr;

// Every setting, changed from its default, reaches its field from its flag.
TEST(WorkerConfigTest, EverySettingRoundTripsFromItsFlag) {
  WorkerConfig want;
  std::vector<std::string> args = {"worker_config_test"};
  ForEachWorkerSetting(want, [&](std::string_view name, auto& field, double) {
    field = ChangedSetting(field);
    args.push_back(absl::StrCat("--", std::string(name), "=", SettingText(field)));
  });
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  absl::ParseCommandLine(static_cast<int>(argv.size()), argv.data());
  WorkerConfig from_flags;
  SetFromFlags(from_flags);
  const WorkerConfig defaults;
#define EXPECT_SETTING_ROUND_TRIPS(type, name, default_value, least, help) \
  EXPECT_NE(want.name, defaults.name) << #name;                            \
  EXPECT_EQ(from_flags.name, want.name) << "--" #name;
  TANDEM_WORKER_SETTINGS(EXPECT_SETTING_ROUND_TRIPS)
#undef EXPECT_SETTING_ROUND_TRIPS
}

TEST(WorkerConfigTest, DefaultsAreValid) { EXPECT_TRUE(ValidateWorkerConfig({}).ok()); }

TEST(WorkerConfigTest, ARecvTimeoutBelowOneSecondIsRefusedNamingTheFlag) {
  WorkerConfig c;
  c.recv_timeout_s = 0;
  EXPECT_THAT(ValidateWorkerConfig(c).message(), HasSubstr("--recv_timeout_s must be >= 1, got 0"));
  c.recv_timeout_s = 1;
  EXPECT_TRUE(ValidateWorkerConfig(c).ok());
}

}  // namespace
}  // namespace tandem
