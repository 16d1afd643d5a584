// The agreement rule of the sweep's correctness check: identical outputs agree; an output that
// first differs where the reference's top-2 gap is below the tolerance is a near-tie with that gap
// reported; at a clear gap, where the reference has no gap, or where one output ends early, it
// fails; a reference that names no token cannot be checked.
#include "loadgen/greedy_agreement.h"

#include <cmath>

#include "gtest/gtest.h"

namespace tandem::loadgen {
namespace {

const double kNan = std::nan("");

GreedyOutput Reference() {
  // Gaps: clear at 0 and 1, a near-tie (one fp16 ulp at |logit| 4) at 2, clear at 3.
  return {.tokens = {"11", "12", "13", "14"}, .top2_gaps = {0.8, 0.5, 0.0039, 1.2}};
}

TEST(GreedyAgreementTest, IdenticalOutputsAgree) {
  const Verdict v = JudgeGreedy(Reference(), {"11", "12", "13", "14"}, kDefaultTieTolerance);
  EXPECT_EQ(v.agreement, Agreement::kIdentical);
  EXPECT_EQ(v.position, -1);
  EXPECT_TRUE(Agrees(v));
}

TEST(GreedyAgreementTest, AFirstDifferenceAtANearTieAgreesAndReportsTheGap) {
  // After the near-tie the outputs go their own ways: only the first difference is judged.
  const Verdict v = JudgeGreedy(Reference(), {"11", "12", "99", "98"}, kDefaultTieTolerance);
  EXPECT_EQ(v.agreement, Agreement::kNearTie);
  EXPECT_TRUE(Agrees(v));
  EXPECT_EQ(v.position, 2);
  EXPECT_DOUBLE_EQ(v.gap, 0.0039);
  EXPECT_EQ(v.reference_token, "13");
  EXPECT_EQ(v.token, "99");
}

TEST(GreedyAgreementTest, AFirstDifferenceAtAClearGapFails) {
  const Verdict v = JudgeGreedy(Reference(), {"11", "77", "13", "14"}, kDefaultTieTolerance);
  EXPECT_EQ(v.agreement, Agreement::kDiffers);
  EXPECT_FALSE(Agrees(v));
  EXPECT_EQ(v.position, 1);
  EXPECT_DOUBLE_EQ(v.gap, 0.5);
  EXPECT_EQ(v.reference_token, "12");
  EXPECT_EQ(v.token, "77");
}

TEST(GreedyAgreementTest, AGapJustAtTheToleranceIsClear) {
  GreedyOutput ref = Reference();
  ref.top2_gaps[2] = kDefaultTieTolerance;
  EXPECT_EQ(JudgeGreedy(ref, {"11", "12", "99", "14"}, kDefaultTieTolerance).agreement,
            Agreement::kDiffers);
}

TEST(GreedyAgreementTest, ToleranceZeroAsksForIdenticalOutputsEvenAtAnExactTie) {
  GreedyOutput ref = Reference();
  ref.top2_gaps[2] = 0;
  EXPECT_EQ(JudgeGreedy(ref, {"11", "12", "99", "14"}, 0).agreement, Agreement::kDiffers);
}

TEST(GreedyAgreementTest, ADifferenceWhereTheReferenceHasNoGapFails) {
  GreedyOutput ref = Reference();
  ref.top2_gaps[2] = kNan;  // the server gave fewer than two logprobs there
  Verdict v = JudgeGreedy(ref, {"11", "12", "99", "14"}, kDefaultTieTolerance);
  EXPECT_EQ(v.agreement, Agreement::kNoGap);
  EXPECT_FALSE(Agrees(v));
  EXPECT_TRUE(std::isnan(v.gap));
  ref.top2_gaps.clear();  // no logprobs at all
  v = JudgeGreedy(ref, {"11", "12", "99", "14"}, kDefaultTieTolerance);
  EXPECT_EQ(v.agreement, Agreement::kNoGap);
  EXPECT_EQ(v.position, 2);
}

TEST(GreedyAgreementTest, AnOutputThatEndsEarlyOrGoesOnFails) {
  Verdict v = JudgeGreedy(Reference(), {"11", "12"}, kDefaultTieTolerance);
  EXPECT_EQ(v.agreement, Agreement::kDiffers);
  EXPECT_EQ(v.position, 2);
  EXPECT_EQ(v.token, "");
  v = JudgeGreedy(Reference(), {"11", "12", "13", "14", "15"}, kDefaultTieTolerance);
  EXPECT_EQ(v.agreement, Agreement::kDiffers);
  EXPECT_EQ(v.position, 4);
}

TEST(GreedyAgreementTest, AReferenceThatNamesNoTokenIsUnchecked) {
  // Text over the OpenAI API of a model without a tokenizer: every token is "".
  const GreedyOutput ref{.tokens = {"", "", ""}, .top2_gaps = {1, 1, 1}};
  const Verdict v = JudgeGreedy(ref, {"", "", ""}, kDefaultTieTolerance);
  EXPECT_EQ(v.agreement, Agreement::kUnchecked);
  EXPECT_FALSE(Agrees(v));
}

TEST(GreedyAgreementTest, ADifferenceSeenAfterATokenWithoutTextIsUnchecked) {
  // Over the OpenAI API: token 1 has no text, so the outputs may have parted there unseen, and the
  // clear gap where the text first differs says nothing.
  GreedyOutput ref{.tokens = {"a", "", "c", "d"},
                   .top2_gaps = {0.8, 0.001, 0.9, 1.2},
                   .unnamed = {false, true, false, false}};
  Verdict v = JudgeGreedy(ref, {"a", "", "x", "y"}, kDefaultTieTolerance);
  EXPECT_EQ(v.agreement, Agreement::kUnchecked);
  EXPECT_EQ(v.position, 2);
  EXPECT_FALSE(Agrees(v));
  // A difference before any token without text is judged as usual.
  v = JudgeGreedy(ref, {"z", "", "c", "d"}, kDefaultTieTolerance);
  EXPECT_EQ(v.agreement, Agreement::kDiffers);
  EXPECT_EQ(v.position, 0);
}

}  // namespace
}  // namespace tandem::loadgen
