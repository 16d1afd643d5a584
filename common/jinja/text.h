// Python's str operations over UTF-8 text: Python counts, slices and classifies code points, so
// these decode to UTF-32 where positions matter. Case mapping comes from ICU.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::jinja {

std::u32string Decode(std::string_view utf8);
std::string Encode(std::u32string_view text);

// Python's str.isspace() for one code point.
bool IsSpace(char32_t c);

// Bytes of Python whitespace at the start / end of `s`.
size_t LeadingSpaceBytes(std::string_view s);
size_t TrailingSpaceBytes(std::string_view s);

enum class StripSide { kBoth, kLeft, kRight };
// str.strip/lstrip/rstrip: `chars` unset strips whitespace.
std::string Strip(std::string_view s, const std::optional<std::string>& chars, StripSide side);
// str.split(sep, maxsplit) / str.rsplit: `sep` unset splits on runs of whitespace.
std::vector<std::string> Split(std::string_view s, const std::optional<std::string>& sep,
                               int maxsplit, bool from_right);
// str.splitlines() (without keepends).
std::vector<std::string> SplitLines(std::string_view s);
std::string Replace(std::string_view s, std::string_view from, std::string_view to, int count);

std::string Upper(std::string_view s);
std::string Lower(std::string_view s);
// Python's str.title(): a cased letter after an uncased character starts a word.
std::string PythonTitle(std::string_view s);
// Python's str.capitalize(): first code point upper (title) case, the rest lower.
std::string Capitalize(std::string_view s);

// Python's repr of a str: quotes chosen as Python does, escapes for non-printable code points.
std::string StringRepr(std::string_view s);

}  // namespace tandem::jinja
