#include "bench/logit_agreement.h"

#include <cmath>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::DoubleNear;
using ::testing::HasSubstr;

TEST(KlDivergenceTest, IsZeroForEqualDistributions) {
  const std::vector<float> a = {1.5f, -2.0f, 0.25f, 7.0f};
  EXPECT_EQ(KlDivergence(a, a), 0.0);
  // Logits shifted by a constant are the same distribution.
  std::vector<float> shifted = a;
  for (float& v : shifted) v += 12.5f;
  EXPECT_NEAR(KlDivergence(a, shifted), 0.0, 1e-12);
}

// p = (1/2, 1/2), q = (3/4, 1/4): KL(p || q) = ln(4/3) / 2; KL(q || p) = 3/4 ln(3/2) - 1/4 ln 2.
TEST(KlDivergenceTest, IsTheReferencesExpectationOfTheLogRatio) {
  const std::vector<float> p = {0.0f, 0.0f};
  const std::vector<float> q = {static_cast<float>(std::log(3.0)), 0.0f};
  EXPECT_NEAR(KlDivergence(p, q), 0.5 * std::log(4.0 / 3.0), 1e-7);
  EXPECT_NEAR(KlDivergence(q, p), 0.75 * std::log(1.5) - 0.25 * std::log(2.0), 1e-7);
}

TEST(KlDivergenceTest, LargeLogitsDoNotOverflow) {
  const std::vector<float> p = {1000.0f, 0.0f, -1000.0f};
  const std::vector<float> q = {1000.0f, 999.0f, -1000.0f};
  const double kl = KlDivergence(p, q);
  EXPECT_TRUE(std::isfinite(kl));
  // p puts all its mass on token 0, where q has 1 / (1 + e^-1).
  EXPECT_NEAR(kl, std::log(1.0 + std::exp(-1.0)), 1e-6);
}

TEST(ArgMaxTest, TakesTheLowestIndexOfATie) {
  EXPECT_EQ(ArgMax(std::vector<float>{1.0f, 3.0f, 3.0f}), 1);
  EXPECT_EQ(ArgMax(std::vector<float>{-5.0f}), 0);
  EXPECT_EQ(ArgMax(std::vector<float>{-5.0f, -4.0f}), 1);
}

// One position's figures: p = (1/2, 1/2) against q = (3/4, 1/4) (test logits (ln 3, 0)).
TEST(ComparePositionTest, GivesThePositionsKlErrorAndTop1) {
  const std::vector<float> flat = {0.0f, 0.0f}, skewed = {static_cast<float>(std::log(3.0)), 0.0f};
  const PositionAgreement p = ComparePosition(flat, skewed);
  EXPECT_NEAR(p.kl, 0.5 * std::log(4.0 / 3.0), 1e-7);
  EXPECT_NEAR(p.rel_error, std::log(3.0), 1e-6);  // the error's norm: the reference is 0
  EXPECT_TRUE(p.same_top1);                       // a tie at index 0 in the reference
  EXPECT_FALSE(p.unexplained_top1_difference);

  // Gap 5, largest error 4.5: a difference beyond a near-tie.
  const PositionAgreement d =
      ComparePosition(std::vector<float>{5.0f, 0.0f, 0.0f}, std::vector<float>{4.0f, 4.5f, 0.0f});
  EXPECT_FALSE(d.same_top1);
  EXPECT_TRUE(d.unexplained_top1_difference);
  EXPECT_NEAR(d.rel_error, std::sqrt(1.0 + 4.5 * 4.5) / 5.0, 1e-7);
  // Gap 0.125 within the largest error 0.125: a near-tie.
  const PositionAgreement t = ComparePosition(std::vector<float>{1.0f, 0.875f, 0.0f},
                                              std::vector<float>{0.875f, 1.0f, 0.0f});
  EXPECT_FALSE(t.same_top1);
  EXPECT_FALSE(t.unexplained_top1_difference);
}

// tandem-bench --agreement compares each position once and adds the comparison to its phase's
// summary and to the overall one: each then holds what adding the logits themselves gives.
TEST(LogitAgreementTest, OneComparisonFeedsThePhasesSummaryAndTheOverallOne) {
  const std::vector<std::vector<float>> ref = {
      {2.0f, 1.0f, 0.0f}, {5.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 1.0f}};
  const std::vector<std::vector<float>> test = {
      {2.5f, 1.0f, 0.0f}, {4.0f, 4.5f, 0.0f}, {0.0f, 0.25f, 1.0f}};
  LogitAgreement prefill, decode, all, prefill_logits, decode_logits, all_logits;
  for (size_t i = 0; i < ref.size(); ++i) {
    const PositionAgreement p = ComparePosition(ref[i], test[i]);
    (i == 0 ? prefill : decode).Add(p);
    all.Add(p);
    (i == 0 ? prefill_logits : decode_logits).Add(ref[i], test[i]);
    all_logits.Add(ref[i], test[i]);
  }
  EXPECT_EQ(prefill.positions(), 1);
  EXPECT_EQ(decode.positions(), 2);
  EXPECT_EQ(all.positions(), 3);
  EXPECT_EQ(prefill.ToJson(), prefill_logits.ToJson());
  EXPECT_EQ(decode.ToJson(), decode_logits.ToJson());
  EXPECT_EQ(all.ToJson(), all_logits.ToJson());
  EXPECT_EQ(all.unexplained_top1_differences(), 1);
  EXPECT_NEAR(all.top1_agreement(), 2.0 / 3.0, 1e-12);
}

TEST(LogitAgreementTest, CountsAgreementAndTellsNearTiesApart) {
  LogitAgreement a;
  a.Add(std::vector<float>{2.0f, 1.0f, 0.0f}, std::vector<float>{2.1f, 1.0f, 0.0f});  // same top-1
  // Top-1 differs by a near-tie: the reference's gap (0.1) is within the largest error (0.1).
  a.Add(std::vector<float>{1.0f, 0.875f, 0.0f}, std::vector<float>{0.875f, 1.0f, 0.0f});
  // Top-1 differs beyond one: gap 5, largest error 4.5.
  a.Add(std::vector<float>{5.0f, 0.0f, 0.0f}, std::vector<float>{4.0f, 4.5f, 0.0f});
  EXPECT_EQ(a.positions(), 3);
  EXPECT_NEAR(a.top1_agreement(), 1.0 / 3.0, 1e-12);
  EXPECT_EQ(a.unexplained_top1_differences(), 1);
}

TEST(LogitAgreementTest, SummarisesKlAndRelativeError) {
  LogitAgreement a;
  const std::vector<float> flat = {0.0f, 0.0f};
  for (int i = 0; i < 3; ++i) a.Add(flat, flat);
  a.Add(flat, std::vector<float>{static_cast<float>(std::log(3.0)), 0.0f});
  const double kl = 0.5 * std::log(4.0 / 3.0);
  EXPECT_NEAR(a.mean_kl(), kl / 4, 1e-7);
  EXPECT_EQ(a.kl_quantile(0.5), 0.0);
  EXPECT_NEAR(a.kl_quantile(0.99), kl, 1e-7);
  EXPECT_NEAR(a.kl_quantile(1.0), kl, 1e-7);
  EXPECT_EQ(a.kl_quantile(0.0), 0.0);

  LogitAgreement r;
  r.Add(std::vector<float>{3.0f, 4.0f}, std::vector<float>{3.0f, 4.5f});  // |0.5| / |(3, 4)|
  r.Add(std::vector<float>{3.0f, 4.0f}, std::vector<float>{3.0f, 4.0f});
  EXPECT_NEAR(r.max_rel_error(), 0.1, 1e-7);
  EXPECT_NEAR(r.mean_rel_error(), 0.05, 1e-7);
  EXPECT_THAT(r.Summary(), HasSubstr("2 positions"));
  EXPECT_THAT(r.Summary(), HasSubstr("top-1 agreement 100.00%"));
}

TEST(LogitAgreementTest, JsonHoldsTheSummarysFigures) {
  LogitAgreement a;
  a.Add(std::vector<float>{0.0f, 0.0f},
        std::vector<float>{static_cast<float>(std::log(3.0)), 0.0f});
  a.Add(std::vector<float>{5.0f, 0.0f, 0.0f}, std::vector<float>{4.0f, 4.5f, 0.0f});
  const nlohmann::json j = a.ToJson();
  EXPECT_EQ(j["positions"], 2);
  EXPECT_NEAR(j["kl_max"].get<double>(), a.kl_quantile(1.0), 1e-12);
  EXPECT_NEAR(j["kl_mean"].get<double>(), a.mean_kl(), 1e-12);
  EXPECT_DOUBLE_EQ(j["top1_agreement"].get<double>(), 0.5);  // the first ties: index 0 both
  EXPECT_EQ(j["unexplained_top1_differences"], 1);
  EXPECT_DOUBLE_EQ(j["rel_error_max"].get<double>(), a.max_rel_error());
}

TEST(LogitAgreementTest, EmptyIsAllZero) {
  const LogitAgreement a;
  EXPECT_EQ(a.positions(), 0);
  EXPECT_EQ(a.mean_kl(), 0.0);
  EXPECT_EQ(a.kl_quantile(0.5), 0.0);
  EXPECT_EQ(a.top1_agreement(), 0.0);
}

}  // namespace
}  // namespace tandem
