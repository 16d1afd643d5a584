#include "coordinator/request_state.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::ElementsAre;

const absl::Time kT = absl::UnixEpoch() + absl::Seconds(5);

TEST(RequestState, AppendLastShowsTheTokenAndTheEndTogether) {
  RequestState r(ValidatedRequest{}, kT);
  r.Append(4, kT);
  TokenLogprob lp{.token = 9, .logprob = -0.5f, .top = {}};
  r.AppendLast(9, kT + absl::Seconds(1), &lp, FinishReason::kStop, 3);
  RequestState::Snapshot snap;
  r.WaitMore(snap, absl::InfinitePast());
  EXPECT_THAT(snap.tokens, ElementsAre(4, 9));
  ASSERT_EQ(snap.logprobs.size(), 1u);
  EXPECT_EQ(snap.logprobs[0].token, 9);
  EXPECT_TRUE(snap.done);
  EXPECT_TRUE(snap.status.ok());
  EXPECT_EQ(snap.finish, v1::FINISH_REASON_STOP);
  EXPECT_EQ(snap.text_limit, 3);
  EXPECT_EQ(snap.first_token, kT);
  EXPECT_EQ(snap.finished, kT + absl::Seconds(1));
}

TEST(RequestState, WaitMoreAddsOnlyWhatTheFollowersSnapshotLacks) {
  ValidatedRequest req;
  req.logprobs = 0;
  RequestState r(std::move(req), kT);
  RequestState::Snapshot s;
  EXPECT_FALSE(r.WaitMore(s, absl::InfinitePast()));  // nothing yet
  EXPECT_TRUE(s.tokens.empty());
  TokenLogprob a{.token = 4, .logprob = -0.25f, .top = {}}, b{.token = 5, .logprob = -1.0f, .top = {}};
  r.Append(4, kT, &a);
  r.Append(5, kT + absl::Seconds(1), &b);
  EXPECT_TRUE(r.WaitMore(s, absl::InfinitePast()));
  EXPECT_THAT(s.tokens, ElementsAre(4, 5));
  ASSERT_EQ(s.logprobs.size(), 2u);
  EXPECT_EQ(s.logprobs[1].token, 5);
  EXPECT_EQ(s.first_token, kT);
  EXPECT_FALSE(r.WaitMore(s, absl::InfinitePast()));  // nothing new: nothing added twice
  EXPECT_THAT(s.tokens, ElementsAre(4, 5));
  EXPECT_EQ(s.logprobs.size(), 2u);
  TokenLogprob c{.token = 6, .logprob = -2.0f, .top = {}};
  r.AppendLast(6, kT + absl::Seconds(2), &c, FinishReason::kStop, 7);
  EXPECT_TRUE(r.WaitMore(s, absl::InfinitePast()));
  EXPECT_THAT(s.tokens, ElementsAre(4, 5, 6));
  ASSERT_EQ(s.logprobs.size(), 3u);
  EXPECT_EQ(s.logprobs[2].token, 6);
  EXPECT_TRUE(s.done);
  EXPECT_EQ(s.finish, v1::FINISH_REASON_STOP);
  EXPECT_EQ(s.text_limit, 7);
  EXPECT_EQ(s.finished, kT + absl::Seconds(2));
  EXPECT_FALSE(r.WaitMore(s, absl::InfinitePast()));  // the end comes once
}

TEST(RequestState, TheFirstEndWinsAndNothingIsAppendedAfterIt) {
  RequestState r(ValidatedRequest{}, kT);
  r.Finish(absl::CancelledError("client left"), FinishReason::kNone, -1, kT);
  r.AppendLast(7, kT, nullptr, FinishReason::kLength, -1);
  r.Append(8, kT);
  r.Finish(absl::OkStatus(), FinishReason::kEos, -1, kT);
  RequestState::Snapshot snap;
  r.WaitMore(snap, absl::InfinitePast());
  EXPECT_TRUE(snap.tokens.empty());
  EXPECT_EQ(snap.status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(snap.finish, v1::FINISH_REASON_UNSPECIFIED);
}

}  // namespace
}  // namespace tandem
