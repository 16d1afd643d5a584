// Oniguruma patterns on ICU's regex engine; see regex.h for the translation rules.
#include "common/tokenizer/regex.h"

#include <unicode/regex.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/utf8.h"

namespace tandem::tokenizer {

struct Pattern::Compiled {
  std::unique_ptr<icu::RegexPattern> pattern;
};

Pattern::~Pattern() = default;

namespace {

// Rewrites an Oniguruma pattern for ICU, or says which construct it cannot vouch for.
absl::StatusOr<std::string> TranslateOniguruma(std::string_view pattern, const std::string& where) {
  std::string out;
  out.reserve(pattern.size() + 32);
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c != '\\') {
      out.push_back(c);
      continue;
    }
    if (i + 1 == pattern.size()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": regex ends in a lone backslash"));
    }
    const char e = pattern[++i];
    switch (e) {
      case 's':
        out.append("\\p{White_Space}");
        break;
      case 'S':
        out.append("\\P{White_Space}");
        break;
      // Same meaning in both engines: Unicode properties, decimal digits (Nd), word characters,
      // control escapes.
      case 'p':
      case 'P':
      case 'd':
      case 'D':
      case 'w':
      case 'W':
      case 'r':
      case 'n':
      case 't':
      case 'f':
      case 'v':
        out.push_back('\\');
        out.push_back(e);
        break;
      default:
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '0' && e <= '9')) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": regex escape \\", std::string(1, e),
                           " is not supported (its meaning is not known to match Oniguruma's)"));
        }
        // An escaped punctuation or other character stands for itself in both engines.
        out.push_back('\\');
        out.push_back(e);
    }
  }
  return out;
}

// UTF-16 copy of `text` and, for each UTF-16 index (and one past the end), its byte offset.
void ToUtf16(std::string_view text, icu::UnicodeString& u16, std::vector<uint32_t>& byte_of) {
  u16.remove();
  byte_of.clear();
  byte_of.reserve(text.size() + 1);
  for (size_t i = 0; i < text.size();) {
    const auto [cp, len] = DecodeUtf8(text.substr(i));
    const UChar32 c = cp == kInvalidCodePoint ? 0xFFFD : static_cast<UChar32>(cp);
    u16.append(c);
    byte_of.push_back(static_cast<uint32_t>(i));
    if (c > 0xFFFF) byte_of.push_back(static_cast<uint32_t>(i));
    i += len;
  }
  byte_of.push_back(static_cast<uint32_t>(text.size()));
}

// ICU's matcher calls this once per unit of its time limit with the units spent so far.
UBool RecordUnits(const void* context, int32_t units) {
  *static_cast<int32_t*>(const_cast<void*>(context)) = units;
  return true;
}

// Backtracking memory a search may take: ICU's default of 8 MiB, or 32 bytes per UTF-16 unit of
// the text when that is more (`\s+(?!\S)` over a million spaces needs between 8 and 16 MiB).
int32_t StackLimit(int32_t text_units) {
  constexpr int64_t kMinBytes = int64_t{8} << 20;
  constexpr int64_t kBytesPerUnit = 32;
  return static_cast<int32_t>(
      std::clamp<int64_t>(kBytesPerUnit * text_units, kMinBytes, INT32_MAX));
}

// The error for a search of the regex `source` (from field `where`) that ICU stopped with `status`.
absl::Status SearchError(const std::string& where, const std::string& source, UErrorCode status,
                         int32_t text_units) {
  constexpr size_t kMaxShown = 80;
  const std::string shown =
      source.size() > kMaxShown ? absl::StrCat(source.substr(0, kMaxShown), "...") : source;
  const std::string pattern = absl::StrCat(where, ": the regex '", shown, "'");
  if (status == U_REGEX_TIME_OUT) {
    return absl::InvalidArgumentError(absl::StrCat(
        pattern, " ran past the time limit of one tokenization on this text (",
        RegexBudget::kBaseUnits, " units of 10,000 matcher steps plus ", RegexBudget::kUnitsPerKiB,
        " per KiB of text): the pattern backtracks catastrophically on it, so the tokenizer "
        "cannot encode this text; change the text or the tokenizer's pattern"));
  }
  if (status == U_REGEX_STACK_OVERFLOW) {
    return absl::InvalidArgumentError(
        absl::StrCat(pattern, " needs more than ", StackLimit(text_units) >> 20,
                     " MiB of backtracking memory on this text; change the text or the pattern"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(pattern, " failed on this text (", u_errorName(status), ")"));
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Pattern>> Pattern::Regex(std::string_view onig_pattern,
                                                              const std::string& where) {
  std::string translated;
  {
    auto t = TranslateOniguruma(onig_pattern, where);
    if (!t.ok()) return t.status();
    translated = std::move(*t);
  }
  UErrorCode status = U_ZERO_ERROR;
  UParseError parse_error;
  std::unique_ptr<icu::RegexPattern> compiled(icu::RegexPattern::compile(
      icu::UnicodeString::fromUTF8(translated), 0, parse_error, status));
  if (U_FAILURE(status)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": regex does not compile (",
                                                   u_errorName(status), " at offset ",
                                                   parse_error.offset, ")"));
  }
  std::shared_ptr<Pattern> p(new Pattern());
  p->where_ = where;
  p->source_ = std::string(onig_pattern);
  p->regex_ = std::make_unique<Compiled>();
  p->regex_->pattern = std::move(compiled);
  return std::shared_ptr<const Pattern>(std::move(p));
}

std::shared_ptr<const Pattern> Pattern::Literal(std::string_view text) {
  std::shared_ptr<Pattern> p(new Pattern());
  p->literal_ = std::string(text);
  return p;
}

absl::StatusOr<std::vector<MatchSpan>> Pattern::FindMatches(std::string_view text,
                                                            RegexBudget& budget) const {
  std::vector<MatchSpan> spans;
  if (text.empty()) {
    spans.push_back({0, 0, false});
    return spans;
  }
  size_t prev = 0;
  auto add = [&](size_t begin, size_t end) {
    if (prev != begin) spans.push_back({prev, begin, false});
    spans.push_back({begin, end, true});
    prev = end;
  };
  if (regex_ == nullptr) {
    // An empty literal matches nothing (Hugging Face's &str pattern).
    if (!literal_.empty()) {
      for (size_t pos = text.find(literal_); pos != std::string_view::npos;
           pos = text.find(literal_, pos + literal_.size())) {
        add(pos, pos + literal_.size());
      }
    }
  } else {
    icu::UnicodeString u16;
    std::vector<uint32_t> byte_of;
    ToUtf16(text, u16, byte_of);
    UErrorCode status = U_ZERO_ERROR;
    std::unique_ptr<icu::RegexMatcher> m(regex_->pattern->matcher(u16, status));
    int32_t spent = 0;  // units, as the matcher's callback last reported them
    // A limit of 0 would mean none: a spent budget still allows one unit.
    const int32_t limit =
        static_cast<int32_t>(std::clamp<int64_t>(budget.units_left, 1, INT32_MAX));
    if (U_SUCCESS(status)) m->setTimeLimit(limit, status);
    if (U_SUCCESS(status)) m->setStackLimit(StackLimit(u16.length()), status);
    if (U_SUCCESS(status)) m->setMatchCallback(RecordUnits, &spent, status);
    while (U_SUCCESS(status) && m->find(status) && U_SUCCESS(status)) {
      const int32_t b = m->start(status), e = m->end(status);
      if (U_FAILURE(status)) break;
      add(byte_of[b], byte_of[e]);
    }
    budget.units_left -= spent;
    if (U_FAILURE(status)) return SearchError(where_, source_, status, u16.length());
  }
  if (prev != text.size()) spans.push_back({prev, text.size(), false});
  return spans;
}

}  // namespace tandem::tokenizer
