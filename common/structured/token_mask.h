// The tokens a matcher allows next, from the tokenizer's vocabulary as bytes.
//
// The vocabulary is a byte trie; a mask is a depth-first walk of it that advances a copy of the
// matcher by each edge's byte and prunes a subtree as soon as its prefix is refused, so a step
// costs the allowed prefixes, not 128k tokens times their length. Special tokens are never
// allowed, except the end-of-sequence ids, which are allowed exactly when the text so far is
// accepted.
//
// A mask depends only on the matcher's state (its grammar and stacks), and a generation passes
// through few distinct states (inside a free string, between properties, after a key), so masks
// are kept per state: a state seen before costs a lookup and a copy instead of the walk.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/structured/grammar.h"

namespace tandem {
class Tokenizer;
}

namespace tandem::structured {

struct Vocabulary {
  // token_bytes[id]: the bytes the token adds to the text; special[id]: a control token that no
  // grammar allows (eos ids are special too).
  std::vector<std::string> token_bytes;
  std::vector<bool> special;
  std::vector<int32_t> eos_ids;
  int size() const { return static_cast<int>(token_bytes.size()); }
};

// The bytes of each token of `tokenizer`: a ByteLevel (GPT-2 alphabet) token decoded to its
// bytes, a byte-fallback "<0xAB>" token to its byte, SentencePiece's "▁" to a space; a token
// whose decode with skip_special_tokens is empty counts as special.
absl::StatusOr<Vocabulary> VocabularyFromTokenizer(const Tokenizer& tokenizer,
                                                   std::vector<int32_t> eos_ids);

// A packed allow-bitmask, bit (id % 32) of word id / 32.
using TokenBitmask = std::vector<uint32_t>;
inline bool Allowed(const TokenBitmask& mask, int32_t id) {
  return (mask[id >> 5] >> (id & 31)) & 1u;
}
inline void Allow(TokenBitmask& mask, int32_t id) { mask[id >> 5] |= 1u << (id & 31); }

class TokenMasker {
 public:
  // Masks kept per matcher state, the least recently used dropped first (a mask is vocab / 8
  // bytes: 19 KB for Qwen's 152k tokens, so 19 MB at most).
  static constexpr size_t kCachedMasks = 1024;

  // walk_threads: threads a walk of a large vocabulary may take (0: the host's cores, at most
  // kMaxWalkThreads); 1 walks on the caller's thread only.
  static constexpr int kMaxWalkThreads = 8;
  explicit TokenMasker(Vocabulary vocab, int walk_threads = 0);

  // The tokens that may follow `matcher`'s text (vocab.size() bits).
  TokenBitmask Mask(const Matcher& matcher) const;
  // Advances `matcher` by `token`; false when the token is not allowed (the matcher unchanged).
  bool Accept(Matcher& matcher, int32_t token) const;

  const Vocabulary& vocab() const { return vocab_; }
  // How many Mask calls walked the trie (the others were found in the cache).
  int64_t walks() const;

 private:
  TokenBitmask Walk(const Matcher& matcher) const;
  // The tokens of the subtree under `node` whose prefixes `matcher` accepts after `threads` (the
  // matcher's threads after the bytes that lead to `node`), into `mask`.
  void WalkSubtree(const Matcher& matcher, int32_t node, std::vector<Matcher::Stack> threads,
                   TokenBitmask& mask) const;

  struct TrieNode {
    std::vector<std::pair<uint8_t, int32_t>> children;  // (byte, node), by byte
    std::vector<int32_t> tokens;                          // tokens that end here
  };
  Vocabulary vocab_;
  std::vector<TrieNode> trie_;
  // A parallel walk's pieces: (first byte's child of the root, its child or -1 for the first
  // byte's own tokens), largest subtree first, so that threads taking them in turn finish
  // together. Empty where walks stay on the caller's thread.
  struct WalkTask {
    int32_t first, second;    // nodes
    uint8_t first_byte, second_byte;
    int64_t nodes;            // in the subtree
  };
  std::vector<WalkTask> tasks_;
  std::vector<int64_t> first_nodes_;  // nodes under each child of the root, in its order
  int walk_threads_ = 1;

  // The state's key (grammar address and stacks, as bytes) to its mask; an entry holds its
  // grammar so that the address cannot be reused by another grammar while the entry lives.
  struct CachedMask {
    std::shared_ptr<const Grammar> grammar;
    TokenBitmask mask;
    std::list<std::string>::iterator age;
  };
  mutable absl::Mutex mu_;
  mutable std::unordered_map<std::string, CachedMask> cache_ ABSL_GUARDED_BY(mu_);
  mutable std::list<std::string> ages_ ABSL_GUARDED_BY(mu_);  // most recently used first
  mutable int64_t walks_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tandem::structured
