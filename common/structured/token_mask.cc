#include "common/structured/token_mask.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <thread>
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

TokenMasker::TokenMasker(Vocabulary vocab, int walk_threads) : vocab_(std::move(vocab)) {
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
  // A walk of a large vocabulary inside a free string visits most of the trie (tens of ms for
  // Llama-3's 128k tokens): it is split over threads by the subtrees two bytes deep.
  if (walk_threads == 0) {
    walk_threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1,
                              kMaxWalkThreads);
  }
  walk_threads_ = std::max(1, walk_threads);
  if (walk_threads_ == 1) return;
  std::vector<int64_t> size(trie_.size(), 1);  // nodes in each subtree; children come after
  for (size_t n = trie_.size(); n-- > 0;) {
    for (const auto& [byte, child] : trie_[n].children) size[n] += size[child];
  }
  for (const auto& [b1, first] : trie_[0].children) {
    first_nodes_.push_back(size[first]);
    if (!trie_[first].tokens.empty()) tasks_.push_back({first, -1, b1, 0, 1});
    for (const auto& [b2, second] : trie_[first].children) {
      tasks_.push_back({first, second, b1, b2, size[second]});
    }
  }
  std::stable_sort(tasks_.begin(), tasks_.end(),
                   [](const WalkTask& a, const WalkTask& b) { return a.nodes > b.nodes; });
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
  if (matcher.Accepting()) {
    for (int32_t id : vocab_.eos_ids) Allow(mask, id);
  }
  if (matcher.Finished()) return mask;
  // Small walks (most states refuse most first bytes) stay on this thread: a walk of fewer
  // nodes than this costs less than starting threads.
  constexpr int64_t kParallelNodes = 20000;
  int64_t open_nodes = 0;  // under the first bytes the matcher takes
  if (walk_threads_ > 1) {
    const auto& firsts = trie_[0].children;
    for (size_t i = 0; i < firsts.size(); ++i) {
      std::vector<Matcher::Stack> threads = matcher.threads_;
      if (matcher.StepInto(threads, firsts[i].first)) open_nodes += first_nodes_[i];
    }
  }
  if (walk_threads_ == 1 || open_nodes < kParallelNodes) {
    WalkSubtree(matcher, 0, matcher.threads_, mask);
    return mask;
  }
  // Threads take the two-byte subtrees in turn, each into a mask of its own; the union does not
  // depend on which thread walked what.
  std::atomic<size_t> next{0};
  std::vector<TokenBitmask> masks(walk_threads_, TokenBitmask(mask.size(), 0u));
  auto work = [&](int w) {
    TokenBitmask& m = masks[w];
    for (size_t t; (t = next.fetch_add(1)) < tasks_.size();) {
      const WalkTask& task = tasks_[t];
      std::vector<Matcher::Stack> threads = matcher.threads_;
      if (!matcher.StepInto(threads, task.first_byte)) continue;
      if (task.second < 0) {
        for (int32_t id : trie_[task.first].tokens) Allow(m, id);
        continue;
      }
      if (!matcher.StepInto(threads, task.second_byte)) continue;
      for (int32_t id : trie_[task.second].tokens) Allow(m, id);
      WalkSubtree(matcher, task.second, std::move(threads), m);
    }
  };
  std::vector<std::thread> helpers;
  for (int w = 1; w < walk_threads_; ++w) helpers.emplace_back(work, w);
  work(0);
  for (std::thread& t : helpers) t.join();
  for (const TokenBitmask& m : masks) {
    for (size_t i = 0; i < mask.size(); ++i) mask[i] |= m[i];
  }
  return mask;
}

void TokenMasker::WalkSubtree(const Matcher& matcher, int32_t root,
                              std::vector<Matcher::Stack> threads, TokenBitmask& mask) const {
  // Depth-first over the trie; each level holds the matcher's threads after that prefix.
  struct Level {
    int32_t node;
    size_t next_child;
    std::vector<Matcher::Stack> threads;
  };
  std::vector<Level> stack;
  stack.push_back({root, 0, std::move(threads)});
  while (!stack.empty()) {
    Level& top = stack.back();
    const TrieNode& node = trie_[top.node];
    if (top.next_child == node.children.size()) {
      stack.pop_back();
      continue;
    }
    const auto [byte, child] = node.children[top.next_child++];
    std::vector<Matcher::Stack> next = top.threads;
    if (!matcher.StepInto(next, byte)) continue;
    for (int32_t id : trie_[child].tokens) Allow(mask, id);
    stack.push_back({child, 0, std::move(next)});
  }
}

bool TokenMasker::Accept(Matcher& matcher, int32_t token) const {
  if (token < 0 || token >= vocab_.size() || vocab_.special[token]) return false;
  return matcher.Advance(vocab_.token_bytes[token]);
}

}  // namespace tandem::structured
