// Protobuf's wire format written by hand, so that a test can put any bytes in a string field
// (protobuf's serializer is not meant to be given strings that are not UTF-8).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace tandem::testing {

inline std::string Varint(uint64_t v) {
  std::string out;
  do {
    out.push_back(static_cast<char>((v & 0x7F) | (v >= 0x80 ? 0x80 : 0)));
    v >>= 7;
  } while (v != 0);
  return out;
}

// A length-delimited field (string, bytes, message, packed numbers).
inline std::string Field(int number, std::string_view value) {
  return Varint(uint64_t(number) << 3 | 2) + Varint(value.size()) + std::string(value);
}

// A varint field.
inline std::string VarintField(int number, uint64_t value) {
  return Varint(uint64_t(number) << 3) + Varint(value);
}

}  // namespace tandem::testing
