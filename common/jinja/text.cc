#include "common/jinja/text.h"

#include <unicode/locid.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/utf8.h>

#include <algorithm>

#include "absl/strings/str_format.h"

namespace tandem::jinja {

std::u32string Decode(std::string_view utf8) {
  std::u32string out;
  out.reserve(utf8.size());
  int32_t i = 0;
  const int32_t n = static_cast<int32_t>(utf8.size());
  while (i < n) {
    UChar32 c;
    U8_NEXT(reinterpret_cast<const uint8_t*>(utf8.data()), i, n, c);
    out.push_back(c < 0 ? 0xFFFD : static_cast<char32_t>(c));
  }
  return out;
}

std::string Encode(std::u32string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char32_t c : text) {
    uint8_t buf[4];
    int32_t len = 0;
    UBool error = false;
    U8_APPEND(buf, len, 4, static_cast<UChar32>(c), error);
    if (!error) out.append(reinterpret_cast<const char*>(buf), len);
  }
  return out;
}

bool IsSpace(char32_t c) {
  // Python's whitespace: bidirectional types WS, B, S plus the Zs category.
  switch (c) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x1C:
    case 0x1D:
    case 0x1E:
    case 0x1F:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

size_t LeadingSpaceBytes(std::string_view s) {
  int32_t i = 0;
  const int32_t n = static_cast<int32_t>(s.size());
  while (i < n) {
    int32_t next = i;
    UChar32 c;
    U8_NEXT(reinterpret_cast<const uint8_t*>(s.data()), next, n, c);
    if (c < 0 || !IsSpace(static_cast<char32_t>(c))) break;
    i = next;
  }
  return static_cast<size_t>(i);
}

size_t TrailingSpaceBytes(std::string_view s) {
  int32_t i = static_cast<int32_t>(s.size());
  while (i > 0) {
    int32_t prev = i;
    UChar32 c;
    U8_PREV(reinterpret_cast<const uint8_t*>(s.data()), 0, prev, c);
    if (c < 0 || !IsSpace(static_cast<char32_t>(c))) break;
    i = prev;
  }
  return s.size() - static_cast<size_t>(i);
}

std::string Strip(std::string_view s, const std::optional<std::string>& chars, StripSide side) {
  std::u32string text = Decode(s);
  std::u32string set = chars ? Decode(*chars) : std::u32string();
  auto strip_it = [&](char32_t c) {
    return chars ? set.find(c) != std::u32string::npos : IsSpace(c);
  };
  size_t begin = 0, end = text.size();
  if (side != StripSide::kRight) {
    while (begin < end && strip_it(text[begin])) ++begin;
  }
  if (side != StripSide::kLeft) {
    while (end > begin && strip_it(text[end - 1])) --end;
  }
  return Encode(std::u32string_view(text).substr(begin, end - begin));
}

std::vector<std::string> Split(std::string_view s, const std::optional<std::string>& sep,
                               int maxsplit, bool from_right) {
  std::vector<std::string> parts;
  if (sep) {
    if (from_right) {
      size_t end = s.size();
      while (maxsplit != 0) {
        size_t pos = end >= sep->size() ? s.rfind(*sep, end - sep->size()) : std::string::npos;
        if (pos == std::string_view::npos) break;
        parts.emplace_back(s.substr(pos + sep->size(), end - pos - sep->size()));
        end = pos;
        if (maxsplit > 0) --maxsplit;
      }
      parts.emplace_back(s.substr(0, end));
      std::reverse(parts.begin(), parts.end());
      return parts;
    }
    size_t start = 0;
    while (maxsplit != 0) {
      size_t pos = s.find(*sep, start);
      if (pos == std::string_view::npos) break;
      parts.emplace_back(s.substr(start, pos - start));
      start = pos + sep->size();
      if (maxsplit > 0) --maxsplit;
    }
    parts.emplace_back(s.substr(start));
    return parts;
  }
  std::u32string text = Decode(s);
  if (from_right) {
    std::reverse(text.begin(), text.end());
  }
  size_t i = 0;
  const size_t n = text.size();
  while (true) {
    while (i < n && IsSpace(text[i])) ++i;
    if (i == n) break;
    if (maxsplit == 0) {
      size_t end = n;
      while (end > i && IsSpace(text[end - 1])) --end;
      parts.push_back(Encode(std::u32string_view(text).substr(i, end - i)));
      break;
    }
    size_t start = i;
    while (i < n && !IsSpace(text[i])) ++i;
    parts.push_back(Encode(std::u32string_view(text).substr(start, i - start)));
    if (maxsplit > 0) --maxsplit;
  }
  if (from_right) {
    std::reverse(parts.begin(), parts.end());
    for (std::string& part : parts) {
      std::u32string p = Decode(part);
      std::reverse(p.begin(), p.end());
      part = Encode(p);
    }
  }
  return parts;
}

std::vector<std::string> SplitLines(std::string_view s) {
  std::u32string text = Decode(s);
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    char32_t c = text[i];
    bool is_break = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D ||
                    c == 0x1E || c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!is_break) continue;
    lines.push_back(Encode(std::u32string_view(text).substr(start, i - start)));
    if (c == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
    start = i + 1;
  }
  if (start < text.size()) lines.push_back(Encode(std::u32string_view(text).substr(start)));
  return lines;
}

std::string Replace(std::string_view s, std::string_view from, std::string_view to, int count) {
  std::string out;
  if (from.empty()) {
    // Python inserts `to` before every code point and at the end.
    std::u32string text = Decode(s);
    int done = 0;
    for (char32_t c : text) {
      if (count < 0 || done < count) {
        out += to;
        ++done;
      }
      out += Encode(std::u32string(1, c));
    }
    if (count < 0 || done < count) out += to;
    return out;
  }
  size_t start = 0;
  int done = 0;
  while (count < 0 || done < count) {
    size_t pos = s.find(from, start);
    if (pos == std::string_view::npos) break;
    out.append(s.substr(start, pos - start));
    out.append(to);
    start = pos + from.size();
    ++done;
  }
  out.append(s.substr(start));
  return out;
}

namespace {

std::string CaseMap(std::string_view s, bool upper) {
  icu::UnicodeString text =
      icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
  if (upper) {
    text.toUpper(icu::Locale::getRoot());
  } else {
    text.toLower(icu::Locale::getRoot());
  }
  std::string out;
  text.toUTF8String(out);
  return out;
}

std::string TitleOne(char32_t c) {
  icu::UnicodeString text(static_cast<UChar32>(c));
  text.toTitle(nullptr, icu::Locale::getRoot(),
               U_TITLECASE_NO_LOWERCASE | U_TITLECASE_NO_BREAK_ADJUSTMENT);
  std::string out;
  text.toUTF8String(out);
  return out;
}

bool IsCased(char32_t c) { return u_isULowercase(c) || u_isUUppercase(c) || u_istitle(c); }

}  // namespace

std::string Upper(std::string_view s) { return CaseMap(s, true); }
std::string Lower(std::string_view s) { return CaseMap(s, false); }

std::string PythonTitle(std::string_view s) {
  std::string out;
  bool previous_cased = false;
  for (char32_t c : Decode(s)) {
    std::string one = Encode(std::u32string(1, c));
    out += previous_cased ? Lower(one) : TitleOne(c);
    previous_cased = IsCased(c);
  }
  return out;
}

std::string Capitalize(std::string_view s) {
  std::u32string text = Decode(s);
  if (text.empty()) return "";
  return TitleOne(text[0]) + Lower(Encode(std::u32string_view(text).substr(1)));
}

std::string StringRepr(std::string_view s) {
  std::u32string text = Decode(s);
  bool has_single = text.find(U'\'') != std::u32string::npos;
  bool has_double = text.find(U'"') != std::u32string::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : text) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7F) {
      out += absl::StrFormat("\\x%02x", static_cast<unsigned>(c));
    } else if (c < 0x7F) {
      out += static_cast<char>(c);
    } else {
      // Python escapes what str.isprintable() rejects: other/separator categories except ' '.
      int8_t type = u_charType(static_cast<UChar32>(c));
      bool printable =
          !(type == U_CONTROL_CHAR || type == U_FORMAT_CHAR || type == U_SURROGATE ||
            type == U_PRIVATE_USE_CHAR || type == U_UNASSIGNED || type == U_LINE_SEPARATOR ||
            type == U_PARAGRAPH_SEPARATOR || type == U_SPACE_SEPARATOR);
      if (printable) {
        out += Encode(std::u32string(1, c));
      } else if (c <= 0xFF) {
        out += absl::StrFormat("\\x%02x", static_cast<unsigned>(c));
      } else if (c <= 0xFFFF) {
        out += absl::StrFormat("\\u%04x", static_cast<unsigned>(c));
      } else {
        out += absl::StrFormat("\\U%08x", static_cast<unsigned>(c));
      }
    }
  }
  out += quote;
  return out;
}

}  // namespace tandem::jinja
