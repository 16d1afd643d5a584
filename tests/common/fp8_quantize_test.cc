// QuantizeE4M3: scales per block, saturation, the round-trip error bound, refusal of NaN and
// infinity naming the tensor.
#include "common/fp8_quantize.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/dtype.h"

namespace tandem {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// A (rows, cols) matrix whose rows have very different magnitudes (row r scaled by 4^r), with
// values spread over several binades within each row.
std::vector<float> Matrix(int rows, int cols) {
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      const float u = std::sin(0.7f * static_cast<float>(r * cols + c) + 0.3f);
      w[r * cols + c] = std::ldexp(u * u * u, 2 * r);
    }
  }
  return w;
}

TEST(Fp8QuantizeTest, PerRowScaleIsTheRowAbsMaxOver448AndTheMaxMapsTo448) {
  const int rows = 4, cols = 37;
  const std::vector<float> w = Matrix(rows, cols);
  std::vector<uint8_t> codes(w.size());
  std::vector<float> scales(rows);
  ASSERT_TRUE(QuantizeE4M3(w.data(), rows, cols, 1, cols, "m", codes.data(), scales.data()).ok());
  for (int r = 0; r < rows; ++r) {
    float amax = 0.0f;
    int at = 0;
    for (int c = 0; c < cols; ++c) {
      if (std::fabs(w[r * cols + c]) > amax) amax = std::fabs(w[r * cols + c]), at = c;
    }
    EXPECT_FLOAT_EQ(scales[r], amax / 448.0f) << "row " << r;
    EXPECT_EQ(codes[r * cols + at] & 0x7f, 0x7e) << "row " << r;  // +-448
  }
}

// The bound of E4M3 rounding with 3 mantissa bits: half a step, 2^-4 of the value in the normal
// range, and 2^-10 of the scale among the subnormals (|w / scale| < 2^-6).
TEST(Fp8QuantizeTest, DequantizedValuesAreWithinHalfAStepOfTheWeights) {
  const int rows = 5, cols = 300;
  const std::vector<float> w = Matrix(rows, cols);
  std::vector<uint8_t> codes(w.size());
  std::vector<float> scales(rows), back(w.size());
  ASSERT_TRUE(QuantizeE4M3(w.data(), rows, cols, 1, cols, "m", codes.data(), scales.data()).ok());
  DequantizeE4M3Rows(codes.data(), scales.data(), rows, cols, back.data());
  double worst = 0.0;
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      const float x = w[r * cols + c], err = std::fabs(back[r * cols + c] - x);
      const float bound = std::max(std::fabs(x) * 0.0625f, scales[r] * std::ldexp(1.0f, -10));
      EXPECT_LE(err, bound * 1.0001f) << r << "," << c << ": " << x << " -> " << back[r * cols + c];
      worst = std::max<double>(worst, err / std::max(std::fabs(x), 1e-30f));
    }
  }
  EXPECT_GT(worst, 0.01);  // the rounding is real: some value moved by more than 1%
}

TEST(Fp8QuantizeTest, PerTensorAndBlockScalesCoverTheirBlocks) {
  const int rows = 5, cols = 7;
  const std::vector<float> w = Matrix(rows, cols);
  std::vector<uint8_t> codes(w.size());
  std::vector<float> one(1);
  ASSERT_TRUE(QuantizeE4M3(w.data(), rows, cols, rows, cols, "m", codes.data(), one.data()).ok());
  float amax = 0.0f;
  for (float x : w) amax = std::max(amax, std::fabs(x));
  EXPECT_FLOAT_EQ(one[0], amax / 448.0f);
  // Blocks of 2 x 4: 3 x 2 scales, the last row and column blocks cut short.
  std::vector<float> blocks(6);
  ASSERT_TRUE(QuantizeE4M3(w.data(), rows, cols, 2, 4, "m", codes.data(), blocks.data()).ok());
  for (int br = 0; br < 3; ++br) {
    for (int bc = 0; bc < 2; ++bc) {
      float m = 0.0f;
      for (int r = 2 * br; r < std::min(rows, 2 * br + 2); ++r) {
        for (int c = 4 * bc; c < std::min(cols, 4 * bc + 4); ++c)
          m = std::max(m, std::fabs(w[r * cols + c]));
      }
      EXPECT_FLOAT_EQ(blocks[br * 2 + bc], m / 448.0f) << br << "," << bc;
    }
  }
}

TEST(Fp8QuantizeTest, AllZeroRowGetsScaleOneAndZeroCodes) {
  const std::vector<float> w(8, 0.0f);
  std::vector<uint8_t> codes(8, 0xff);
  std::vector<float> scales(2);
  ASSERT_TRUE(QuantizeE4M3(w.data(), 2, 4, 1, 4, "m", codes.data(), scales.data()).ok());
  EXPECT_EQ(scales[0], 1.0f);
  for (uint8_t c : codes) EXPECT_EQ(c, 0);
}

TEST(Fp8QuantizeTest, NanOrInfinityIsRefusedNamingTensorRowAndColumn) {
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    std::vector<float> w(12, 0.5f);
    w[1 * 4 + 3] = bad;
    std::vector<uint8_t> codes(12);
    std::vector<float> scales(3);
    const absl::Status s = QuantizeE4M3(w.data(), 3, 4, 1, 4, "model.layers.2.mlp.up_proj.weight",
                                        codes.data(), scales.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), AllOf(HasSubstr("model.layers.2.mlp.up_proj.weight"),
                                   HasSubstr("row 1"), HasSubstr("column 3")));
  }
}

}  // namespace
}  // namespace tandem
