// The benchmarks' view of a decode profile: means per step and the table of them (no GPU needed).
#include "bench/decode_profile.h"

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"

namespace tandem {
namespace {

CudaDecodeProfile FourSteps() {
  CudaDecodeProfile p;
  p.steps = 4;
  p.idle_gaps = 3;
  p.device_ms = 12.0;
  p.forward_ms = 10.0;
  p.host_ms = 12.4;
  p.idle_ms = 0.03;
  p.launched_ms = 0.08;
  p.start_ms = 0.04;
  p.first_layer_ms = 0.44;
  p.middle_layers_ms = 0.4;
  p.last_layer_ms = 0.48;
  p.head_ms = 0.2;
  return p;
}

TEST(DecodeProfileTest, PerStepDividesByStepsAndIdleByGaps) {
  const DecodeStepTimes t = PerStep(FourSteps());
  EXPECT_DOUBLE_EQ(t.device_ms, 3.0);
  EXPECT_DOUBLE_EQ(t.forward_ms, 2.5);
  EXPECT_DOUBLE_EQ(t.host_ms, 3.1);
  EXPECT_DOUBLE_EQ(t.idle_us, 10.0);
  EXPECT_DOUBLE_EQ(t.host_to_launch_us, 20.0);
  EXPECT_DOUBLE_EQ(t.to_first_layer_us, 10.0);
  EXPECT_DOUBLE_EQ(t.first_layer_us, 110.0);
  EXPECT_DOUBLE_EQ(t.middle_layer_us, 100.0);
  EXPECT_DOUBLE_EQ(t.last_layer_us, 120.0);
  EXPECT_DOUBLE_EQ(t.after_layers_us, 50.0);
}

TEST(DecodeProfileTest, NoStepsOrNoGapsGiveZerosNotDivisionsByZero) {
  const DecodeStepTimes none = PerStep(CudaDecodeProfile{});
  EXPECT_EQ(none.device_ms, 0);
  EXPECT_EQ(none.idle_us, 0);
  CudaDecodeProfile one = FourSteps();
  one.steps = 1;
  one.idle_gaps = 0;
  EXPECT_EQ(PerStep(one).idle_us, 0);
  EXPECT_DOUBLE_EQ(PerStep(one).device_ms, 12.0);
}

TEST(DecodeProfileTest, TableHasOneLinePerRowWithBatchStageAndMeans) {
  const std::string table = DecodeProfileTable({{8, 1, FourSteps()}, {64, 0, FourSteps()}});
  std::vector<std::string> lines;
  for (absl::string_view l : absl::StrSplit(table, '\n')) {
    if (absl::StartsWith(l, "| ")) lines.emplace_back(l);
  }
  ASSERT_EQ(lines.size(), 3u);  // header and two rows
  EXPECT_EQ(lines[1],
            "| 8 | 1 | 3.000 | 2.500 | 10.0 | 20.0 | 10.0 | 110.0 | 100.0 | 120.0 | 50.0 |");
  EXPECT_EQ(lines[2].rfind("| 64 | 0 | 3.000 |", 0), 0u) << lines[2];
}

}  // namespace
}  // namespace tandem
