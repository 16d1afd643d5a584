// Host-side element type conversions (bit manipulation, no dependence on compiler half types).
#include "common/dtype.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace tandem {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kF8E4M3: return "F8_E4M3";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype \"", std::string(name), "\" (supported: F32, F16, BF16)"));
}

absl::StatusOr<DType> ParseHalfDTypeFlag(std::string_view name, std::string_view flag) {
  absl::StatusOr<DType> t = ParseTorchDType(name);
  if (t.ok() && *t != DType::kF32) return *t;
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(flag), ": '", std::string(name), "' (expected f16 or bf16)"));
}

absl::StatusOr<KvCacheDType> ParseKvCacheDType(std::string_view name, std::string_view what) {
  if (name.empty() || name == "auto") return KvCacheDType::kAuto;
  if (name == "fp8" || name == "fp8_e4m3") return KvCacheDType::kFp8E4M3;
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(what), ": '", std::string(name),
                   "' is not a KV-cache dtype (expected auto, fp8 or fp8_e4m3)"));
}

std::string_view KvCacheDTypeName(KvCacheDType t) {
  return t == KvCacheDType::kFp8E4M3 ? "fp8_e4m3" : "auto";
}

std::string_view TorchDTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
    case DType::kF8E4M3: return "float8_e4m3fn";
  }
  return "?";
}

absl::StatusOr<DType> ParseTorchDType(std::string_view name) {
  if (name == "float32" || name == "f32" || name == "fp32") return DType::kF32;
  if (name == "float16" || name == "f16" || name == "fp16" || name == "half") return DType::kF16;
  if (name == "bfloat16" || name == "bf16") return DType::kBF16;
  return absl::InvalidArgumentError(absl::StrCat(
      "unsupported dtype \"", std::string(name), "\" (supported: float32, float16, bfloat16)"));
}

static uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
static float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t FloatToHalf(float f) {
  const uint32_t x = Bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN (NaN keeps a quiet payload bit)
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {
    // Subnormal half (or zero): value = m * 2^-24 with m < 1024; round to nearest even.
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // below half of 2^-24
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14..24 + ... gives m in [0, 1024]
    uint32_t m = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (m & 1))) ++m;
    return static_cast<uint16_t>(sign | m);
  }
  // Normal: rebias exponent (127 -> 15), keep 10 mantissa bits, round to nearest even.
  uint32_t h = ((abs - 0x38000000u) >> 13);
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in float.
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return FromBits(sign | 0x7f800000u | (mant << 13));
  return FromBits(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t FloatToBF16(float f) {
  uint32_t x = Bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

float BF16ToFloat(uint16_t b) { return FromBits(static_cast<uint32_t>(b) << 16); }

float E4M3ToFloat(uint8_t b) {
  const uint32_t sign = b & 0x80u, exp = (b >> 3) & 0xfu, mant = b & 0x7u;
  if (exp == 0xf && mant == 0x7) return std::numeric_limits<float>::quiet_NaN();
  // Subnormal: mant * 2^-9; normal: (8 + mant) * 2^(exp - 10), both exact in float.
  const float v = exp == 0 ? std::ldexp(static_cast<float>(mant), -9)
                           : std::ldexp(static_cast<float>(8 + mant), static_cast<int>(exp) - 10);
  return sign ? -v : v;
}

uint8_t FloatToE4M3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return 0x7f;
  const float a = std::fabs(f);
  if (a >= kE4M3Max) return sign | 0x7e;  // saturate (and infinities)
  // Below 2^-6 the grid is the subnormals' uniform step 2^-9; above, 3 mantissa bits.
  int e = 0;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  const int exp = std::max(e - 1, -6);
  const float step = std::ldexp(1.0f, exp - 3);
  // Round to nearest even on the grid of `step` (exact: a / step has at most 24 bits).
  const float q = std::nearbyint(a / step);
  const float v = q * step;  // may carry into the next binade, still representable
  if (v == 0.0f) return sign;
  int ve = 0;
  std::frexp(v, &ve);
  if (ve - 1 < -6) return sign | static_cast<uint8_t>(q);  // subnormal: mant = q
  const int biased = ve - 1 + 7;
  const uint32_t mant = static_cast<uint32_t>(std::ldexp(v, -(ve - 1) + 3)) - 8u;
  return sign | static_cast<uint8_t>(biased << 3) | static_cast<uint8_t>(mant);
}

void ToFloat(DType t, const void* src, size_t n, float* dst) {
  if (n == 0) return;  // src/dst may be null for empty tensors
  const auto* p = static_cast<const unsigned char*>(src);
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = HalfToFloat(h);
      }
      return;
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = BF16ToFloat(h);
      }
      return;
    case DType::kF8E4M3:
      for (size_t i = 0; i < n; ++i) dst[i] = E4M3ToFloat(p[i]);
      return;
  }
}

void FromFloat(DType t, const float* src, size_t n, void* dst) {
  if (n == 0) return;
  auto* p = static_cast<unsigned char*>(dst);
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = FloatToHalf(src[i]);
        std::memcpy(p + 2 * i, &h, 2);
      }
      return;
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = FloatToBF16(src[i]);
        std::memcpy(p + 2 * i, &h, 2);
      }
      return;
    case DType::kF8E4M3:
      for (size_t i = 0; i < n; ++i) p[i] = FloatToE4M3(src[i]);
      return;
  }
}

}  // namespace tandem
