#include "common/dtype.h"

#include <cmath>
#include <limits>

#include <gtest/gtest.h>

namespace tandem {
namespace {

TEST(DTypeTest, HalfRoundTripsEveryFiniteHalfExactly) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    if ((bits & 0x7c00) == 0x7c00) continue;  // inf / NaN
    EXPECT_EQ(FloatToHalf(HalfToFloat(bits)), bits) << std::hex << h;
  }
}

TEST(DTypeTest, HalfKnownValues) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);             // rounds to infinity
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001); // smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000); // halfway: to even (zero)
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // halfway: to even
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
}

TEST(DTypeTest, BF16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBF16(1.0f), 0x3f80);
  EXPECT_EQ(BF16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(FloatToBF16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // halfway: to even
  EXPECT_EQ(FloatToBF16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // halfway: to even (up)
  EXPECT_TRUE(std::isnan(BF16ToFloat(FloatToBF16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(DTypeTest, ParsesSafetensorsAndTorchNames) {
  EXPECT_EQ(*ParseDType("BF16"), DType::kBF16);
  EXPECT_EQ(*ParseTorchDType("float16"), DType::kF16);
  EXPECT_FALSE(ParseDType("I64").ok());
  EXPECT_NE(ParseDType("F8_E4M3").status().message().find("F8_E4M3"), std::string::npos);
}

TEST(DTypeTest, HalfDTypeFlagTakesTheTwoByteTypesAndNamesTheFlagOtherwise) {
  EXPECT_EQ(*ParseHalfDTypeFlag("f16", "--dtype"), DType::kF16);
  EXPECT_EQ(*ParseHalfDTypeFlag("float16", "--dtype"), DType::kF16);
  EXPECT_EQ(*ParseHalfDTypeFlag("bf16", "--dtype"), DType::kBF16);
  for (const char* bad : {"f32", "float32", "int8", ""}) {
    absl::StatusOr<DType> t = ParseHalfDTypeFlag(bad, "--dtype");
    ASSERT_FALSE(t.ok()) << bad;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(t.status().message(), std::string("--dtype: '") + bad + "' (expected f16 or bf16)");
  }
}

}  // namespace
}  // namespace tandem
