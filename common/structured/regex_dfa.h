// Regular expressions compiled to a byte-level DFA, for constrained decoding: a `regex`
// constraint, a `choice` among strings, and a JSON Schema string's `pattern`.
//
// Supported: literals, `.`, classes `[a-z0-9_]` and `[^...]`, the escapes \d \w \s \D \W \S
// \n \t \r \f \v \uXXXX and escaped punctuation, groups `(...)` and `(?:...)`, alternation `|`,
// the quantifiers * + ? {n} {n,} {n,m} (a lazy `?` suffix is accepted and means the same set), and
// `^` / `$` at the very ends. The whole text must match. `.` and negated classes match any
// character but "\n" (ASCII or a well-formed UTF-8 sequence), so the text stays UTF-8.
// Backreferences and lookaround are refused, naming them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::structured {

class RegexDfa {
 public:
  static constexpr int32_t kDead = -1;

  // INVALID_ARGUMENT naming the construct and its offset when `pattern` is malformed or uses what
  // is not supported; RESOURCE_EXHAUSTED when the DFA would pass kMaxStates.
  static absl::StatusOr<RegexDfa> Compile(std::string_view pattern);
  // A DFA that accepts exactly one of `options` (OpenAI-style choice).
  static absl::StatusOr<RegexDfa> Choice(const std::vector<std::string>& options);

  int32_t start() const { return 0; }
  int32_t Next(int32_t state, uint8_t byte) const {
    return transitions_[static_cast<size_t>(state) * 256 + byte];
  }
  bool Accepting(int32_t state) const { return accepting_[state]; }
  // True when no byte leads anywhere from `state`.
  bool Final(int32_t state) const { return final_[state]; }
  int num_states() const { return static_cast<int>(accepting_.size()); }

  static constexpr int kMaxStates = 4096;

 private:
  std::vector<int32_t> transitions_;  // (num_states, 256)
  std::vector<bool> accepting_;
  std::vector<bool> final_;
  friend class DfaBuilder;
};

// `text` with every regex metacharacter escaped.
std::string RegexEscape(std::string_view text);

}  // namespace tandem::structured
