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

// vLLM's --kv-cache-dtype spellings: auto (or nothing) and fp8 = fp8_e4m3; anything else is
// refused naming the setting, the value and what it takes.
TEST(DTypeTest, KvCacheDTypeTakesAutoAndFp8AndNamesTheValueOtherwise) {
  EXPECT_EQ(*ParseKvCacheDType("auto", "--kv_cache_dtype"), KvCacheDType::kAuto);
  EXPECT_EQ(*ParseKvCacheDType("", "--kv_cache_dtype"), KvCacheDType::kAuto);
  EXPECT_EQ(*ParseKvCacheDType("fp8", "--kv_cache_dtype"), KvCacheDType::kFp8E4M3);
  EXPECT_EQ(*ParseKvCacheDType("fp8_e4m3", "--kv_cache_dtype"), KvCacheDType::kFp8E4M3);
  EXPECT_EQ(KvCacheDTypeName(KvCacheDType::kAuto), "auto");
  EXPECT_EQ(KvCacheDTypeName(KvCacheDType::kFp8E4M3), "fp8_e4m3");
  for (const char* bad : {"bogus", "fp8_e5m2", "FP8", "f16"}) {
    absl::StatusOr<KvCacheDType> t = ParseKvCacheDType(bad, "--kv_cache_dtype");
    ASSERT_FALSE(t.ok()) << bad;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(t.status().message(), std::string("--kv_cache_dtype: '") + bad +
                                        "' is not a KV-cache dtype (expected auto, fp8 or "
                                        "fp8_e4m3)");
  }
}

// Every E4M3FN code but the NaNs decodes to a value that encodes back to the same code; the grid
// ends at 448 (0x7e) and has no infinities.
TEST(DTypeTest, E4M3CodesRoundTripAndDecodeToTheirGrid) {
  for (int b = 0; b < 256; ++b) {
    const float v = E4M3ToFloat(static_cast<uint8_t>(b));
    if ((b & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << b;
      continue;
    }
    EXPECT_EQ(FloatToE4M3(v), b == 0x80 ? 0x80 : b) << b << " " << v;
  }
  EXPECT_EQ(E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4M3ToFloat(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(E4M3ToFloat(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(E4M3ToFloat(0x38), 1.0f);
  EXPECT_EQ(E4M3ToFloat(0xb8), -1.0f);
}

TEST(DTypeTest, E4M3RoundsToNearestEvenAndSaturatesAt448) {
  EXPECT_EQ(FloatToE4M3(1.0625f), 0x38);   // halfway between 1 and 1.125: to even (1)
  EXPECT_EQ(FloatToE4M3(1.1875f), 0x3a);   // halfway between 1.125 and 1.25: to even (1.25)
  EXPECT_EQ(FloatToE4M3(1.07f), 0x39);     // nearer 1.125
  EXPECT_EQ(FloatToE4M3(15.9f), 0x58);     // carries into the next binade: 16
  EXPECT_EQ(FloatToE4M3(449.0f), 0x7e);    // beyond the largest value: 448, not NaN
  EXPECT_EQ(FloatToE4M3(1e9f), 0x7e);
  EXPECT_EQ(FloatToE4M3(-1e9f), 0xfe);
  EXPECT_EQ(FloatToE4M3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(FloatToE4M3(std::ldexp(1.0f, -11)), 0x00);        // below half the smallest step
  EXPECT_EQ(FloatToE4M3(3 * std::ldexp(1.0f, -10)), 0x02);    // 1.5 steps: to even (2)
  EXPECT_EQ(FloatToE4M3(std::numeric_limits<float>::quiet_NaN()) & 0x7f, 0x7f);
}

}  // namespace
}  // namespace tandem
