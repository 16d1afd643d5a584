// Added-token matching as Hugging Face's AddedVocabulary::find_matches does it. Word characters
// for single_word are Unicode's \w (Alphabetic, marks, Nd, Pc, Join_Control) and whitespace for
// lstrip/rstrip is White_Space, as the Rust regex crate defines them.
#include "common/tokenizer/added_tokens.h"

#include <unicode/uchar.h>

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tokenizer/json_fields.h"
#include "common/tokenizer/normalizer.h"
#include "common/utf8.h"

namespace tandem::tokenizer {
namespace {

bool IsWordChar(char32_t cp) {
  if (cp == kInvalidCodePoint) return false;
  const auto c = static_cast<UChar32>(cp);
  return u_hasBinaryProperty(c, UCHAR_ALPHABETIC) ||
         (U_GET_GC_MASK(c) & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0 ||
         u_hasBinaryProperty(c, UCHAR_JOIN_CONTROL);
}

// The code point that ends `s` (not empty, well-formed) and where it starts.
std::pair<char32_t, size_t> LastCodePoint(std::string_view s) {
  size_t start = s.size() - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  return {DecodeUtf8(s.substr(start)).first, start};
}

}  // namespace

absl::StatusOr<AddedVocabulary> AddedVocabulary::FromJson(const nlohmann::json& list,
                                                          const std::string& file,
                                                          const Normalizer* normalizer) {
  AddedVocabulary v;
  if (list.is_null()) return v;
  if (!list.is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": added_tokens must be an array"));
  }
  for (size_t i = 0; i < list.size(); ++i) {
    const nlohmann::json& a = list[i];
    const std::string where = absl::StrCat(file, ": added_tokens[", i, "]");
    if (!a.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, " is not an object"));
    RETURN_IF_ERROR(CheckKeys(
        a, {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"}, where));
    AddedToken t;
    ASSIGN_OR_RETURN(int64_t id, IntField(a, "id", where, std::nullopt));
    if (id < 0 || id >= (int64_t{1} << 24)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": id ", id, " out of range"));
    }
    t.id = static_cast<int32_t>(id);
    ASSIGN_OR_RETURN(t.content, StringField(a, "content", where));
    if (t.content.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, " has empty content"));
    }
    ASSIGN_OR_RETURN(t.special, BoolField(a, "special", where, false));
    ASSIGN_OR_RETURN(t.lstrip, BoolField(a, "lstrip", where, false));
    ASSIGN_OR_RETURN(t.rstrip, BoolField(a, "rstrip", where, false));
    ASSIGN_OR_RETURN(t.single_word, BoolField(a, "single_word", where, false));
    ASSIGN_OR_RETURN(t.normalized, BoolField(a, "normalized", where, !t.special));
    if (v.by_id_.contains(t.id) || v.by_content_.contains(t.content)) {
      return absl::InvalidArgumentError(absl::StrCat(where, " ('", t.content, "', id ", t.id,
                                                     ") repeats the id or content of another"));
    }
    std::string match = t.content;
    if (t.normalized && normalizer != nullptr) {
      RegexBudget budget = RegexBudget::ForText(match.size());
      RETURN_IF_ERROR(normalizer->Apply(match, budget));
    }
    v.by_id_[t.id] = v.tokens_.size();
    v.by_content_[t.content] = v.tokens_.size();
    v.match_text_.push_back(std::move(match));
    v.tokens_.push_back(std::move(t));
  }
  v.BuildMatcher(false);
  v.BuildMatcher(true);
  return v;
}

void AddedVocabulary::BuildMatcher(bool normalized) {
  Matcher& m = matchers_[normalized];
  for (size_t i = 0; i < tokens_.size(); ++i) {
    if (tokens_[i].normalized == normalized && !match_text_[i].empty()) {
      m.patterns.push_back({match_text_[i], i});
    }
  }
  for (size_t p = 0; p < m.patterns.size(); ++p) {
    m.by_first_byte[static_cast<uint8_t>(m.patterns[p].first[0])].push_back(p);
  }
  for (auto& bucket : m.by_first_byte) {
    std::stable_sort(bucket.begin(), bucket.end(), [&](size_t a, size_t b) {
      return m.patterns[a].first.size() > m.patterns[b].first.size();
    });
  }
}

std::vector<Segment> AddedVocabulary::Split(std::string_view text, bool normalized) const {
  std::vector<Segment> out;
  const Matcher& m = matchers_[normalized];
  size_t start_offset = 0;  // end of the last emitted part
  size_t pos = 0;           // where the search for the next match resumes
  while (!m.patterns.empty() && pos < text.size()) {
    // Leftmost match, longest at its position.
    size_t start = text.size(), token = 0, length = 0;
    for (size_t i = pos; i < text.size() && start == text.size(); ++i) {
      for (size_t p : m.by_first_byte[static_cast<uint8_t>(text[i])]) {
        const std::string& pattern = m.patterns[p].first;
        if (text.substr(i, pattern.size()) == pattern) {
          start = i;
          token = m.patterns[p].second;
          length = pattern.size();
          break;
        }
      }
    }
    if (start == text.size()) break;
    size_t stop = start + length;
    pos = stop;
    const AddedToken& t = tokens_[token];
    if (t.single_word) {
      const bool word_before = start > 0 && IsWordChar(LastCodePoint(text.substr(0, start)).first);
      const bool word_after = stop < text.size() && IsWordChar(DecodeUtf8(text.substr(stop)).first);
      if (word_before || word_after) continue;
    }
    if (t.lstrip) {
      size_t s = start;
      while (s > 0) {
        const auto [cp, at] = LastCodePoint(text.substr(0, s));
        if (!IsWhiteSpace(cp)) break;
        s = at;
      }
      // Whitespace an earlier match already took stays with it.
      start = std::max(s, start_offset);
    }
    if (t.rstrip) {
      while (stop < text.size()) {
        const auto [cp, len] = DecodeUtf8(text.substr(stop));
        if (!IsWhiteSpace(cp)) break;
        stop += len;
      }
    }
    if (start_offset < start) {
      out.push_back({text.substr(start_offset, start - start_offset), std::nullopt, start_offset});
    }
    out.push_back({text.substr(start, stop - start), t.id, start});
    start_offset = stop;
  }
  if (start_offset < text.size() || out.empty()) {
    out.push_back({text.substr(start_offset), std::nullopt, start_offset});
  }
  return out;
}

std::optional<int32_t> AddedVocabulary::TokenToId(std::string_view content) const {
  auto it = by_content_.find(std::string(content));
  if (it == by_content_.end()) return std::nullopt;
  return tokens_[it->second].id;
}

const std::string* AddedVocabulary::IdToText(int32_t id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : &match_text_[it->second];
}

bool AddedVocabulary::IsSpecialText(std::string_view token) const {
  auto it = by_content_.find(std::string(token));
  return it != by_content_.end() && tokens_[it->second].special;
}

}  // namespace tandem::tokenizer
