#include "coordinator/kv_pages.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"

namespace tandem {
namespace {

uint64_t Mix(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t DefaultPageHash(uint64_t parent, absl::Span<const int32_t> tokens) {
  uint64_t h = Mix(parent + 0x9e3779b97f4a7c15ULL);
  for (int32_t t : tokens) h = Mix(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(t)) + 1));
  return h;
}

absl::StatusOr<KvPageOwner> KvPageOwner::Create(KvPagesConfig config) {
  if (config.num_pages < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("kv pages: num_pages is %d; the pool needs at least 1 page (give the "
                        "KV-cache more memory or lower page_size)",
                        config.num_pages));
  }
  if (config.page_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("kv pages: page_size is %d; it must be >= 1 token", config.page_size));
  }
  if (config.max_seq_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("kv pages: max_seq_len is %d; it must be >= 1", config.max_seq_len));
  }
  if (config.margin_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("kv pages: margin_tokens is %d; it must be >= 0", config.margin_tokens));
  }
  if (!config.hash) return absl::InvalidArgumentError("kv pages: no page hash function");
  return KvPageOwner(std::move(config));
}

KvPageOwner::KvPageOwner(KvPagesConfig config)
    : config_(std::move(config)), pages_(config_.num_pages) {
  // Popped from the back: page 0 is handed out first.
  for (int p = config_.num_pages - 1; p >= 0; --p) free_.push_back(p);
}

absl::Status KvPageOwner::CheckFits(int prompt_tokens, int max_new_tokens) const {
  const int64_t asked = static_cast<int64_t>(prompt_tokens) + max_new_tokens;
  if (asked > config_.max_seq_len) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "request needs %d tokens (prompt %d + max_tokens %d), beyond the context of %d tokens: "
        "shorten the prompt or lower max_tokens",
        asked, prompt_tokens, max_new_tokens, config_.max_seq_len));
  }
  const int64_t capacity = static_cast<int64_t>(config_.num_pages) * config_.page_size;
  if (asked > capacity) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "request needs %d tokens (prompt %d + max_tokens %d), beyond the KV-cache pool of %d "
        "tokens (%d pages of %d): lower max_tokens or give the KV-cache more memory "
        "(kv_memory_fraction)",
        asked, prompt_tokens, max_new_tokens, capacity, config_.num_pages, config_.page_size));
  }
  return absl::OkStatus();
}

std::vector<int> KvPageOwner::MatchPrefix(absl::Span<const int32_t> prompt,
                                          bool use_cache) const {
  std::vector<int> hits;
  if (!config_.prefix_caching || !use_cache || prompt.empty()) return hits;
  const int P = config_.page_size;
  const int limit = (static_cast<int>(prompt.size()) - 1) / P;  // rule 3
  uint64_t parent = 0;
  for (int i = 0; i < limit; ++i) {
    const absl::Span<const int32_t> tokens = prompt.subspan(static_cast<size_t>(i) * P, P);
    const uint64_t h = config_.hash(parent, tokens);
    auto it = by_hash_.find(h);
    if (it == by_hash_.end()) break;
    int found = -1;
    for (int page : it->second) {
      const Page& pg = pages_[page];
      if (pg.parent_hash == parent && pg.depth == i &&
          std::equal(pg.tokens.begin(), pg.tokens.end(), tokens.begin(), tokens.end())) {
        found = page;
        break;
      }
    }
    if (found < 0) break;  // a hash collision or a different chain: a miss
    hits.push_back(found);
    parent = h;
  }
  return hits;
}

int KvPageOwner::CachedPrefixTokens(absl::Span<const int32_t> prompt) const {
  return static_cast<int>(MatchPrefix(prompt).size()) * config_.page_size;
}

int KvPageOwner::MarginPages(const Sequence& s) const {
  const int len = static_cast<int>(s.tokens.size());
  const int left = std::max(0, s.prompt_tokens + s.max_new_tokens - len);
  return std::max(
      0, PagesFor(len + std::min(left, config_.margin_tokens)) - static_cast<int>(s.table.size()));
}

int KvPageOwner::RunningMargin() const {
  int pages = 0;
  for (const auto& [id, s] : seqs_) pages += MarginPages(s);
  return pages;
}

bool KvPageOwner::CanAdmit(absl::Span<const int32_t> prompt, int max_new_tokens,
                           bool use_cache) const {
  if (prompt.empty() || !CheckFits(static_cast<int>(prompt.size()), max_new_tokens).ok()) {
    return false;
  }
  const std::vector<int> hits = MatchPrefix(prompt, use_cache);
  int hit_evictable = 0;
  for (int page : hits) hit_evictable += pages_[page].refs == 0;
  const int len = static_cast<int>(prompt.size());
  const int own = PagesFor(len + std::min(max_new_tokens, config_.margin_tokens)) -
                  static_cast<int>(hits.size());
  return own + RunningMargin() <= Available() - hit_evictable;
}

absl::StatusOr<int> KvPageOwner::Admit(uint64_t seq, absl::Span<const int32_t> prompt,
                                       int max_new_tokens, bool use_cache) {
  if (seqs_.count(seq)) {
    return absl::AlreadyExistsError(
        absl::StrFormat("kv pages: sequence %d is already admitted", seq));
  }
  if (prompt.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat("kv pages: sequence %d has no prompt", seq));
  }
  const int len = static_cast<int>(prompt.size());
  if (absl::Status fits = CheckFits(len, max_new_tokens); !fits.ok()) return fits;
  if (!CanAdmit(prompt, max_new_tokens, use_cache)) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "kv pages: sequence %d (%d prompt tokens) does not fit now: %d pages free or evictable, "
        "%d reserved for running sequences; wait for one to end",
        seq, len, Available(), RunningMargin()));
  }
  const std::vector<int> hits = MatchPrefix(prompt, use_cache);
  Sequence s;
  s.tokens.assign(prompt.begin(), prompt.end());
  s.max_new_tokens = max_new_tokens;
  s.prompt_tokens = len;
  s.admitted = ++admissions_;
  for (int page : hits) {  // before taking pages, so that no hit is evicted for this sequence
    Ref(page);
    s.table.push_back(page);
    s.chain.push_back(pages_[page].hash);
  }
  while (static_cast<int>(s.table.size()) < PagesFor(len)) {
    const int page = TakePage();
    Ref(page);
    s.table.push_back(page);
  }
  const int cached = static_cast<int>(hits.size()) * config_.page_size;
  if (config_.prefix_caching && use_cache) {
    ++counters_.prefix_queries;
    counters_.prefix_query_tokens += len;
    counters_.prefix_hits += cached > 0;
    counters_.prefix_hit_tokens += cached;
  }
  seqs_.emplace(seq, std::move(s));
  return cached;
}

absl::StatusOr<int> KvPageOwner::Fork(uint64_t parent, uint64_t child, int max_new_tokens) {
  auto pit = seqs_.find(parent);
  if (pit == seqs_.end()) {
    return absl::NotFoundError(absl::StrFormat("kv pages: no sequence %d to fork", parent));
  }
  if (seqs_.count(child)) {
    return absl::AlreadyExistsError(
        absl::StrFormat("kv pages: sequence %d is already admitted", child));
  }
  const Sequence& p = pit->second;
  const int len = static_cast<int>(p.tokens.size());
  const int shared = (len - 1) / config_.page_size;
  Sequence s;
  s.tokens = p.tokens;
  s.max_new_tokens = max_new_tokens;
  s.prompt_tokens = len;
  const int own = PagesFor(len + std::min(max_new_tokens, config_.margin_tokens)) - shared;
  if (own + RunningMargin() > Available()) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("kv pages: fork %d of %d needs %d pages of its own, %d free or evictable",
                        child, parent, own, Available()));
  }
  s.admitted = ++admissions_;
  s.table.assign(p.table.begin(), p.table.begin() + shared);
  s.chain.assign(p.chain.begin(), p.chain.begin() + std::min<size_t>(p.chain.size(), shared));
  for (int page : s.table) Ref(page);
  while (static_cast<int>(s.table.size()) < PagesFor(len)) {
    const int page = TakePage();
    Ref(page);
    s.table.push_back(page);
  }
  seqs_.emplace(child, std::move(s));
  return shared * config_.page_size;
}

absl::Status KvPageOwner::Append(uint64_t seq, absl::Span<const int32_t> tokens) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) {
    return absl::NotFoundError(absl::StrFormat("kv pages: no sequence %d to extend", seq));
  }
  Sequence& s = it->second;
  const int len = static_cast<int>(s.tokens.size() + tokens.size());
  if (len > config_.max_seq_len) {
    return absl::OutOfRangeError(
        absl::StrFormat("kv pages: sequence %d would hold %d tokens, beyond the context of %d", seq,
                        len, config_.max_seq_len));
  }
  const int needed = PagesFor(len) - static_cast<int>(s.table.size());
  if (needed > Available()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "kv pages: sequence %d needs %d more pages, %d free or evictable; preempt one", seq, needed,
        Available()));
  }
  for (int i = 0; i < needed; ++i) {
    const int page = TakePage();
    Ref(page);
    s.table.push_back(page);
  }
  s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
  return absl::OkStatus();
}

void KvPageOwner::MarkComputed(uint64_t seq, int tokens) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end() || !config_.prefix_caching) return;
  Sequence& s = it->second;
  const int P = config_.page_size;
  const int full = std::min<int>(tokens, static_cast<int>(s.tokens.size())) / P;
  for (int i = static_cast<int>(s.chain.size()); i < full; ++i) {
    const uint64_t parent = i == 0 ? 0 : s.chain[i - 1];
    const absl::Span<const int32_t> page_tokens =
        absl::MakeConstSpan(s.tokens).subspan(static_cast<size_t>(i) * P, P);
    const uint64_t h = config_.hash(parent, page_tokens);
    s.chain.push_back(h);
    Page& pg = pages_[s.table[i]];
    if (pg.cached) continue;  // shared with the sequence that published it
    std::vector<int>& same_hash = by_hash_[h];
    const bool twin = std::any_of(same_hash.begin(), same_hash.end(), [&](int other) {
      const Page& o = pages_[other];
      return o.parent_hash == parent && o.depth == i &&
             std::equal(o.tokens.begin(), o.tokens.end(), page_tokens.begin(), page_tokens.end());
    });
    if (twin) continue;  // computed twice concurrently: the first copy is the cached one
    pg.cached = true;
    pg.hash = h;
    pg.parent_hash = parent;
    pg.depth = i;
    pg.tokens.assign(page_tokens.begin(), page_tokens.end());
    same_hash.push_back(s.table[i]);
  }
}

bool KvPageOwner::Free(uint64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return false;
  ++clock_;
  for (auto page = it->second.table.rbegin(); page != it->second.table.rend(); ++page) {
    Unref(*page);
  }
  seqs_.erase(it);
  return true;
}

std::optional<uint64_t> KvPageOwner::PreemptionVictim() const {
  std::optional<uint64_t> newest;
  uint64_t admitted = 0;
  for (const auto& [id, s] : seqs_) {
    if (s.admitted > admitted) {
      admitted = s.admitted;
      newest = id;
    }
  }
  return newest;
}

bool KvPageOwner::Preempt(uint64_t seq) {
  if (!Free(seq)) return false;
  ++counters_.preemptions;
  return true;
}

absl::Span<const int> KvPageOwner::BlockTable(uint64_t seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return {};
  return it->second.table;
}

int KvPageOwner::NumTokens(uint64_t seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? 0 : static_cast<int>(it->second.tokens.size());
}

KvPageCounters KvPageOwner::counters() const {
  KvPageCounters c = counters_;
  c.pages_total = config_.num_pages;
  c.pages_cached = static_cast<int64_t>(evictable_.size());
  c.pages_free = static_cast<int64_t>(free_.size());
  c.pages_used = c.pages_total - c.pages_cached - c.pages_free;
  return c;
}

KvPageOwner::EvictKey KvPageOwner::KeyOf(int page) const {
  return {pages_[page].last_use, -pages_[page].depth, page};
}

int KvPageOwner::TakePage() {
  if (!free_.empty()) {
    const int page = free_.back();
    free_.pop_back();
    return page;
  }
  // Callers check Available() first.
  const int page = std::get<2>(*evictable_.begin());
  evictable_.erase(evictable_.begin());
  Page& pg = pages_[page];
  std::vector<int>& same_hash = by_hash_[pg.hash];
  same_hash.erase(std::find(same_hash.begin(), same_hash.end(), page));
  if (same_hash.empty()) by_hash_.erase(pg.hash);
  pg = Page();
  return page;
}

void KvPageOwner::Ref(int page) {
  Page& pg = pages_[page];
  if (pg.refs == 0 && pg.cached) evictable_.erase(KeyOf(page));
  ++pg.refs;
}

void KvPageOwner::Unref(int page) {
  Page& pg = pages_[page];
  if (--pg.refs > 0) return;
  if (pg.cached) {
    pg.last_use = clock_;
    evictable_.insert(KeyOf(page));
  } else {
    free_.push_back(page);
  }
}

}  // namespace tandem
