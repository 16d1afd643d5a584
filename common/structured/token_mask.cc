#include "common/structured/token_mask.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/tokenizer.h"
#include "common/tokenizer/byte_alphabet.h"

namespace tandem::structured {
namespace {

// Decodes one code point of `s` at `i`, or -1 when not UTF-8.
int32_t NextCodePoint(const std::string& s, size_t& i) {
  const uint8_t b = s[i];
  int len = b < 0x80 ? 1 : b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 0;
  if (len == 0 || i + len > s.size()) return -1;
  int32_t cp = len == 1 ? b : b & (0x3F >> (len - 1));
  for (int k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  i += len;
  return cp;
}

// The bytes a GPT-2 alphabet spelling stands for, or nullopt when it is not one.
std::optional<std::string> ByteLevelBytes(const std::string& token) {
  const auto& alphabet = tokenizer::GetByteAlphabet();
  std::string out;
  for (size_t i = 0; i < token.size();) {
    const int32_t cp = NextCodePoint(token, i);
    if (cp < 0 || cp >= static_cast<int32_t>(alphabet.cp_to_byte.size()) ||
        alphabet.cp_to_byte[cp] < 0) {
      return std::nullopt;
    }
    out += static_cast<char>(alphabet.cp_to_byte[cp]);
  }
  return out;
}

}  // namespace

absl::StatusOr<Vocabulary> VocabularyFromTokenizer(const Tokenizer& tokenizer,
                                                   std::vector<int32_t> eos_ids) {
  Vocabulary v;
  const int n = tokenizer.vocab_size();
  v.token_bytes.resize(n);
  v.special.assign(n, false);
  // A byte-level vocabulary spells the space as "Ġ" (U+0120).
  const bool byte_level = tokenizer.TokenToId("\xC4\xA0").has_value();
  for (int32_t id = 0; id < n; ++id) {
    const std::optional<std::string> token = tokenizer.IdToToken(id);
    if (!token.has_value()) {
      v.special[id] = true;
      continue;
    }
    const int32_t one[] = {id};
    auto text = tokenizer.Decode(one, /*skip_special_tokens=*/true);
    if (!text.ok() || text->empty()) {
      v.special[id] = true;
      continue;
    }
    if (token->size() == 6 && token->rfind("<0x", 0) == 0 && token->back() == '>') {
      v.token_bytes[id] = std::string(1, static_cast<char>(std::stoi(token->substr(3, 2), nullptr, 16)));
      continue;
    }
    if (byte_level) {
      if (auto bytes = ByteLevelBytes(*token)) {
        v.token_bytes[id] = std::move(*bytes);
        continue;
      }
    }
    // SentencePiece writes a space as U+2581.
    v.token_bytes[id] = absl::StrReplaceAll(*token, {{"\xE2\x96\x81", " "}});
  }
  for (int32_t id : eos_ids) {
    if (id < 0 || id >= n) {
      return absl::InvalidArgumentError(absl::StrCat("eos token id ", id, " is outside the vocabulary"));
    }
    v.special[id] = true;
  }
  v.eos_ids = std::move(eos_ids);
  return v;
}

TokenMasker::TokenMasker(Vocabulary vocab) : vocab_(std::move(vocab)) {
  trie_.emplace_back();
  for (int32_t id = 0; id < vocab_.size(); ++id) {
    if (vocab_.special[id] || vocab_.token_bytes[id].empty()) continue;
    int32_t node = 0;
    for (char c : vocab_.token_bytes[id]) {
      const uint8_t b = static_cast<uint8_t>(c);
      auto& ch = trie_[node].children;
      auto it = std::lower_bound(ch.begin(), ch.end(), std::make_pair(b, int32_t{-1}));
      if (it == ch.end() || it->first != b) {
        const int32_t created = static_cast<int32_t>(trie_.size());
        it = ch.insert(it, {b, created});
        trie_.emplace_back();  // invalidates `ch`; `it` is not used after
        node = created;
      } else {
        node = it->second;
      }
    }
    trie_[node].tokens.push_back(id);
  }
}

namespace {

// The bytes of a matcher state: its grammar's address, then each stack's frames. A string
// without maxLength counts its code points only up to its minLength (past it the count changes
// nothing), so a free string's body is one state however long it grows.
std::string StateKey(const Grammar* grammar, const std::vector<Matcher::Stack>& threads) {
  std::string key(reinterpret_cast<const char*>(&grammar), sizeof(grammar));
  for (const Matcher::Stack& stack : threads) {
    const uint32_t depth = static_cast<uint32_t>(stack.size());
    key.append(reinterpret_cast<const char*>(&depth), sizeof(depth));
    for (const Matcher::Frame& f : stack) {
      const SchemaNode& n = grammar->nodes[f.node];
      const bool free_string = n.kind == SchemaNode::kString && n.max_length < 0;
      const int32_t a = free_string ? std::min(f.a, n.min_length) : f.a;
      const int32_t fields[] = {f.node, f.phase, a, f.b, f.c};
      key.append(reinterpret_cast<const char*>(fields), sizeof(fields));
    }
  }
  return key;
}

}  // namespace

TokenBitmask TokenMasker::Mask(const Matcher& matcher) const {
  std::string key = StateKey(matcher.grammar_.get(), matcher.threads_);
  {
    absl::MutexLock lock(&mu_);
    if (auto it = cache_.find(key); it != cache_.end()) {
      ages_.splice(ages_.begin(), ages_, it->second.age);
      return it->second.mask;
    }
    ++walks_;
  }
  TokenBitmask mask = Walk(matcher);
  absl::MutexLock lock(&mu_);
  if (cache_.contains(key)) return mask;
  if (cache_.size() >= kCachedMasks) {
    cache_.erase(ages_.back());
    ages_.pop_back();
  }
  ages_.push_front(key);
  cache_.emplace(std::move(key), CachedMask{matcher.grammar_, mask, ages_.begin()});
  return mask;
}

int64_t TokenMasker::walks() const {
  absl::MutexLock lock(&mu_);
  return walks_;
}

TokenBitmask TokenMasker::Walk(const Matcher& matcher) const {
  TokenBitmask mask((vocab_.size() + 31) / 32, 0u);
  auto allow = [&mask](int32_t id) { mask[id >> 5] |= 1u << (id & 31); };
  if (matcher.Accepting()) {
    for (int32_t id : vocab_.eos_ids) allow(id);
  }
  if (matcher.Finished()) return mask;
  // Depth-first over the trie; each level holds the matcher's threads after that prefix.
  struct Level {
    int32_t node;
    size_t next_child;
    std::vector<Matcher::Stack> threads;
  };
  std::vector<Level> stack;
  stack.push_back({0, 0, matcher.threads_});
  while (!stack.empty()) {
    Level& top = stack.back();
    const TrieNode& node = trie_[top.node];
    if (top.next_child == node.children.size()) {
      stack.pop_back();
      continue;
    }
    const auto [byte, child] = node.children[top.next_child++];
    std::vector<Matcher::Stack> threads = top.threads;
    if (!matcher.StepInto(threads, byte)) continue;
    for (int32_t id : trie_[child].tokens) allow(id);
    stack.push_back({child, 0, std::move(threads)});
  }
  return mask;
}

bool TokenMasker::Accept(Matcher& matcher, int32_t token) const {
  if (token < 0 || token >= vocab_.size() || vocab_.special[token]) return false;
  return matcher.Advance(vocab_.token_bytes[token]);
}

}  // namespace tandem::structured
