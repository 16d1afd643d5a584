#include "loadgen/workload.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::loadgen {
namespace {

using ::testing::HasSubstr;

double Quantile(std::vector<int> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1))];
}

TEST(WorkloadTest, DrawsAreReproducibleFromTheSeed) {
  const WorkloadSpec mixed{.kind = "mixed"};
  const std::vector<WorkloadItem> a = MakeWorkloadPool(mixed, 7, 500, 200, 64, 32000, 8192);
  const std::vector<WorkloadItem> b = MakeWorkloadPool(mixed, 7, 500, 200, 64, 32000, 8192);
  const std::vector<WorkloadItem> c = MakeWorkloadPool(mixed, 8, 500, 200, 64, 32000, 8192);
  ASSERT_EQ(a.size(), 64u);
  int same_lengths = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].prompt, b[i].prompt);
    EXPECT_EQ(a[i].output_len, b[i].output_len);
    same_lengths += a[i].prompt.size() == c[i].prompt.size();
  }
  EXPECT_LT(same_lengths, 8);  // another seed, other lengths
  // The same values on every machine: pinned.
  EXPECT_THAT(LognormalLengths(1, 4, 500, 1.0, 100000), ::testing::ElementsAre(953, 98, 188, 889));
}

TEST(WorkloadTest, LognormalLengthsHaveTheMedianAndTheTailAsked) {
  const std::vector<int> prompts = LognormalLengths(3, 20000, 500, 1.0, 1 << 20);
  EXPECT_NEAR(Quantile(prompts, 0.5), 500, 25);
  // At sigma 1 the 99th percentile is e^2.326 = 10.2 times the median: into the thousands.
  EXPECT_NEAR(Quantile(prompts, 0.99), 5120, 600);
  EXPECT_GT(*std::max_element(prompts.begin(), prompts.end()), 10000);
  const std::vector<int> outputs = LognormalLengths(4, 20000, 200, 1.0, 1 << 20);
  EXPECT_NEAR(Quantile(outputs, 0.5), 200, 10);
  EXPECT_GE(*std::min_element(outputs.begin(), outputs.end()), 1);
}

TEST(WorkloadTest, MixedLengthsAreClippedToTheContext) {
  const std::vector<WorkloadItem> pool =
      MakeWorkloadPool({.kind = "mixed"}, 1, 500, 200, 2000, 32000, 2048);
  int long_prompts = 0;
  for (const WorkloadItem& w : pool) {
    ASSERT_GE(w.prompt.size(), 1u);
    ASSERT_GE(w.output_len, 1);
    ASSERT_LE(static_cast<int>(w.prompt.size()) + w.output_len, 2048);
    long_prompts += w.prompt.size() > 1500;
    for (int32_t t : w.prompt) ASSERT_LT(t, 32000);
  }
  EXPECT_GT(long_prompts, 0);  // the tail reaches the clip
}

TEST(WorkloadTest, SharedPrefixIsIdenticalAcrossRequestsAndSuffixesDiffer) {
  const WorkloadSpec w{.kind = "shared_prefix", .shared_prefix_len = 100};
  const std::vector<WorkloadItem> pool = MakeWorkloadPool(w, 5, 20, 8, 16, 50000, 0);
  std::set<std::vector<int32_t>> suffixes;
  for (const WorkloadItem& item : pool) {
    ASSERT_EQ(item.prompt.size(), 120u);
    EXPECT_EQ(item.output_len, 8);
    EXPECT_TRUE(std::equal(item.prompt.begin(), item.prompt.begin() + 100, pool[0].prompt.begin()));
    suffixes.emplace(item.prompt.begin() + 100, item.prompt.end());
  }
  EXPECT_EQ(suffixes.size(), pool.size());
  // The system prompt is not one of the suffixes' prompts.
  EXPECT_NE(std::vector<int32_t>(pool[0].prompt.begin(), pool[0].prompt.begin() + 20),
            MakePrompt(5, 0, 20, 50000));
}

TEST(WorkloadTest, FixedSendsEveryPromptOfTheConfiguredLength) {
  const std::vector<WorkloadItem> pool = MakeWorkloadPool({}, 9, 12, 10, 4, 1000, 256);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(pool[i].prompt, MakePrompt(9, i, 12, 1000));
    EXPECT_EQ(pool[i].output_len, 10);
  }
}

TEST(WorkloadTest, ValidationNamesTheFlag) {
  EXPECT_THAT(ValidateWorkload({.kind = "bursty"}).message(), HasSubstr("--workload"));
  EXPECT_THAT(ValidateWorkload({.kind = "shared_prefix", .shared_prefix_len = 0}).message(),
              HasSubstr("--shared_prefix_len"));
  EXPECT_THAT(ValidateWorkload({.kind = "mixed", .length_sigma = -1}).message(),
              HasSubstr("--length_sigma"));
  EXPECT_TRUE(ValidateWorkload({.kind = "mixed"}).ok());
}

}  // namespace
}  // namespace tandem::loadgen
