// The KV-cache page owner of one pipeline: which pages of a pool of `num_pages` pages of
// `page_size` tokens each sequence uses. Every stage of a pipeline holds the same positions of
// different layers, so one owner in the coordinator decides for all of them and steps carry its
// block tables. Pure policy: no gRPC, no threads (the caller serialises calls).
//
// The rules, in order:
//  1. A sequence's block table lists its pages in token order; token t lives in page
//     table[t / page_size] at row t % page_size. Pages are allocated as tokens arrive, so at most
//     one page per sequence is partly empty.
//  2. Prefix caching (on by default): a full page whose tokens are all computed is published under
//     a hash chain of its tokens and its parent page's hash, so the same tokens after a different
//     prefix are a different page. A lookup compares tokens as well as hashes (a hash collision is
//     a miss). Only full pages are shared; the partial last page is always the sequence's own.
//  3. A lookup never covers the whole prompt: the last prompt token is computed to produce logits,
//     so the cached prefix is the full pages within the first prompt_len - 1 tokens.
//  4. Pages are shared by reference count (common prompt prefixes; n > 1 through Fork). A cached
//     page whose count drops to zero stays cached and becomes evictable; a page is taken from the
//     free pages first, then by evicting the least-recently-used cached page, deeper pages of a
//     chain before their parents when equally recent.
//  5. Admission: a request is admitted when the pages of its prompt (less those cached) plus a
//     margin of `margin_tokens` more tokens for it and for every running sequence fit in the free
//     and evictable pages. A request that can never fit (prompt + max tokens beyond the context or
//     the whole pool) is refused.
//  6. When a sequence cannot grow, the newest admitted sequence is preempted: its pages are freed
//     and it is resumed later by recomputing its tokens.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace tandem {

// The hash of a full page from its parent's hash (0 for the first page) and its tokens.
using PageHashFn = std::function<uint64_t(uint64_t parent, absl::Span<const int32_t> tokens)>;
uint64_t DefaultPageHash(uint64_t parent, absl::Span<const int32_t> tokens);

struct KvPagesConfig {
  int num_pages = 0;    // pages in the pool (each stage of the pipeline holds as many)
  int page_size = 16;   // tokens per page
  int max_seq_len = 0;  // the context: prompt + generated tokens of one sequence
  bool prefix_caching = true;
  // Tokens of growth reserved at admission for each running sequence (capped by what it may still
  // generate), so that admitting one request does not at once force a preemption.
  int margin_tokens = 16;
  PageHashFn hash = DefaultPageHash;  // tests plant collisions through it
};

// What the coordinator exports. Every page is exactly one of used, cached or free.
struct KvPageCounters {
  int64_t pages_total = 0;
  int64_t pages_used = 0;    // held by at least one sequence
  int64_t pages_cached = 0;  // held only by the prefix cache (evictable)
  int64_t pages_free = 0;
  int64_t prefix_queries = 0;       // admissions looked up in the prefix cache
  int64_t prefix_hits = 0;          // of those, the ones that found at least one cached page
  int64_t prefix_query_tokens = 0;  // prompt tokens looked up
  int64_t prefix_hit_tokens = 0;    // prompt tokens found cached (their prefill is skipped)
  int64_t preemptions = 0;
};

class KvPageOwner {
 public:
  // Errors name the field and the accepted range.
  static absl::StatusOr<KvPageOwner> Create(KvPagesConfig config);

  // InvalidArgument when a request of `prompt_tokens` + `max_new_tokens` can never run: beyond the
  // context or beyond the whole pool. The message names the tokens asked and the capacity.
  absl::Status CheckFits(int prompt_tokens, int max_new_tokens) const;
  // The leading prompt tokens cached now (a multiple of page_size, < prompt.size()); no counters.
  int CachedPrefixTokens(absl::Span<const int32_t> prompt) const;
  // Whether Admit would succeed now (rule 5).
  bool CanAdmit(absl::Span<const int32_t> prompt, int max_new_tokens,
                bool use_cache = true) const;
  // Admits sequence `seq` with `prompt`: takes the cached prefix and allocates pages for the rest.
  // Returns the prompt tokens already computed (their prefill is skipped). ResourceExhausted
  // (nothing changed) when the pages are not there now; AlreadyExists for a known `seq`.
  // `use_cache` false: no cached page is taken (a request that scores its whole prompt).
  absl::StatusOr<int> Admit(uint64_t seq, absl::Span<const int32_t> prompt, int max_new_tokens,
                            bool use_cache = true);
  // Admits `child` as a copy of `parent`, which holds only its prompt (n > 1): the full pages
  // within the first prompt_len - 1 tokens are shared, the rest are the child's own. Returns the
  // tokens the child need not compute. ResourceExhausted when its own pages are not there.
  absl::StatusOr<int> Fork(uint64_t parent, uint64_t child, int max_new_tokens);
  // Appends generated `tokens` to `seq`, allocating pages as they fill. ResourceExhausted (nothing
  // changed) when a page is needed and none is free or evictable: preempt and retry.
  absl::Status Append(uint64_t seq, absl::Span<const int32_t> tokens);
  // The first `tokens` tokens of `seq` are in the cache of every stage: its full pages among them
  // are published to the prefix cache.
  void MarkComputed(uint64_t seq, int tokens);
  // Ends `seq`: its pages are released (published ones stay cached). False for an unknown `seq`.
  bool Free(uint64_t seq);
  // The sequence to preempt when one cannot grow: the newest admitted. Nothing when none runs.
  std::optional<uint64_t> PreemptionVictim() const;
  // Frees `seq` and counts a preemption; it is resumed by admitting its tokens again.
  bool Preempt(uint64_t seq);

  // The pages of `seq` in token order; empty for an unknown `seq`.
  absl::Span<const int> BlockTable(uint64_t seq) const;
  int NumTokens(uint64_t seq) const;
  int RefCount(int page) const { return pages_[page].refs; }
  KvPageCounters counters() const;
  const KvPagesConfig& config() const { return config_; }

 private:
  struct Page {
    int refs = 0;
    bool cached = false;          // published in `by_hash_`
    uint64_t hash = 0;            // chain hash, when cached
    uint64_t parent_hash = 0;     // the chain hash of the page before it
    std::vector<int32_t> tokens;  // when cached, to tell hash collisions apart
    int depth = 0;                // index in the chain
    uint64_t last_use = 0;
  };
  struct Sequence {
    std::vector<int32_t> tokens;
    std::vector<int> table;
    std::vector<uint64_t> chain;  // chain hashes of the leading full pages published or matched
    int max_new_tokens = 0;
    int prompt_tokens = 0;
    uint64_t admitted = 0;  // admission order
  };
  // Evictable pages, least recently used first, deeper first among equals.
  using EvictKey = std::tuple<uint64_t, int, int>;  // (last_use, -depth, page)

  explicit KvPageOwner(KvPagesConfig config);
  int PagesFor(int tokens) const { return (tokens + config_.page_size - 1) / config_.page_size; }
  // The cached pages that start `prompt` (rule 3), in order.
  std::vector<int> MatchPrefix(absl::Span<const int32_t> prompt, bool use_cache = true) const;
  int Available() const { return static_cast<int>(free_.size() + evictable_.size()); }
  // Pages the running sequences may add within the margin.
  int RunningMargin() const;
  int MarginPages(const Sequence& s) const;
  int TakePage();
  void Ref(int page);
  void Unref(int page);
  EvictKey KeyOf(int page) const;

  KvPagesConfig config_;
  std::vector<Page> pages_;
  std::vector<int> free_;  // never cached or evicted, popped from the back
  std::set<EvictKey> evictable_;
  absl::flat_hash_map<uint64_t, std::vector<int>> by_hash_;  // chain hash -> cached pages
  std::map<uint64_t, Sequence> seqs_;
  uint64_t clock_ = 0;
  uint64_t admissions_ = 0;
  KvPageCounters counters_;
};

}  // namespace tandem
