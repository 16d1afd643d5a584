// The sampling rule of worker/sampling.h: greedy, temperature, top-k, top-p, min-p, penalties,
// seeded draws, raw logprobs.
#include "worker/sampling.h"

#include <cmath>
#include <limits>
#include <vector>

#include "common/rng.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

SamplingParams Params(float temperature, int top_k = 0, float top_p = 1.0f, uint64_t seed = 0) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.seed = seed;
  return p;
}

std::vector<float> LogProbs(const std::vector<float>& probs) {
  std::vector<float> l;
  for (float p : probs) l.push_back(std::log(p));
  return l;
}

// Deterministic pseudo-random logits in [-4, 4).
std::vector<float> RandomLogits(int n, uint64_t seed) {
  std::vector<float> l(n);
  for (int i = 0; i < n; ++i) l[i] = 8.0f * UniformFloat(seed, i) - 4.0f;
  return l;
}

// Frequencies of each token over `draws` consecutive sample indices.
std::vector<double> Frequencies(const std::vector<float>& logits, const SamplingParams& p,
                                int draws) {
  std::vector<int> count(logits.size(), 0);
  for (int i = 0; i < draws; ++i) ++count[SampleToken(logits, p, i)];
  std::vector<double> f;
  for (int c : count) f.push_back(static_cast<double>(c) / draws);
  return f;
}

TEST(ValidateSamplingParams, AcceptsDefaultsAndTypicalValues) {
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams{}).ok());
  EXPECT_TRUE(ValidateSamplingParams(Params(0.7f, 50, 0.9f, 123)).ok());
  EXPECT_TRUE(ValidateSamplingParams(Params(1.0f, 0, 1.0f)).ok());
}

TEST(ValidateSamplingParams, RejectsBadTemperatureNamingTheField) {
  for (float t :
       {-0.1f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    absl::Status s = ValidateSamplingParams(Params(t));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << t;
    EXPECT_THAT(s.message(), HasSubstr("temperature")) << t;
  }
}

TEST(ValidateSamplingParams, RejectsNegativeTopKNamingTheField) {
  absl::Status s = ValidateSamplingParams(Params(1.0f, -1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("top_k"));
}

TEST(ValidateSamplingParams, RejectsTopPOutsideZeroOneNamingTheField) {
  for (float p : {0.0f, -0.5f, 1.5f, std::numeric_limits<float>::quiet_NaN()}) {
    absl::Status s = ValidateSamplingParams(Params(1.0f, 0, p));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << p;
    EXPECT_THAT(s.message(), HasSubstr("top_p")) << p;
  }
}

TEST(SampleToken, GreedyIsArgmaxWithLowestIndexOnTies) {
  EXPECT_EQ(SampleToken(std::vector<float>{0.1f, 2.0f, -1.0f, 2.0f}, Params(0.0f), 0), 1);
  EXPECT_EQ(SampleToken(std::vector<float>{-3.0f, -2.0f, -5.0f}, Params(0.0f), 7), 1);
  EXPECT_EQ(SampleToken(std::vector<float>{5.0f}, Params(0.0f), 0), 0);
}

TEST(SampleToken, TiedCandidatesKeepTheLowerIdFirst) {
  // Step 2b: equal probabilities order the lower id first, so top-k 1 keeps id 1 of the tie.
  for (uint64_t i = 0; i < 20; ++i) {
    EXPECT_EQ(SampleToken(std::vector<float>{1.0f, 3.0f, 0.0f, 3.0f}, Params(1.0f, 1), i), 1);
  }
  // Two tied tokens of p = 0.5: the draw u picks id 0 when u < 0.5 (its cumulative 0.5 exceeds
  // u), else id 1; reversing the tie would swap every pick.
  const SamplingParams p = Params(1.0f, 0, 1.0f, 11);
  for (uint64_t i = 0; i < 64; ++i) {
    const int32_t want = UniformFloat(p.seed, i) < 0.5f ? 0 : 1;
    EXPECT_EQ(SampleToken(std::vector<float>{2.0f, 2.0f}, p, i), want) << "draw " << i;
  }
}

TEST(SampleToken, GreedySkipsNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(SampleToken(std::vector<float>{nan, 1.0f, 3.0f, nan}, Params(0.0f), 0), 2);
}

TEST(SampleToken, GreedyIgnoresSeedAndIndex) {
  const std::vector<float> logits = RandomLogits(100, 5);
  const int32_t first = SampleToken(logits, Params(0.0f, 0, 1.0f, 1), 0);
  for (uint64_t i = 0; i < 20; ++i) {
    EXPECT_EQ(SampleToken(logits, Params(0.0f, 0, 1.0f, i * 31), i), first);
  }
}

TEST(SampleToken, SeededDrawIsReproducibleAndVariesWithSeed) {
  const std::vector<float> logits = RandomLogits(50, 9);
  std::vector<int> seen(50, 0);
  for (uint64_t seed = 0; seed < 200; ++seed) {
    const int32_t a = SampleToken(logits, Params(1.0f, 0, 1.0f, seed), 3);
    EXPECT_EQ(SampleToken(logits, Params(1.0f, 0, 1.0f, seed), 3), a);
    seen[a] = 1;
  }
  int distinct = 0;
  for (int s : seen) distinct += s;
  EXPECT_GT(distinct, 5);  // a flat-ish distribution over 50 tokens, 200 seeds
}

// Candidates sorted by probability: index 1 (0.5), index 2 (0.3), index 0 (0.2); the token is the
// first whose cumulative probability exceeds u = UniformFloat(seed, index).
TEST(SampleToken, InverseCdfOverCandidatesSortedByProbability) {
  const std::vector<float> logits = LogProbs({0.2f, 0.5f, 0.3f});
  int checked = 0;
  for (uint64_t seed = 0; seed < 500; ++seed) {
    const float u = UniformFloat(seed, 11);
    if (std::abs(u - 0.5f) < 1e-4f || std::abs(u - 0.8f) < 1e-4f) continue;
    const int32_t want = u < 0.5f ? 1 : (u < 0.8f ? 2 : 0);
    EXPECT_EQ(SampleToken(logits, Params(1.0f, 0, 1.0f, seed), 11), want) << "u=" << u;
    ++checked;
  }
  EXPECT_GT(checked, 450);
}

TEST(SampleToken, TopKOneIsGreedy) {
  for (uint64_t trial = 0; trial < 50; ++trial) {
    const std::vector<float> logits = RandomLogits(257, trial);
    const int32_t greedy = SampleToken(logits, Params(0.0f), 0);
    EXPECT_EQ(SampleToken(logits, Params(1.5f, 1, 1.0f, trial), trial), greedy);
  }
}

TEST(SampleToken, TinyTopPIsGreedy) {
  for (uint64_t trial = 0; trial < 50; ++trial) {
    const std::vector<float> logits = RandomLogits(257, 100 + trial);
    const int32_t greedy = SampleToken(logits, Params(0.0f), 0);
    EXPECT_EQ(SampleToken(logits, Params(2.0f, 0, 1e-6f, trial), trial), greedy);
  }
}

TEST(SampleToken, FrequenciesFollowProbabilities) {
  const std::vector<float> probs = {0.05f, 0.5f, 0.15f, 0.3f};
  const std::vector<double> f = Frequencies(LogProbs(probs), Params(1.0f, 0, 1.0f, 77), 20000);
  for (size_t i = 0; i < probs.size(); ++i) EXPECT_NEAR(f[i], probs[i], 0.02) << i;
}

TEST(SampleToken, TopKKeepsTheKMostLikelyRenormalised) {
  // Top two: index 1 (0.5) and index 3 (0.3), renormalised to 0.625 and 0.375.
  const std::vector<double> f =
      Frequencies(LogProbs({0.05f, 0.5f, 0.15f, 0.3f}), Params(1.0f, 2, 1.0f, 3), 20000);
  EXPECT_EQ(f[0], 0.0);
  EXPECT_EQ(f[2], 0.0);
  EXPECT_NEAR(f[1], 0.625, 0.02);
  EXPECT_NEAR(f[3], 0.375, 0.02);
}

TEST(SampleToken, TopPKeepsTheSmallestPrefixReachingP) {
  // Cumulative: 0.5, 0.8, 0.95, 1.0; top_p 0.7 keeps the first two.
  const std::vector<double> f =
      Frequencies(LogProbs({0.05f, 0.5f, 0.15f, 0.3f}), Params(1.0f, 0, 0.7f, 4), 20000);
  EXPECT_EQ(f[0], 0.0);
  EXPECT_EQ(f[2], 0.0);
  EXPECT_NEAR(f[1], 0.625, 0.02);
  EXPECT_NEAR(f[3], 0.375, 0.02);
}

TEST(SampleToken, TopPAppliesToTheMassRenormalisedAfterTopK) {
  // top_k 2 keeps 0.4 and 0.3, renormalised 0.571 and 0.429: top_p 0.5 keeps only the first.
  // (Over the original mass, 0.4 < 0.5 would have kept both.)
  const std::vector<float> logits = LogProbs({0.1f, 0.3f, 0.4f, 0.2f});
  for (uint64_t i = 0; i < 500; ++i) {
    EXPECT_EQ(SampleToken(logits, Params(1.0f, 2, 0.5f, 8), i), 2);
  }
}

TEST(SampleToken, TemperatureSharpensAndFlattens) {
  const std::vector<float> logits = {0.0f, 1.0f};
  // p(1) = 1 / (1 + e^-1) = 0.731 at temperature 1; e^-100 at 0.01; ~0.5 at 1000.
  EXPECT_NEAR(Frequencies(logits, Params(1.0f, 0, 1.0f, 1), 20000)[1], 0.731, 0.02);
  EXPECT_EQ(Frequencies(logits, Params(0.01f, 0, 1.0f, 1), 2000)[1], 1.0);
  EXPECT_NEAR(Frequencies(logits, Params(1000.0f, 0, 1.0f, 1), 20000)[1], 0.5, 0.02);
}

TEST(SampleToken, NonFiniteLogitsFallBackToGreedyWithoutCrashing) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(SampleToken(std::vector<float>{1.0f, inf, 2.0f}, Params(1.0f), 0), 1);
  EXPECT_EQ(SampleToken(std::vector<float>{-inf, -inf}, Params(1.0f), 0), 0);
  const int32_t t = SampleToken(std::vector<float>{nan, 0.0f, nan, 1.0f}, Params(1.0f), 0);
  EXPECT_TRUE(t == 1 || t == 3);
}

TEST(ValidateSamplingParams, RejectsOutOfRangeControlsNamingTheField) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    const char* field;
    float value;
    void (*set)(SamplingParams&, float);
  };
  const Case cases[] = {
      {"min_p", -0.1f, [](SamplingParams& p, float v) { p.min_p = v; }},
      {"min_p", 1.5f, [](SamplingParams& p, float v) { p.min_p = v; }},
      {"min_p", nan, [](SamplingParams& p, float v) { p.min_p = v; }},
      {"presence_penalty", 2.5f, [](SamplingParams& p, float v) { p.presence_penalty = v; }},
      {"presence_penalty", nan, [](SamplingParams& p, float v) { p.presence_penalty = v; }},
      {"frequency_penalty", -2.5f, [](SamplingParams& p, float v) { p.frequency_penalty = v; }},
      {"repetition_penalty", 0.0f, [](SamplingParams& p, float v) { p.repetition_penalty = v; }},
      {"repetition_penalty", -1.0f, [](SamplingParams& p, float v) { p.repetition_penalty = v; }},
      {"repetition_penalty", 1e9f, [](SamplingParams& p, float v) { p.repetition_penalty = v; }},
  };
  for (const Case& c : cases) {
    SamplingParams p = Params(1.0f);
    c.set(p, c.value);
    const absl::Status s = ValidateSamplingParams(p);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field << " " << c.value;
    EXPECT_THAT(s.message(), HasSubstr(c.field)) << c.value;
  }
  SamplingParams edges = Params(1.0f);
  edges.min_p = 1.0f;
  edges.presence_penalty = -2.0f;
  edges.frequency_penalty = 2.0f;
  edges.repetition_penalty = 100.0f;
  EXPECT_TRUE(ValidateSamplingParams(edges).ok());
}

TEST(SampleToken, MinPOneKeepsOnlyTheMostLikelyToken) {
  SamplingParams p = Params(1.0f, 0, 1.0f, 5);
  p.min_p = 1.0f;
  for (uint64_t trial = 0; trial < 50; ++trial) {
    const std::vector<float> logits = RandomLogits(257, 300 + trial);
    EXPECT_EQ(SampleToken(logits, p, trial), SampleToken(logits, Params(0.0f), 0));
  }
}

TEST(SampleToken, MinPOneKeepsEveryTokenTiedWithTheMostLikely) {
  SamplingParams p = Params(1.0f, 0, 1.0f, 6);
  p.min_p = 1.0f;
  const std::vector<double> f = Frequencies({2.0f, 0.0f, 2.0f, 1.0f}, p, 20000);
  EXPECT_NEAR(f[0], 0.5, 0.02);
  EXPECT_NEAR(f[2], 0.5, 0.02);
  EXPECT_EQ(f[1], 0.0);
  EXPECT_EQ(f[3], 0.0);
}

TEST(SampleToken, MinPKeepsTokensAtLeastMinPTimesTheMostLikely) {
  // p = 0.5, 0.3, 0.15, 0.05; min_p 0.5: floor 0.25 keeps 0.5 and 0.3 -> 0.625, 0.375.
  SamplingParams p = Params(1.0f, 0, 1.0f, 7);
  p.min_p = 0.5f;
  const std::vector<double> f = Frequencies(LogProbs({0.15f, 0.5f, 0.05f, 0.3f}), p, 20000);
  EXPECT_NEAR(f[1], 0.625, 0.02);
  EXPECT_NEAR(f[3], 0.375, 0.02);
  EXPECT_EQ(f[0], 0.0);
  EXPECT_EQ(f[2], 0.0);
  // min_p 0.25: floor 0.125 also keeps 0.15 (0.15 / 0.95 = 0.158).
  p.min_p = 0.25f;
  EXPECT_NEAR(Frequencies(LogProbs({0.15f, 0.5f, 0.05f, 0.3f}), p, 20000)[0], 0.158, 0.02);
}

TEST(SampleToken, MinPAppliesAfterTemperature) {
  // Logits 0 and -1: at temperature 1 the ratio is e^-1 = 0.37 < 0.5 (token 1 cut); at
  // temperature 4 it is e^-0.25 = 0.78 (kept).
  const std::vector<float> logits = {0.0f, -1.0f};
  SamplingParams p = Params(1.0f, 0, 1.0f, 8);
  p.min_p = 0.5f;
  EXPECT_EQ(Frequencies(logits, p, 2000)[1], 0.0);
  p.temperature = 4.0f;
  EXPECT_GT(Frequencies(logits, p, 2000)[1], 0.3);
}

TEST(ApplyPenalties, FollowsVllmOrderOnSeenTokensOnly) {
  // rp 2, frequency 0.5, presence 0.25:
  //   token 0 (generated twice, in the prompt): 2 / 2 = 1, - 0.5 * 2 = 0, - 0.25 = -0.25
  //   token 1 (prompt only): -1 * 2 = -2; no frequency or presence (never generated)
  //   token 2 (never seen): untouched
  //   token 3 (generated once): 1 / 2 = 0.5, - 0.5 = 0, - 0.25 = -0.25
  std::vector<float> logits = {2.0f, -1.0f, 0.5f, 1.0f};
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  const std::vector<SeenToken> seen = {{.id = 0, .output_count = 2, .in_prompt = true},
                                       {.id = 1, .output_count = 0, .in_prompt = true},
                                       {.id = 3, .output_count = 1, .in_prompt = false}};
  ApplyPenalties(logits, p, seen);
  EXPECT_THAT(logits, ::testing::ElementsAre(-0.25f, -2.0f, 0.5f, -0.25f));
}

TEST(ApplyPenalties, PresenceAndFrequencyIgnoreThePromptAndNegativeValuesReward) {
  std::vector<float> logits = {1.0f, 1.0f, 1.0f};
  SamplingParams p;
  p.presence_penalty = -1.0f;
  p.frequency_penalty = -0.5f;
  const std::vector<SeenToken> seen = {{.id = 0, .output_count = 0, .in_prompt = true},
                                       {.id = 2, .output_count = 3, .in_prompt = false}};
  ApplyPenalties(logits, p, seen);
  // Token 2: 1 + 0.5 * 3 + 1 = 3.5; token 0, prompt only, and token 1, unseen, stay at 1.
  EXPECT_THAT(logits, ::testing::ElementsAre(1.0f, 1.0f, 3.5f));
}

TEST(ApplyPenalties, RepetitionPenaltyBelowOneRewardsAndIgnoresUnseen) {
  std::vector<float> logits = {2.0f, -2.0f, 3.0f};
  SamplingParams p;
  p.repetition_penalty = 0.5f;
  const std::vector<SeenToken> seen = {{.id = 0, .output_count = 1, .in_prompt = false},
                                       {.id = 1, .output_count = 0, .in_prompt = true}};
  ApplyPenalties(logits, p, seen);
  EXPECT_THAT(logits, ::testing::ElementsAre(4.0f, -1.0f, 3.0f));
}

TEST(ApplyPenalties, ChangesTheGreedyPick) {
  std::vector<float> logits = {3.0f, 2.0f};
  SamplingParams p;
  p.presence_penalty = 1.5f;
  ApplyPenalties(logits, p, std::vector<SeenToken>{{.id = 0, .output_count = 1}});
  EXPECT_EQ(SampleToken(logits, p, 0), 1);
}

TEST(SampleToken, DistinctSeedsGiveDistinctSequences) {
  // What sampling.n relies on: sequences with seeds s and s + 1 draw differently.
  const std::vector<float> logits = RandomLogits(64, 21);
  std::vector<int32_t> a, b;
  for (uint64_t i = 0; i < 16; ++i) {
    a.push_back(SampleToken(logits, Params(1.0f, 0, 1.0f, 1000), i));
    b.push_back(SampleToken(logits, Params(1.0f, 0, 1.0f, 1001), i));
  }
  EXPECT_NE(a, b);
}

TEST(ComputeLogprob, IsTheLogSoftmaxOfTheRawLogits) {
  // p = 0.25, 0.75.
  const std::vector<float> logits = {0.0f, std::log(3.0f)};
  const TokenLogprob l = ComputeLogprob(logits, 0, 2);
  EXPECT_EQ(l.token, 0);
  EXPECT_NEAR(l.logprob, std::log(0.25f), 1e-6);
  ASSERT_EQ(l.top.size(), 2u);
  EXPECT_EQ(l.top[0].first, 1);
  EXPECT_NEAR(l.top[0].second, std::log(0.75f), 1e-6);
  EXPECT_EQ(l.top[1].first, 0);
  EXPECT_NEAR(l.top[1].second, std::log(0.25f), 1e-6);
}

TEST(ComputeLogprob, GreedyPickHasTheLargestLogprob) {
  for (uint64_t trial = 0; trial < 20; ++trial) {
    const std::vector<float> logits = RandomLogits(300, 500 + trial);
    const int32_t greedy = SampleToken(logits, Params(0.0f), 0);
    const TokenLogprob l = ComputeLogprob(logits, greedy, 5);
    ASSERT_EQ(l.top.size(), 5u);
    EXPECT_EQ(l.top[0].first, greedy);
    EXPECT_EQ(l.top[0].second, l.logprob);
    for (size_t j = 1; j < l.top.size(); ++j) EXPECT_LE(l.top[j].second, l.top[j - 1].second);
    // log-softmax max = -log(sum exp(x - max)).
    double sum = 0;
    const float mx = logits[greedy];
    for (float x : logits) sum += std::exp(static_cast<double>(x) - mx);
    EXPECT_NEAR(l.logprob, -std::log(sum), 1e-5);
  }
}

TEST(ComputeLogprob, TopAlternativesBreakTiesByLowerIdAndClampToTheVocabulary) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 3.0f, 1.0f};
  const TokenLogprob l = ComputeLogprob(logits, 4, 4);
  ASSERT_EQ(l.top.size(), 4u);
  EXPECT_EQ(l.top[0].first, 1);
  EXPECT_EQ(l.top[1].first, 3);
  EXPECT_EQ(l.top[2].first, 2);
  EXPECT_EQ(l.top[3].first, 0);
  EXPECT_EQ(l.top[0].second, l.top[1].second);
  EXPECT_EQ(l.logprob, l.top[3].second);
  EXPECT_EQ(ComputeLogprob(logits, 0, 20).top.size(), 5u);
  EXPECT_TRUE(ComputeLogprob(logits, 0, 0).top.empty());
}

}  // namespace
}  // namespace tandem
