// Regular expressions as tokenizer.json writes them (Oniguruma syntax, which Hugging Face's
// tokenizers compiles), run by ICU's regex engine, and literal patterns.
//
// The translation is small and strict: `\s`/`\S` are spelled as Unicode's White_Space property
// (what Oniguruma means by them, and what ICU's own `\s` matches too), and any escape whose
// meaning differs between the two engines, or that is not known to agree, is refused by name.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::tokenizer {

// A byte range of the searched text and whether the pattern matched it. FindMatches returns
// ranges that tile the text in order, as Hugging Face's Pattern::find_matches does.
struct MatchSpan {
  size_t begin, end;
  bool match;
};

// How much regex work one Encode (or Decode) may do, in ICU's time-limit units: the matcher counts
// one unit per 10,000 steps, about 0.2 ms of a current server core (a 40-character `(a+)+$`
// reaches 1,000 units in 0.21 s). A pattern that backtracks catastrophically on some text would
// otherwise hold a core for ever, even after the client left. Units count steps, not time, so a
// busy machine does not make a good prompt fail. Legitimate patterns need about 0.35 units per KiB
// (Llama 3's and GPT-2's, measured over 5 MB of source text); the budget gives each KiB 2 units
// over a base of 2,000, so they keep a margin of 5 while `(a+)+$` stops within half a second.
struct RegexBudget {
  static constexpr int64_t kBaseUnits = 2000;
  static constexpr int64_t kUnitsPerKiB = 2;
  // The budget for text of `bytes` bytes.
  static RegexBudget ForText(size_t bytes) {
    return {kBaseUnits + kUnitsPerKiB * static_cast<int64_t>(bytes / 1024)};
  }
  int64_t units_left;
};

class Pattern {
 public:
  // An Oniguruma pattern; `where` names the field for errors.
  static absl::StatusOr<std::shared_ptr<const Pattern>> Regex(std::string_view onig_pattern,
                                                              const std::string& where);
  static std::shared_ptr<const Pattern> Literal(std::string_view text);

  ~Pattern();
  // `text` is well-formed UTF-8. An empty text gives one non-matching empty range. The search
  // spends `budget`; INVALID_ARGUMENT naming the pattern (its field and text) when the budget runs
  // out or the matcher's backtracking memory passes its limit (kStackBytesPerChar).
  absl::StatusOr<std::vector<MatchSpan>> FindMatches(std::string_view text,
                                                     RegexBudget& budget) const;

 private:
  struct Compiled;
  Pattern() = default;
  std::string where_;   // the field that gave the regex, for errors
  std::string source_;  // the regex as written
  std::string literal_;
  std::unique_ptr<Compiled> regex_;  // null for a literal
};

}  // namespace tandem::tokenizer
