// StageLink frames: what the sending stage encodes decodes to the same activations, and a frame
// whose sizes do not add up is refused with a message naming the step, never trusted.
#include "worker/transport/activation_frame.h"

#include <cstring>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

Activations HostRows(int64_t rows, int64_t cols, std::vector<float>& values) {
  Activations a;
  a.rows = rows;
  a.cols = cols;
  a.data = std::shared_ptr<void>(values.data(), [](void*) {});
  return a;
}

TEST(ActivationFrameTest, EncodedActivationsDecodeToTheSameRows) {
  std::vector<float> values = {1, 2, 3, 4, 5, 6};
  const v1::ActivationsMessage msg = EncodeActivations(4, 9, HostRows(2, 3, values));
  EXPECT_EQ(msg.assignment_id(), 4u);
  EXPECT_EQ(msg.step_id(), 9u);
  absl::StatusOr<Activations> a = DecodeActivations(msg);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->rows, 2);
  EXPECT_EQ(a->cols, 3);
  EXPECT_EQ(a->dtype, DType::kF32);
  EXPECT_EQ(std::memcmp(a->data.get(), values.data(), 6 * sizeof(float)), 0);
}

TEST(ActivationFrameTest, HalfPrecisionFramesKeepTheirDtype) {
  v1::ActivationsMessage msg;
  msg.set_rows(1);
  msg.set_cols(2);
  msg.set_dtype("BF16");
  msg.set_data(std::string("\x80\x3f\x00\x40", 4));
  absl::StatusOr<Activations> a = DecodeActivations(msg);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->dtype, DType::kBF16);
  EXPECT_EQ(a->nbytes(), 4u);
}

void ExpectRefused(const v1::ActivationsMessage& msg, const std::string& why) {
  absl::StatusOr<Activations> a = DecodeActivations(msg);
  ASSERT_FALSE(a.ok()) << why;
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << why;
  EXPECT_THAT(a.status().message(), HasSubstr("step 5")) << why;
}

TEST(ActivationFrameTest, FramesWhoseBytesDoNotMatchTheirShapeAreRefused) {
  v1::ActivationsMessage msg;
  msg.set_step_id(5);
  msg.set_rows(2);
  msg.set_cols(2);
  msg.set_data(std::string(15, '\0'));
  ExpectRefused(msg, "a byte short");
  msg.set_rows(-2);
  msg.set_cols(-2);
  msg.set_data(std::string(16, '\0'));
  ExpectRefused(msg, "negative rows and cols");
  msg.set_rows(4);
  msg.set_cols(0);
  msg.set_data("");
  ExpectRefused(msg, "no columns");
  msg.set_rows(1);
  msg.set_cols(4);
  msg.set_dtype("F8_E4M3");
  msg.set_data(std::string(4, '\0'));
  ExpectRefused(msg, "an unknown dtype");
}

// rows x cols x 4 wraps to 0 in 64 bits: an empty frame must not pass for 2^62 rows (the stage
// would read 2^64 bytes from an empty buffer).
TEST(ActivationFrameTest, SizesWhoseProductOverflowsAreRefused) {
  v1::ActivationsMessage msg;
  msg.set_step_id(5);
  msg.set_rows(int64_t{1} << 62);
  msg.set_cols(4);
  ExpectRefused(msg, "2^62 x 4 rows");
  msg.set_rows(int64_t{1} << 31);
  msg.set_cols(int64_t{1} << 31);
  ExpectRefused(msg, "2^31 x 2^31 x 4 bytes");
}

}  // namespace
}  // namespace tandem
