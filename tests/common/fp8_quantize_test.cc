// QuantizeE4M3: scales per block, saturation, the round-trip error bound, refusal of NaN and
// infinity naming the tensor. The KV-cache's rule (EncodeKvE4M3, DecodeKvE4M3): ties to even,
// saturation, subnormals and NaN through a layer's scale, and the rows as the scalars.
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

// The scale divides before rounding and multiplies after: at a scale of 1/4 (exact in binary) the
// grid is E4M3's, a quarter as wide.
TEST(KvE4M3Test, RoundsThroughTheScaleToNearestEven) {
  constexpr float s = 0.25f;
  EXPECT_EQ(EncodeKvE4M3(1.0f * s, s), 0x38);
  EXPECT_EQ(DecodeKvE4M3(0x38, s), 0.25f);
  EXPECT_EQ(EncodeKvE4M3(1.0625f * s, s), 0x38);  // halfway between 1 and 1.125: to even (1)
  EXPECT_EQ(EncodeKvE4M3(1.1875f * s, s), 0x3a);  // halfway between 1.125 and 1.25: to even
  EXPECT_EQ(EncodeKvE4M3(1.07f * s, s), 0x39);    // nearer 1.125
  EXPECT_EQ(DecodeKvE4M3(0x39, s), 1.125f * s);
  EXPECT_EQ(EncodeKvE4M3(-1.0f * s, s), 0xb8);
  EXPECT_EQ(DecodeKvE4M3(0xb8, s), -0.25f);
}

TEST(KvE4M3Test, SaturatesAt448TimesTheScale) {
  constexpr float s = 0.25f;
  EXPECT_EQ(EncodeKvE4M3(448.0f * s, s), 0x7e);
  EXPECT_EQ(EncodeKvE4M3(449.0f * s, s), 0x7e);  // not NaN
  EXPECT_EQ(EncodeKvE4M3(1e30f, s), 0x7e);
  EXPECT_EQ(EncodeKvE4M3(-1e30f, s), 0xfe);
  EXPECT_EQ(EncodeKvE4M3(std::numeric_limits<float>::infinity(), s), 0x7e);
  EXPECT_EQ(DecodeKvE4M3(0x7e, s), 112.0f);
  EXPECT_EQ(DecodeKvE4M3(0xfe, s), -112.0f);
}

TEST(KvE4M3Test, SubnormalsKeepTheirStepOfTwoToTheMinusNine) {
  constexpr float s = 0.25f;
  const float step = std::ldexp(1.0f, -9) * s;  // the smallest subnormal, scaled
  EXPECT_EQ(EncodeKvE4M3(step, s), 0x01);
  EXPECT_EQ(DecodeKvE4M3(0x01, s), step);
  EXPECT_EQ(EncodeKvE4M3(1.5f * step, s), 0x02);   // 1.5 steps: to even (2)
  EXPECT_EQ(EncodeKvE4M3(2.5f * step, s), 0x02);   // 2.5 steps: to even (2)
  EXPECT_EQ(EncodeKvE4M3(0.5f * step, s), 0x00);   // half a step: to even (0)
  EXPECT_EQ(EncodeKvE4M3(-0.4f * step, s), 0x80);  // -0 keeps its sign
  EXPECT_EQ(DecodeKvE4M3(0x80, s), 0.0f);
  EXPECT_EQ(EncodeKvE4M3(7.0f * step, s), 0x07);               // the largest subnormal
  EXPECT_EQ(EncodeKvE4M3(std::ldexp(1.0f, -6) * s, s), 0x08);  // the smallest normal
}

TEST(KvE4M3Test, NanStaysNan) {
  EXPECT_EQ(EncodeKvE4M3(std::numeric_limits<float>::quiet_NaN(), 0.5f) & 0x7f, 0x7f);
  EXPECT_TRUE(std::isnan(DecodeKvE4M3(0x7f, 0.5f)));
  EXPECT_TRUE(std::isnan(DecodeKvE4M3(0xff, 0.5f)));
}

// At a scale that is not a power of two, every code's value encodes back to the code, and the
// functions over rows give what the scalar ones give, code for code.
TEST(KvE4M3Test, EveryCodeRoundTripsAndRowsAgreeWithScalars) {
  constexpr float s = 0.037f;
  std::vector<uint8_t> codes(256);
  for (int b = 0; b < 256; ++b) codes[b] = static_cast<uint8_t>(b);
  std::vector<float> values(256);
  DecodeKvE4M3(codes.data(), codes.size(), s, values.data());
  std::vector<uint8_t> again(256);
  EncodeKvE4M3(values.data(), values.size(), s, again.data());
  for (int b = 0; b < 256; ++b) {
    const float v = DecodeKvE4M3(codes[b], s);
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(values[b])) << b;
      continue;
    }
    EXPECT_EQ(values[b], v) << b;
    EXPECT_EQ(again[b], EncodeKvE4M3(values[b], s)) << b;
    EXPECT_EQ(again[b], b == 0x80 ? 0x80 : b) << b << " " << v;
  }
}

}  // namespace
}  // namespace tandem
