// ActivationInbox (worker/transport/grpc_transport.cc): bounded in steps and bytes, earlier steps
// dropped once a later one is taken, a full inbox holding the sender back and then refusing it.
#include "worker/transport/grpc_transport.h"

#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

// `floats` fp32 values of one row.
Activations Rows(int floats) {
  auto buf = std::make_shared<std::vector<float>>(floats, 1.0f);
  Activations a;
  a.rows = 1;
  a.cols = floats;
  a.dtype = DType::kF32;
  a.where = Where::kHost;
  a.data = std::shared_ptr<void>(buf, buf->data());
  return a;
}

auto Never() {
  return [] { return false; };
}

TEST(ActivationInboxTest, AFullInboxRefusesAfterItsTimeoutNamingTheLimits) {
  ActivationInbox inbox({.entries = 3, .bytes = 1 << 20, .put_timeout = absl::Milliseconds(50)});
  inbox.Reset(1);
  for (uint64_t step = 10; step < 13; ++step) ASSERT_TRUE(inbox.Put(1, step, Rows(4)).ok());
  const absl::Status full = inbox.Put(1, 13, Rows(4));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("3 steps, 48 bytes held; limits 3 steps, 1048576 bytes"));
  EXPECT_EQ(inbox.entries(), 3u);
}

TEST(ActivationInboxTest, BytesAreBoundedButAnEmptyInboxTakesOneMessage) {
  ActivationInbox inbox({.entries = 8, .bytes = 100, .put_timeout = absl::Milliseconds(50)});
  inbox.Reset(1);
  ASSERT_TRUE(inbox.Put(1, 1, Rows(64)).ok());  // 256 bytes, alone
  EXPECT_EQ(inbox.bytes(), 256);
  EXPECT_EQ(inbox.Put(1, 2, Rows(1)).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(inbox.Take(1, 1, absl::Seconds(1), Never()).ok());
  EXPECT_EQ(inbox.bytes(), 0);
  EXPECT_TRUE(inbox.Put(1, 2, Rows(1)).ok());
}

// Steps run in order of their ids: taking step 5 drops 3 and 4 (they will not run here), and a
// late message for them is dropped on arrival.
TEST(ActivationInboxTest, TakingAStepDropsEarlierStepsForGood) {
  ActivationInbox inbox;
  inbox.Reset(1);
  for (uint64_t step : {3, 4, 5, 6}) ASSERT_TRUE(inbox.Put(1, step, Rows(2)).ok());
  ASSERT_TRUE(inbox.Take(1, 5, absl::Seconds(1), Never()).ok());
  EXPECT_EQ(inbox.entries(), 1u);  // step 6
  EXPECT_EQ(inbox.bytes(), 8);
  ASSERT_TRUE(inbox.Put(1, 4, Rows(2)).ok());
  EXPECT_EQ(inbox.entries(), 1u);
  EXPECT_EQ(inbox.Take(1, 4, absl::Milliseconds(30), Never()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  // Another assignment's messages are dropped; a new assignment starts empty.
  ASSERT_TRUE(inbox.Put(2, 7, Rows(2)).ok());
  EXPECT_EQ(inbox.entries(), 1u);
  inbox.Reset(2);
  EXPECT_EQ(inbox.entries(), 0u);
  EXPECT_EQ(inbox.bytes(), 0);
}

// A Put that finds the inbox full waits until the step loop takes a step.
TEST(ActivationInboxTest, AFullInboxHoldsThePutUntilAStepIsTaken) {
  ActivationInbox inbox({.entries = 2, .bytes = 1 << 20, .put_timeout = absl::Seconds(120)});
  inbox.Reset(1);
  ASSERT_TRUE(inbox.Put(1, 1, Rows(2)).ok());
  ASSERT_TRUE(inbox.Put(1, 2, Rows(2)).ok());
  absl::Status third;
  std::thread sender([&] { third = inbox.Put(1, 3, Rows(2)); });
  ASSERT_TRUE(inbox.Take(1, 1, absl::Seconds(120), Never()).ok());
  sender.join();
  EXPECT_TRUE(third.ok()) << third;
  EXPECT_TRUE(inbox.Take(1, 3, absl::Seconds(120), Never()).ok());
}

}  // namespace
}  // namespace tandem
