// A request's n sequences: which seed and which logprobs each one gets.
#include "coordinator/request_group.h"

#include <set>

#include "gtest/gtest.h"

namespace tandem {
namespace {

ValidatedRequest Request() {
  ValidatedRequest r;
  r.prompt = {1, 2, 3};
  r.n = 3;
  r.logprobs = 2;
  r.prompt_logprobs = 1;
  r.sampling.temperature = 1.0f;
  return r;
}

TEST(ChoiceRequest, SetSeedGivesSequenceIItsSeedPlusI) {
  ValidatedRequest r = Request();
  r.seed = 40;
  for (int i = 0; i < 3; ++i) {
    const ValidatedRequest c = ChoiceRequest(r, i, /*fresh_seed=*/7);
    EXPECT_EQ(c.sampling.seed, 40u + i);
    EXPECT_EQ(c.n, 1);
    EXPECT_EQ(c.logprobs, 2);
  }
}

TEST(ChoiceRequest, UnsetSeedTakesTheFreshOne) {
  const ValidatedRequest r = Request();
  EXPECT_EQ(ChoiceRequest(r, 0, 1234).sampling.seed, 1234u);
  EXPECT_EQ(ChoiceRequest(r, 2, 99).sampling.seed, 99u);
}

TEST(ChoiceRequest, OnlyTheFirstSequenceScoresThePrompt) {
  const ValidatedRequest r = Request();
  EXPECT_EQ(ChoiceRequest(r, 0, 1).prompt_logprobs, 1);
  EXPECT_EQ(ChoiceRequest(r, 1, 1).prompt_logprobs, -1);
  EXPECT_EQ(ChoiceRequest(r, 2, 1).prompt_logprobs, -1);
}

TEST(FreshSeed, NeverRepeatsWithinAProcess) {
  std::set<uint64_t> seen;
  for (int i = 0; i < 10000; ++i) seen.insert(FreshSeed());
  EXPECT_EQ(seen.size(), 10000u);
}

}  // namespace
}  // namespace tandem
