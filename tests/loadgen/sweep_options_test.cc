// Sweep options are checked before anything runs; percentiles interpolate like numpy's default.
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "loadgen/sweep.h"

namespace tandem::loadgen {
namespace {

using ::testing::HasSubstr;

SweepOptions Good() {
  SweepOptions o;
  o.out = "/tmp/x";
  return o;
}

TEST(SweepOptionsTest, DefaultsWithAnOutputFolderAreValid) {
  EXPECT_TRUE(ValidateSweepOptions(Good()).ok());
}

TEST(SweepOptionsTest, EachBadFieldIsNamed) {
  struct Case {
    const char* field;
    void (*mutate)(SweepOptions&);
  };
  const Case cases[] = {
      {"--nodes", [](SweepOptions& o) { o.nodes = {}; }},
      {"--nodes", [](SweepOptions& o) { o.nodes = {1, 0}; }},
      {"--mode", [](SweepOptions& o) { o.mode = "half-open"; }},
      {"--batch", [](SweepOptions& o) { o.batch = {}; }},
      {"--batch", [](SweepOptions& o) { o.batch = {4, -1}; }},
      {"--rates", [](SweepOptions& o) { o.mode = "open"; }},
      {"--rates", [](SweepOptions& o) {
         o.mode = "open";
         o.rates = {0};
       }},
      {"--prompt_lens", [](SweepOptions& o) { o.prompt_lens = {0}; }},
      {"--output_lens", [](SweepOptions& o) { o.output_lens = {-3}; }},
      {"--requests", [](SweepOptions& o) { o.requests = 0; }},
      {"--warmup", [](SweepOptions& o) { o.warmup = -1; }},
      {"--prompt_pool", [](SweepOptions& o) { o.prompt_pool = 0; }},
      {"--out", [](SweepOptions& o) { o.out.clear(); }},
  };
  for (const Case& c : cases) {
    SweepOptions o = Good();
    c.mutate(o);
    absl::Status s = ValidateSweepOptions(o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.field));
  }
}

TEST(PercentileTest, InterpolatesBetweenRanks) {
  EXPECT_EQ(Percentile({}, 50), 0);
  EXPECT_EQ(Percentile({7}, 99), 7);
  EXPECT_DOUBLE_EQ(Percentile({4, 1, 3, 2}, 50), 2.5);
  EXPECT_DOUBLE_EQ(Percentile({1, 2, 3, 4, 5}, 90), 4.6);
  EXPECT_DOUBLE_EQ(Percentile({1, 2, 3, 4, 5}, 100), 5);
}

}  // namespace
}  // namespace tandem::loadgen
