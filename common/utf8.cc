// UTF-8 by Unicode's Table 3-7 (well-formed byte sequences): decoding, encoding, repair with
// U+FFFD by maximal ill-formed subparts, counting, whole-character prefixes, the error for a
// field that is not UTF-8.
#include "common/utf8.h"

#include "absl/strings/str_format.h"

namespace tandem {

std::pair<char32_t, int> DecodeUtf8(std::string_view s) {
  const auto b0 = static_cast<uint8_t>(s[0]);
  if (b0 < 0x80) return {b0, 1};
  int len;
  char32_t cp;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
    cp = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;  // overlong
    if (b0 == 0xED) hi = 0x9F;  // surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;  // overlong
    if (b0 == 0xF4) hi = 0x8F;  // beyond U+10FFFF
  } else {
    return {kInvalidCodePoint, 1};
  }
  for (int i = 1; i < len; ++i) {
    // A truncated or broken sequence: the bytes so far form one maximal ill-formed subpart.
    if (static_cast<size_t>(i) >= s.size()) return {kInvalidCodePoint, i};
    const auto b = static_cast<uint8_t>(s[i]);
    if (i == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return {kInvalidCodePoint, i};
    cp = (cp << 6) | (b & 0x3F);
  }
  return {cp, len};
}

void AppendUtf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t FirstInvalidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto [cp, len] = DecodeUtf8(s.substr(i));
    if (cp == kInvalidCodePoint) return i;
    i += len;
  }
  return s.size();
}

bool IsValidUtf8(std::string_view s) { return FirstInvalidUtf8(s) == s.size(); }

absl::Status CheckUtf8(std::string_view field, std::string_view text) {
  const size_t bad = FirstInvalidUtf8(text);
  if (bad == text.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s: not valid UTF-8: byte %d (0x%02X) does not begin a well-formed character", field, bad,
      static_cast<unsigned char>(text[bad])));
}

std::string ToValidUtf8(std::string_view s) {
  if (IsValidUtf8(s)) return std::string(s);
  std::string out;
  out.reserve(s.size() + 8);
  for (size_t i = 0; i < s.size();) {
    const auto [cp, len] = DecodeUtf8(s.substr(i));
    if (cp == kInvalidCodePoint) {
      AppendUtf8(kReplacementCharacter, out);
    } else {
      out.append(s.substr(i, len));
    }
    i += len;
  }
  return out;
}

size_t CountCodePoints(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

size_t CompleteUtf8Prefix(std::string_view text) {
  const size_t n = text.size();
  size_t i = n;
  int back = 0;
  while (i > 0 && back < 4) {
    const unsigned char c = static_cast<unsigned char>(text[i - 1]);
    if ((c & 0xC0) != 0x80) {
      const int len = (c & 0x80) == 0 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 :
                      (c & 0xF8) == 0xF0 ? 4 : 1;
      return (n - (i - 1) >= static_cast<size_t>(len)) ? n : i - 1;
    }
    --i;
    ++back;
  }
  return n;
}

}  // namespace tandem
