// Regular expressions as tokenizer.json writes them (Oniguruma syntax, which Hugging Face's
// tokenizers compiles), run by ICU's regex engine, and literal patterns.
//
// The translation is small and strict: `\s`/`\S` are spelled as Unicode's White_Space property
// (what Oniguruma means by them, and what ICU's own `\s` matches too), and any escape whose
// meaning differs between the two engines, or that is not known to agree, is refused by name.
#pragma once

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

class Pattern {
 public:
  // An Oniguruma pattern; `where` names the field for errors.
  static absl::StatusOr<std::shared_ptr<const Pattern>> Regex(std::string_view onig_pattern,
                                                              const std::string& where);
  static std::shared_ptr<const Pattern> Literal(std::string_view text);

  ~Pattern();
  // `text` is well-formed UTF-8. An empty text gives one non-matching empty range.
  std::vector<MatchSpan> FindMatches(std::string_view text) const;

 private:
  struct Compiled;
  Pattern() = default;
  std::string literal_;
  std::unique_ptr<Compiled> regex_;  // null for a literal
};

}  // namespace tandem::tokenizer
