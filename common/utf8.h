// UTF-8 helpers every part shares (the tokenizer, the text streams of the front ends, the model
// generator): decoding one code point, appending one, finding where the last whole character
// ends, turning arbitrary bytes into well-formed UTF-8 the way Hugging Face's callers see them,
// and the one error every front end gives for a field that is not UTF-8.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"

namespace tandem {

constexpr char32_t kInvalidCodePoint = 0xFFFFFFFF;
constexpr char32_t kReplacementCharacter = 0xFFFD;

// Decodes one well-formed UTF-8 sequence (Unicode's Table 3-7) at the start of `s`, which is not
// empty. Returns the code point and its length in bytes, or kInvalidCodePoint and the length of
// the maximal ill-formed prefix (at least 1) for bytes that do not start a well-formed sequence.
std::pair<char32_t, int> DecodeUtf8(std::string_view s);

void AppendUtf8(char32_t cp, std::string& out);

// `s` with every maximal ill-formed subsequence replaced by U+FFFD (Unicode's "best practice",
// which WHATWG's TextDecoder, Node's Buffer and Rust's from_utf8_lossy follow).
std::string ToValidUtf8(std::string_view s);

// True when `s` is well-formed UTF-8.
bool IsValidUtf8(std::string_view s);

// The offset of the first byte of `s` that does not begin a well-formed sequence (the start of
// the first ill-formed subpart); s.size() when `s` is well-formed.
size_t FirstInvalidUtf8(std::string_view s);

// OK when `text` is well-formed UTF-8; otherwise INVALID_ARGUMENT naming `field` and the offset
// and value of FirstInvalidUtf8's byte: "stop[1]: not valid UTF-8: byte 3 (0xFF) does not begin
// a well-formed character".
absl::Status CheckUtf8(std::string_view field, std::string_view text);

// Number of code points of well-formed UTF-8 `s` (of other bytes: those that are not
// continuation bytes).
size_t CountCodePoints(std::string_view s);

// Bytes of `text` that end on a whole character: `text` less a trailing character that lacks
// some of its bytes (a token may end inside one).
size_t CompleteUtf8Prefix(std::string_view text);

}  // namespace tandem
