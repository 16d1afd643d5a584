// tokenizer.json's "added_tokens": strings matched whole in the text before the model sees it,
// with Hugging Face's flags (special, lstrip, rstrip, normalized, single_word).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::tokenizer {

class Normalizer;

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool special = false;      // skipped by Decode(skip_special_tokens)
  bool lstrip = false;       // the match takes the whitespace before it
  bool rstrip = false;       // the match takes the whitespace after it
  bool normalized = true;    // matched in the normalized text (by its normalized form)
  bool single_word = false;  // matched only when no word character touches it
};

// A part of the text: an added token's id, or text for the model.
struct Segment {
  std::string_view text;
  std::optional<int32_t> id;
  size_t begin = 0;  // byte offset in the string it was cut from
};

class AddedVocabulary {
 public:
  AddedVocabulary() = default;
  // tokenizer.json's added_tokens array; `normalizer` (may be null) gives the normalized forms.
  static absl::StatusOr<AddedVocabulary> FromJson(const nlohmann::json& list,
                                                  const std::string& file,
                                                  const Normalizer* normalizer);

  // Cuts `text` at the matches of the tokens with normalized == `normalized`: leftmost match
  // first, the longest one at a position; a single_word match touching a word character is
  // dropped; lstrip/rstrip widen a match over the whitespace next to it.
  std::vector<Segment> Split(std::string_view text, bool normalized) const;

  std::optional<int32_t> TokenToId(std::string_view content) const;
  // The text Decode uses for an added token's id (its normalized form when it has one), or null.
  const std::string* IdToText(int32_t id) const;
  // Whether `token` is the content of a special added token.
  bool IsSpecialText(std::string_view token) const;
  const std::vector<AddedToken>& tokens() const { return tokens_; }
  bool empty() const { return tokens_.empty(); }

 private:
  struct Matcher {
    std::vector<std::pair<std::string, size_t>> patterns;     // (text, index in tokens_)
    std::array<std::vector<size_t>, 256> by_first_byte;       // indices into patterns, longest first
  };
  void BuildMatcher(bool normalized);

  std::vector<AddedToken> tokens_;
  std::vector<std::string> match_text_;  // per token: what is matched (normalized form if any)
  std::unordered_map<int32_t, size_t> by_id_;
  std::unordered_map<std::string, size_t> by_content_;
  std::array<Matcher, 2> matchers_;  // [normalized]
};

}  // namespace tandem::tokenizer
