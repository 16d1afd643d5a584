// Byte-level BPE as in GPT-2: text is split into pre-tokens by GPT-2's pattern, each pre-token's
// UTF-8 bytes become single-byte tokens, and adjacent pairs are merged by rank until none applies.
//
// Choices worth knowing:
// - Pre-tokenization is GPT-2's regular expression
//     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   written out as a scanner. \p{L} and \p{N} are Unicode's general categories L* and N* (from
//   ICU, so from ICU's Unicode version), and \s is JavaScript's set: tab, LF, VT, FF, CR, the
//   space separators (Zs), U+2028, U+2029 and U+FEFF, as in the JavaScript encoder the tests
//   compare with. (Python's `regex`, used by GPT-2's own encoder, takes Unicode's White_Space
//   instead, which differs on rare characters such as U+0085 and U+FEFF.)
// - Bytes that are not part of well-formed UTF-8 (stray continuation bytes, overlong forms,
//   surrogates, truncated sequences) are each a code point of their own that is neither letter,
//   number nor space, so they join runs of punctuation. Every byte still becomes a token, so
//   Decode(Encode(x)) == x for any byte string.
// - Added tokens (tokenizer.json "added_tokens") are matched as whole strings before
//   pre-tokenization, longest first at each position; their lstrip/rstrip/normalized flags are not
//   applied. The vocab.json + merges.txt path has no added tokens: like GPT-2's own encoder,
//   "<|endoftext|>" in text is ordinary text there.
// - When the same merge is listed twice its last rank counts, as in GPT-2's encoder.py (a dict
//   built from the list).
// - tokenizer.json's normalizer, pre_tokenizer and decoder sections are not read: the scheme is
//   GPT-2's whatever they say.
#include "common/tokenizer.h"

#include <unicode/uchar.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <queue>
#include <shared_mutex>
#include <sstream>
#include <system_error>
#include <unordered_map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace tandem {
namespace {

// Ids beyond this are taken as a corrupt file rather than allocated for (the id -> token table is
// dense).
constexpr int64_t kMaxId = (int64_t{1} << 24) - 1;
// The per-word cache is dropped when it grows past this many words, bounding memory for a server
// that sees unbounded text; words longer than kMaxCachedWordBytes are not cached.
constexpr size_t kMaxCachedWords = size_t{1} << 17;
constexpr size_t kMaxCachedWordBytes = 128;

// GPT-2's bytes_to_unicode(): the printable bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand for
// themselves; the other 68 bytes, in increasing order, become U+0100, U+0101, ... U+0143.
struct ByteAlphabet {
  std::array<char32_t, 256> byte_to_cp{};
  std::array<int16_t, 0x144> cp_to_byte{};  // -1 where the code point spells no byte
};

const ByteAlphabet& Alphabet() {
  static const ByteAlphabet alphabet = [] {
    ByteAlphabet a;
    a.cp_to_byte.fill(-1);
    char32_t next_extra = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      a.byte_to_cp[b] = printable ? static_cast<char32_t>(b) : next_extra++;
      a.cp_to_byte[a.byte_to_cp[b]] = static_cast<int16_t>(b);
    }
    return a;
  }();
  return alphabet;
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

constexpr char32_t kInvalidCodePoint = 0xFFFFFFFF;

// Decodes one well-formed UTF-8 sequence (Unicode's Table 3-7) at the start of `s`, which is not
// empty. Returns the code point and its length, or kInvalidCodePoint and length 1 for a byte that
// does not start a well-formed sequence.
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
  if (s.size() < static_cast<size_t>(len)) return {kInvalidCodePoint, 1};
  for (int i = 1; i < len; ++i) {
    const auto b = static_cast<uint8_t>(s[i]);
    if (i == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return {kInvalidCodePoint, 1};
    cp = (cp << 6) | (b & 0x3F);
  }
  return {cp, len};
}

// Character classes of GPT-2's pattern.
enum class CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

bool IsJsSpace(char32_t cp) {
  switch (cp) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x20:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
    case 0xFEFF:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

CharClass Classify(char32_t cp) {
  if (cp == kInvalidCodePoint) return CharClass::kOther;
  if (cp < 0x80) {
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return CharClass::kLetter;
    if (cp >= '0' && cp <= '9') return CharClass::kNumber;
    return IsJsSpace(cp) ? CharClass::kSpace : CharClass::kOther;
  }
  if (IsJsSpace(cp)) return CharClass::kSpace;
  switch (u_charType(static_cast<UChar32>(cp))) {
    case U_UPPERCASE_LETTER:
    case U_LOWERCASE_LETTER:
    case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER:
    case U_OTHER_LETTER:
      return CharClass::kLetter;
    case U_DECIMAL_DIGIT_NUMBER:
    case U_LETTER_NUMBER:
    case U_OTHER_NUMBER:
      return CharClass::kNumber;
    default:
      return CharClass::kOther;
  }
}

// One decoded character of the text being split: where it starts, what it is.
struct Unit {
  size_t offset;  // byte offset in the text
  char32_t cp;    // kInvalidCodePoint for a stray byte
  CharClass cls;
};

// Calls `emit(begin, end)` with the byte range of each pre-token of `text`, in order; the ranges
// tile the text.
template <typename Emit>
void PreTokenize(std::string_view text, std::vector<Unit>& units, Emit&& emit) {
  units.clear();
  for (size_t i = 0; i < text.size();) {
    const auto [cp, len] = DecodeUtf8(text.substr(i));
    units.push_back({i, cp, Classify(cp)});
    i += len;
  }
  const size_t n = units.size();
  auto offset = [&](size_t u) { return u < n ? units[u].offset : text.size(); };
  // End of the run of units of class `cls` that starts at `u`.
  auto run_end = [&](size_t u, CharClass cls) {
    while (u < n && units[u].cls == cls) ++u;
    return u;
  };
  size_t u = 0;
  while (u < n) {
    const Unit& c = units[u];
    size_t end = 0;
    // 's|'t|'re|'ve|'m|'ll|'d (case-sensitive, ASCII apostrophe only)
    if (c.cp == '\'' && u + 1 < n) {
      const char32_t c1 = units[u + 1].cp;
      const char32_t c2 = u + 2 < n ? units[u + 2].cp : 0;
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
        end = u + 2;
      } else if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
        end = u + 3;
      }
    }
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional U+0020 and then a run of one class.
    if (end == 0) {
      const size_t start =
          (c.cp == ' ' && u + 1 < n && units[u + 1].cls != CharClass::kSpace) ? u + 1 : u;
      if (units[start].cls != CharClass::kSpace) end = run_end(start, units[start].cls);
    }
    // `\s+(?!\S)|\s+`: a whitespace run that reaches the end or another whitespace character, so
    // a run before a non-space gives up its last character (which may lead the next pre-token)
    // unless it is only one character long.
    if (end == 0) {
      end = run_end(u, CharClass::kSpace);
      if (end < n && end - u >= 2) --end;
    }
    emit(offset(u), offset(end));
    u = end;
  }
}

std::string Quote(std::string_view s) {
  constexpr size_t kMax = 60;
  std::string out = "'";
  out.append(s.substr(0, kMax));
  if (s.size() > kMax) out.append("...");
  out.append("'");
  return out;
}

absl::StatusOr<std::string> ReadFile(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::NotFoundError(absl::StrCat(path.string(), ": no such file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot open"));
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path.string(), ": read failed"));
  return std::move(buf).str();
}

absl::StatusOr<nlohmann::json> ParseJson(const std::filesystem::path& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": not valid JSON: ", e.what()));
  }
}

// An id as written in a vocabulary: a non-negative integer no larger than kMaxId.
absl::StatusOr<int32_t> ParseId(const nlohmann::json& value, const std::string& file,
                                const std::string& what) {
  if (!value.is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": ", what, " has id ", value.dump(), ", which is not an integer"));
  }
  if (value.is_number_unsigned() ? value.get<uint64_t>() > static_cast<uint64_t>(kMaxId)
                                 : (value.get<int64_t>() < 0 || value.get<int64_t>() > kMaxId)) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": ", what, " has id ", value.dump(), ", outside 0..", kMaxId));
  }
  return static_cast<int32_t>(value.get<int64_t>());
}

struct VocabEntry {
  std::string text;  // in GPT-2's byte alphabet (or an added token's literal content)
  int32_t id;
};

absl::StatusOr<std::vector<VocabEntry>> ParseVocab(const nlohmann::json& vocab,
                                                   const std::string& file,
                                                   const std::string& field) {
  if (!vocab.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": ", field, " must be an object of token -> id, got ", vocab.type_name()));
  }
  std::vector<VocabEntry> entries;
  entries.reserve(vocab.size());
  for (const auto& [text, id_json] : vocab.items()) {
    ASSIGN_OR_RETURN(int32_t id, ParseId(id_json, file, absl::StrCat("token ", Quote(text))));
    entries.push_back({text, id});
  }
  return entries;
}

struct MergeEntry {
  std::string left, right;
  std::string where;  // "line 7", "model.merges[5]"
};

struct AddedEntry {
  std::string content;
  int32_t id;
};

}  // namespace

struct Tokenizer::Impl {
  struct PairHash {
    size_t operator()(uint64_t key) const {
      return std::hash<uint64_t>()(key * 0x9E3779B97F4A7C15ull);
    }
  };
  struct MergeResult {
    int32_t rank;
    int32_t merged_id;
  };
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
  };
  using WordCache =
      std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>>;

  std::array<int32_t, 256> byte_id{};  // id of the token of each single byte
  // (left id << 32 | right id) -> rank and id of the merged token.
  std::unordered_map<uint64_t, MergeResult, PairHash> merges;
  // id -> bytes; nullopt for ids no token has.
  std::vector<std::optional<std::string>> id_to_bytes;
  // Added tokens by length, longest first, and which first bytes can start one.
  std::vector<AddedEntry> added;
  std::array<bool, 256> added_first_byte{};

  mutable std::shared_mutex cache_mutex;
  mutable WordCache cache;

  static absl::StatusOr<std::unique_ptr<Impl>> Build(const std::string& vocab_file,
                                                     const std::vector<VocabEntry>& vocab,
                                                     const std::string& merges_file,
                                                     const std::vector<MergeEntry>& merge_list,
                                                     std::vector<AddedEntry> added_list);

  void EncodeOrdinary(std::string_view text, std::vector<Unit>& units,
                      std::vector<int32_t>& out) const;
  void EncodeWord(std::string_view word, std::vector<int32_t>& out) const;
  std::vector<int32_t> MergeWord(std::string_view word) const;
};

absl::StatusOr<std::unique_ptr<Tokenizer::Impl>> Tokenizer::Impl::Build(
    const std::string& vocab_file, const std::vector<VocabEntry>& vocab,
    const std::string& merges_file, const std::vector<MergeEntry>& merge_list,
    std::vector<AddedEntry> added_list) {
  auto impl = std::make_unique<Impl>();
  const ByteAlphabet& alphabet = Alphabet();

  int32_t max_id = -1;
  for (const auto& e : vocab) max_id = std::max(max_id, e.id);
  for (const auto& a : added_list) max_id = std::max(max_id, a.id);
  impl->id_to_bytes.resize(static_cast<size_t>(max_id + 1));

  std::unordered_map<int32_t, const AddedEntry*> added_by_id;
  for (const auto& a : added_list) added_by_id[a.id] = &a;

  // Token text (as written in the files) -> id, to resolve merges.
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> text_to_id;
  text_to_id.reserve(vocab.size());
  std::vector<const std::string*> text_of_id(impl->id_to_bytes.size(), nullptr);
  for (const auto& e : vocab) {
    if (text_of_id[e.id] != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(vocab_file, ": tokens ",
                                                     Quote(*text_of_id[e.id]), " and ",
                                                     Quote(e.text), " both have id ", e.id));
    }
    text_of_id[e.id] = &e.text;
    text_to_id.emplace(e.text, e.id);
    if (auto it = added_by_id.find(e.id); it != added_by_id.end()) {
      // Added tokens are listed in the vocabulary by their literal content.
      if (it->second->content != e.text) {
        return absl::InvalidArgumentError(
            absl::StrCat(vocab_file, ": id ", e.id, " is token ", Quote(e.text),
                         " in the vocabulary but added token ", Quote(it->second->content)));
      }
      impl->id_to_bytes[e.id] = e.text;
      continue;
    }
    std::string bytes;
    bytes.reserve(e.text.size());
    for (size_t i = 0; i < e.text.size();) {
      const auto [cp, len] = DecodeUtf8(std::string_view(e.text).substr(i));
      if (cp == kInvalidCodePoint || cp >= alphabet.cp_to_byte.size() ||
          alphabet.cp_to_byte[cp] < 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: token %s (id %d) has character U+%04X, which is not in GPT-2's byte alphabet "
            "(not a byte-level BPE vocabulary?)",
            vocab_file, Quote(e.text), e.id,
            static_cast<uint32_t>(cp == kInvalidCodePoint ? 0xFFFD : cp)));
      }
      bytes.push_back(static_cast<char>(alphabet.cp_to_byte[cp]));
      i += len;
    }
    if (bytes.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(vocab_file, ": the empty string is a token (id ", e.id, ")"));
    }
    impl->id_to_bytes[e.id] = std::move(bytes);
  }

  for (int b = 0; b < 256; ++b) {
    std::string text;
    AppendUtf8(alphabet.byte_to_cp[b], text);
    auto it = text_to_id.find(text);
    if (it == text_to_id.end()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: no token for byte 0x%02X (spelled %s); a byte-level BPE vocabulary has all 256",
          vocab_file, b, Quote(text)));
    }
    impl->byte_id[b] = it->second;
  }

  impl->merges.reserve(merge_list.size());
  for (size_t rank = 0; rank < merge_list.size(); ++rank) {
    const MergeEntry& m = merge_list[rank];
    auto lookup = [&](const std::string& text) -> absl::StatusOr<int32_t> {
      auto it = text_to_id.find(text);
      if (it == text_to_id.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat(merges_file, ": ", m.where, ": merge ", Quote(m.left + " " + m.right),
                         " names ", Quote(text), ", which is not in the vocabulary"));
      }
      return it->second;
    };
    ASSIGN_OR_RETURN(int32_t left, lookup(m.left));
    ASSIGN_OR_RETURN(int32_t right, lookup(m.right));
    auto merged = text_to_id.find(m.left + m.right);
    if (merged == text_to_id.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(merges_file, ": ", m.where, ": merge ", Quote(m.left + " " + m.right),
                       " makes ", Quote(m.left + m.right), ", which is not in the vocabulary"));
    }
    // Last rank wins for a repeated merge, as in GPT-2's dict(zip(merges, range(n))).
    impl->merges[(static_cast<uint64_t>(left) << 32) | static_cast<uint32_t>(right)] = {
        static_cast<int32_t>(rank), merged->second};
  }

  for (const auto& a : added_list) {
    if (auto it = text_to_id.find(a.content); it != text_to_id.end() && it->second != a.id) {
      return absl::InvalidArgumentError(
          absl::StrCat(vocab_file, ": added token ", Quote(a.content), " has id ", a.id,
                       " but the vocabulary gives it id ", it->second));
    }
    impl->id_to_bytes[a.id] = a.content;
  }
  std::stable_sort(
      added_list.begin(), added_list.end(),
      [](const AddedEntry& x, const AddedEntry& y) { return x.content.size() > y.content.size(); });
  for (const auto& a : added_list) {
    impl->added_first_byte[static_cast<uint8_t>(a.content[0])] = true;
  }
  impl->added = std::move(added_list);
  return impl;
}

// BPE over one pre-token. Applies merges in rank order; all occurrences of the best pair are
// merged left to right before the next rank is considered (GPT-2's loop), using a heap so that a
// long word costs O(n log n) rather than O(n^2).
std::vector<int32_t> Tokenizer::Impl::MergeWord(std::string_view word) const {
  const int n = static_cast<int>(word.size());
  // Symbols are kept at the byte offset where they start; next/prev link the live ones.
  std::vector<int32_t> id(n), next(n), prev(n);
  for (int p = 0; p < n; ++p) {
    id[p] = byte_id[static_cast<uint8_t>(word[p])];
    next[p] = p + 1;
    prev[p] = p - 1;
  }
  struct Candidate {
    int32_t rank, pos, left, right, merged;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto consider = [&](int p) {
    if (p < 0 || next[p] >= n) return;
    const int32_t l = id[p], r = id[next[p]];
    auto it = merges.find((static_cast<uint64_t>(l) << 32) | static_cast<uint32_t>(r));
    if (it != merges.end()) heap.push({it->second.rank, p, l, r, it->second.merged_id});
  };
  for (int p = 0; p + 1 < n; ++p) consider(p);

  std::vector<Candidate> batch;
  while (!heap.empty()) {
    // Every candidate of this rank is the same pair; take them all (in position order) so that
    // pairs formed by these merges wait for the next round, as in GPT-2.
    batch.clear();
    const int32_t rank = heap.top().rank;
    while (!heap.empty() && heap.top().rank == rank) {
      batch.push_back(heap.top());
      heap.pop();
    }
    for (const Candidate& c : batch) {
      // Stale when an earlier merge consumed either symbol.
      if (id[c.pos] != c.left || next[c.pos] >= n || id[next[c.pos]] != c.right) continue;
      const int q = next[c.pos];
      id[c.pos] = c.merged;
      id[q] = -1;
      next[c.pos] = next[q];
      if (next[q] < n) prev[next[q]] = c.pos;
      consider(prev[c.pos]);
      consider(c.pos);
    }
  }
  std::vector<int32_t> out;
  for (int p = 0; p < n; p = next[p]) out.push_back(id[p]);
  return out;
}

void Tokenizer::Impl::EncodeWord(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() == 1) {
    out.push_back(byte_id[static_cast<uint8_t>(word[0])]);
    return;
  }
  const bool cacheable = word.size() <= kMaxCachedWordBytes;
  if (cacheable) {
    std::shared_lock lock(cache_mutex);
    if (auto it = cache.find(word); it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids = MergeWord(word);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cacheable) {
    std::unique_lock lock(cache_mutex);
    if (cache.size() >= kMaxCachedWords) cache.clear();
    cache.emplace(std::string(word), std::move(ids));
  }
}

void Tokenizer::Impl::EncodeOrdinary(std::string_view text, std::vector<Unit>& units,
                                     std::vector<int32_t>& out) const {
  PreTokenize(text, units,
              [&](size_t begin, size_t end) { EncodeWord(text.substr(begin, end - begin), out); });
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

std::vector<int32_t> Tokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  std::vector<Unit> units;
  size_t segment = 0;  // start of the text not yet encoded
  for (size_t pos = 0; pos < text.size() && !impl_->added.empty();) {
    const AddedEntry* match = nullptr;
    if (impl_->added_first_byte[static_cast<uint8_t>(text[pos])]) {
      for (const AddedEntry& a : impl_->added) {
        if (text.substr(pos, a.content.size()) == a.content) {
          match = &a;
          break;
        }
      }
    }
    if (match == nullptr) {
      ++pos;
      continue;
    }
    impl_->EncodeOrdinary(text.substr(segment, pos - segment), units, out);
    out.push_back(match->id);
    pos += match->content.size();
    segment = pos;
  }
  impl_->EncodeOrdinary(text.substr(segment), units, out);
  return out;
}

absl::StatusOr<std::string> Tokenizer::Decode(std::span<const int32_t> ids) const {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || static_cast<size_t>(id) >= impl_->id_to_bytes.size() ||
        !impl_->id_to_bytes[id].has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", id, " (at position ", i,
                                                     ") is not in the vocabulary of ", vocab_size(),
                                                     " ids"));
    }
    out.append(*impl_->id_to_bytes[id]);
  }
  return out;
}

int Tokenizer::vocab_size() const { return static_cast<int>(impl_->id_to_bytes.size()); }

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromTokenizerJson(
    const std::filesystem::path& path) {
  const std::string file = path.string();
  ASSIGN_OR_RETURN(nlohmann::json root, ParseJson(path));
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": top level must be an object, got ", root.type_name()));
  }
  auto model_it = root.find("model");
  if (model_it == root.end() || !model_it->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": no \"model\" object"));
  }
  const nlohmann::json& model = *model_it;
  if (auto type = model.find("type"); type != model.end() && *type != "BPE") {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": model.type is ", type->dump(), ", only \"BPE\" is supported"));
  }
  auto vocab_it = model.find("vocab");
  if (vocab_it == model.end()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": no model.vocab"));
  }
  ASSIGN_OR_RETURN(std::vector<VocabEntry> vocab, ParseVocab(*vocab_it, file, "model.vocab"));

  auto merges_it = model.find("merges");
  if (merges_it == model.end() || !merges_it->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": no model.merges array"));
  }
  std::vector<MergeEntry> merges;
  merges.reserve(merges_it->size());
  for (size_t i = 0; i < merges_it->size(); ++i) {
    const nlohmann::json& m = (*merges_it)[i];
    std::string where = absl::StrCat("model.merges[", i, "]");
    // Older files write "left right"; newer ones ["left", "right"] (which allows spaces).
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 == s.size() ||
          s.find(' ', space + 1) != std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat(file, ": ", where, " is ", Quote(s),
                                                       ", not two tokens separated by one space"));
      }
      merges.push_back({s.substr(0, space), s.substr(space + 1), std::move(where)});
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string() &&
               !m[0].get_ref<const std::string&>().empty() &&
               !m[1].get_ref<const std::string&>().empty()) {
      merges.push_back({m[0].get<std::string>(), m[1].get<std::string>(), std::move(where)});
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": ", where, " is ", m.dump().substr(0, 60),
                       ", neither \"left right\" nor [\"left\", \"right\"] with non-empty tokens"));
    }
  }

  std::vector<AddedEntry> added;
  if (auto added_it = root.find("added_tokens"); added_it != root.end() && !added_it->is_null()) {
    if (!added_it->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(file, ": added_tokens must be an array"));
    }
    for (size_t i = 0; i < added_it->size(); ++i) {
      const nlohmann::json& a = (*added_it)[i];
      const std::string where = absl::StrCat("added_tokens[", i, "]");
      if (!a.is_object() || !a.contains("id") || !a.contains("content") ||
          !a["content"].is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(file, ": ", where, " needs an integer \"id\" and a string \"content\""));
      }
      ASSIGN_OR_RETURN(int32_t id, ParseId(a["id"], file, where));
      std::string content = a["content"].get<std::string>();
      if (content.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(file, ": ", where, " has empty content"));
      }
      for (const AddedEntry& other : added) {
        if (other.id == id || other.content == content) {
          return absl::InvalidArgumentError(
              absl::StrCat(file, ": ", where, " (", Quote(content), ", id ", id,
                           ") repeats the id or content of added token ", Quote(other.content)));
        }
      }
      added.push_back({std::move(content), id});
    }
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Impl> impl,
                   Impl::Build(file, vocab, file, merges, std::move(added)));
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromVocabAndMerges(
    const std::filesystem::path& vocab_json, const std::filesystem::path& merges_txt) {
  const std::string vocab_file = vocab_json.string();
  const std::string merges_file = merges_txt.string();
  ASSIGN_OR_RETURN(nlohmann::json root, ParseJson(vocab_json));
  ASSIGN_OR_RETURN(std::vector<VocabEntry> vocab, ParseVocab(root, vocab_file, "the top level"));

  ASSIGN_OR_RETURN(std::string text, ReadFile(merges_txt));
  std::vector<MergeEntry> merges;
  size_t line_no = 0;
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + begin, end - begin);
    begin = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line_no == 1 && line.starts_with("#version")) continue;
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    // Fields separated by runs of spaces or tabs, as Python's str.split() reads them.
    std::vector<std::string_view> fields;
    for (size_t i = 0; i < line.size();) {
      const size_t start = line.find_first_not_of(" \t", i);
      if (start == std::string_view::npos) break;
      size_t stop = line.find_first_of(" \t", start);
      if (stop == std::string_view::npos) stop = line.size();
      fields.push_back(line.substr(start, stop - start));
      i = stop;
    }
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(merges_file, ": line ", line_no, " is ", Quote(line), ", not two tokens"));
    }
    merges.push_back(
        {std::string(fields[0]), std::string(fields[1]), absl::StrCat("line ", line_no)});
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Impl> impl,
                   Impl::Build(vocab_file, vocab, merges_file, merges, {}));
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromDir(const std::filesystem::path& dir) {
  std::error_code ec;
  if (std::filesystem::exists(dir / "tokenizer.json", ec)) {
    return FromTokenizerJson(dir / "tokenizer.json");
  }
  if (std::filesystem::exists(dir / "vocab.json", ec) &&
      std::filesystem::exists(dir / "merges.txt", ec)) {
    return FromVocabAndMerges(dir / "vocab.json", dir / "merges.txt");
  }
  return absl::NotFoundError(
      absl::StrCat(dir.string(), ": neither tokenizer.json nor vocab.json + merges.txt"));
}

}  // namespace tandem
