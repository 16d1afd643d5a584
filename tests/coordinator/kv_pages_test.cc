#include "coordinator/kv_pages.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

KvPageOwner MakeOwner(int num_pages, int page_size = 4, int max_seq_len = 1024,
                      int margin_tokens = 0) {
  KvPagesConfig c;
  c.num_pages = num_pages;
  c.page_size = page_size;
  c.max_seq_len = max_seq_len;
  c.margin_tokens = margin_tokens;
  auto owner = KvPageOwner::Create(c);
  EXPECT_TRUE(owner.ok()) << owner.status();
  return *std::move(owner);
}

std::vector<int32_t> Range(int from, int count) {
  std::vector<int32_t> v(count);
  std::iota(v.begin(), v.end(), from);
  return v;
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Admits `seq` and marks its whole prompt computed, as after its prefill.
int AdmitComputed(KvPageOwner& owner, uint64_t seq, const std::vector<int32_t>& prompt,
                  int max_new = 0) {
  auto cached = owner.Admit(seq, prompt, max_new);
  EXPECT_TRUE(cached.ok()) << cached.status();
  owner.MarkComputed(seq, static_cast<int>(prompt.size()));
  return cached.ok() ? *cached : -1;
}

TEST(KvPagesTest, CreateRejectsAnEmptyPoolNamingTheField) {
  KvPagesConfig c;
  c.num_pages = 0;
  c.max_seq_len = 16;
  auto owner = KvPageOwner::Create(c);
  ASSERT_FALSE(owner.ok());
  EXPECT_THAT(owner.status().message(), HasSubstr("num_pages"));
}

TEST(KvPagesTest, PromptGetsPagesForItsTokensOnlyAndAppendGrowsPageByPage) {
  KvPageOwner owner = MakeOwner(8);
  ASSERT_TRUE(owner.Admit(1, Range(0, 5), 8).ok());
  EXPECT_EQ(owner.BlockTable(1).size(), 2u);         // 5 tokens of 4 per page
  ASSERT_TRUE(owner.Append(1, Range(100, 3)).ok());  // 8 tokens: still 2 pages
  EXPECT_EQ(owner.BlockTable(1).size(), 2u);
  ASSERT_TRUE(owner.Append(1, Range(200, 1)).ok());  // 9th token opens a third page
  EXPECT_EQ(owner.BlockTable(1).size(), 3u);
  EXPECT_EQ(owner.counters().pages_used, 3);
  EXPECT_EQ(owner.counters().pages_free, 5);
}

TEST(KvPagesTest, FreeReturnsUncachedPagesToThePool) {
  KvPageOwner owner = MakeOwner(4);
  ASSERT_TRUE(owner.Admit(1, Range(0, 9), 0).ok());  // not computed: nothing published
  EXPECT_EQ(owner.counters().pages_used, 3);
  EXPECT_TRUE(owner.Free(1));
  EXPECT_FALSE(owner.Free(1));
  const KvPageCounters c = owner.counters();
  EXPECT_EQ(c.pages_used, 0);
  EXPECT_EQ(c.pages_cached, 0);
  EXPECT_EQ(c.pages_free, 4);
}

TEST(KvPagesTest, SequencesSharingAPromptPrefixShareItsFullPages) {
  KvPageOwner owner = MakeOwner(16);
  const std::vector<int32_t> system = Range(0, 8);  // two full pages
  EXPECT_EQ(AdmitComputed(owner, 1, Concat(system, {50, 51, 52})), 0);
  EXPECT_EQ(AdmitComputed(owner, 2, Concat(system, {60, 61})), 8);
  const std::vector<int> a(owner.BlockTable(1).begin(), owner.BlockTable(1).end());
  const std::vector<int> b(owner.BlockTable(2).begin(), owner.BlockTable(2).end());
  EXPECT_EQ(a[0], b[0]);
  EXPECT_EQ(a[1], b[1]);
  EXPECT_NE(a[2], b[2]);  // the partial last page is each one's own
  EXPECT_EQ(owner.RefCount(a[0]), 2);
  EXPECT_EQ(owner.RefCount(a[2]), 1);
  EXPECT_EQ(owner.counters().prefix_hit_tokens, 8);
  EXPECT_EQ(owner.counters().prefix_hits, 1);
  EXPECT_EQ(owner.counters().prefix_queries, 2);
  owner.Free(1);
  EXPECT_EQ(owner.RefCount(a[0]), 1);
}

TEST(KvPagesTest, AWholePromptIsNeverCachedTheLastTokenIsComputed) {
  KvPageOwner owner = MakeOwner(16);
  const std::vector<int32_t> prompt = Range(0, 8);
  AdmitComputed(owner, 1, prompt);
  owner.Free(1);
  // 8 tokens, all cached, but the last must produce logits: its page is recomputed.
  EXPECT_EQ(owner.CachedPrefixTokens(prompt), 4);
  EXPECT_EQ(owner.CachedPrefixTokens(Range(0, 9)), 8);
}

TEST(KvPagesTest, OnlyComputedPagesArePublished) {
  KvPageOwner owner = MakeOwner(16);
  ASSERT_TRUE(owner.Admit(1, Range(0, 13), 4).ok());
  owner.MarkComputed(1, 6);  // first page computed, second half done
  EXPECT_EQ(owner.CachedPrefixTokens(Range(0, 13)), 4);
  owner.MarkComputed(1, 13);
  EXPECT_EQ(owner.CachedPrefixTokens(Range(0, 13)), 12);
}

TEST(KvPagesTest, SameTokensAfterADifferentPrefixAreADifferentPage) {
  KvPageOwner owner = MakeOwner(16);
  const std::vector<int32_t> tail = {7, 7, 7, 7};
  AdmitComputed(owner, 1, Concat(Concat({1, 1, 1, 1}, tail), {9}));
  EXPECT_EQ(owner.CachedPrefixTokens(Concat(Concat({2, 2, 2, 2}, tail), {9})), 0);
  EXPECT_EQ(owner.CachedPrefixTokens(Concat(Concat({1, 1, 1, 1}, tail), {9})), 8);
}

TEST(KvPagesTest, AHashCollisionIsAMiss) {
  KvPagesConfig c;
  c.num_pages = 16;
  c.page_size = 4;
  c.max_seq_len = 64;
  c.hash = [](uint64_t, absl::Span<const int32_t>) { return uint64_t{42}; };  // all collide
  auto owner = KvPageOwner::Create(c);
  ASSERT_TRUE(owner.ok());
  AdmitComputed(*owner, 1, {1, 2, 3, 4, 5, 6, 7, 8, 0});
  EXPECT_EQ(owner->CachedPrefixTokens({1, 2, 3, 5, 5, 6, 7, 8, 0}), 0);
  EXPECT_EQ(owner->CachedPrefixTokens({1, 2, 3, 4, 5, 6, 7, 9, 0}), 4);
  EXPECT_EQ(owner->CachedPrefixTokens({1, 2, 3, 4, 5, 6, 7, 8, 0}), 8);
  // A second chain whose pages collide with the first's is cached beside it.
  AdmitComputed(*owner, 2, {9, 9, 9, 9, 5, 6, 7, 8, 0});
  EXPECT_EQ(owner->CachedPrefixTokens({9, 9, 9, 9, 5, 6, 7, 8, 0}), 8);
  EXPECT_EQ(owner->CachedPrefixTokens({1, 2, 3, 4, 5, 6, 7, 8, 0}), 8);
}

TEST(KvPagesTest, EndedSequencesStayCachedUntilEvictedLeastRecentlyUsedLeavesFirst) {
  KvPageOwner owner = MakeOwner(4);
  AdmitComputed(owner, 1, Range(0, 9));    // 2 full pages + 1
  owner.Free(1);                           // older: pages A0, A1
  AdmitComputed(owner, 2, Range(100, 5));  // 1 full page + 1
  owner.Free(2);                           // newer: page B0
  KvPageCounters c = owner.counters();
  EXPECT_EQ(c.pages_cached, 3);
  EXPECT_EQ(c.pages_free, 1);
  // Two new pages: the free one, then A1 (older than B0, and A0's child).
  ASSERT_TRUE(owner.Admit(3, Range(500, 5), 0).ok());
  EXPECT_EQ(owner.CachedPrefixTokens(Range(0, 9)), 4);
  EXPECT_EQ(owner.CachedPrefixTokens(Range(100, 5)), 4);
  // One more: A0 goes before B0.
  ASSERT_TRUE(owner.Append(3, Range(600, 4)).ok());
  EXPECT_EQ(owner.CachedPrefixTokens(Range(0, 9)), 0);
  EXPECT_EQ(owner.CachedPrefixTokens(Range(100, 5)), 4);
}

TEST(KvPagesTest, UsingACachedPrefixMakesItRecent) {
  KvPageOwner owner = MakeOwner(3);
  AdmitComputed(owner, 1, Range(0, 5));
  owner.Free(1);
  AdmitComputed(owner, 2, Range(100, 5));
  owner.Free(2);
  EXPECT_EQ(AdmitComputed(owner, 3, Range(0, 5)), 4);  // touches page 0..3
  owner.Free(3);
  ASSERT_TRUE(owner.Admit(4, Range(900, 5), 0).ok());  // the free page, then evicts 100..103
  EXPECT_EQ(owner.CachedPrefixTokens(Range(0, 5)), 4);
  EXPECT_EQ(owner.CachedPrefixTokens(Range(100, 5)), 0);
}

TEST(KvPagesTest, APrefixEvictedBetweenLookupAndAdmissionIsComputedAgain) {
  KvPageOwner owner = MakeOwner(3);
  AdmitComputed(owner, 1, Range(0, 5));
  owner.Free(1);
  const std::vector<int32_t> prompt = Concat(Range(0, 4), {77});
  ASSERT_EQ(owner.CachedPrefixTokens(prompt), 4);
  ASSERT_TRUE(owner.Admit(2, Range(300, 12), 0).ok());  // takes every page, evicting the prefix
  owner.Free(2);
  auto cached = owner.Admit(3, prompt, 0);
  ASSERT_TRUE(cached.ok()) << cached.status();
  EXPECT_EQ(*cached, 0);
  EXPECT_EQ(owner.BlockTable(3).size(), 2u);
  EXPECT_EQ(owner.counters().prefix_hit_tokens, 0);
}

TEST(KvPagesTest, AdmissionCountsEvictablePagesAndKeepsAMarginForRunningSequences) {
  KvPageOwner owner = MakeOwner(6, 4, 1024, /*margin_tokens=*/4);
  ASSERT_TRUE(owner.Admit(1, Range(0, 8), 12).ok());  // 2 pages, margin 1
  // 3 pages for the prompt + 1 of its own margin + 1 for sequence 1: 5 > 4 left.
  EXPECT_FALSE(owner.CanAdmit(Range(100, 9), 12));
  auto refused = owner.Admit(2, Range(100, 9), 12);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(owner.counters().pages_used, 2);       // a refused admission changes nothing
  EXPECT_TRUE(owner.CanAdmit(Range(100, 8), 12));  // 2 + 1 + 1 = 4
  // A request with nothing to generate needs no margin of its own: 3 + 0 + 1 = 4.
  EXPECT_TRUE(owner.CanAdmit(Range(100, 9), 0));
}

TEST(KvPagesTest, ARequestThatCanNeverFitIsRefusedNamingTokensAndCapacity) {
  KvPageOwner owner = MakeOwner(4, 4, 100);
  absl::Status pool = owner.CheckFits(10, 7);  // 17 tokens > 16 in the pool
  EXPECT_EQ(pool.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pool.message(), HasSubstr("17 tokens"));
  EXPECT_THAT(pool.message(), HasSubstr("pool of 16 tokens"));
  absl::Status context = MakeOwner(100, 4, 20).CheckFits(15, 6);
  EXPECT_THAT(context.message(), HasSubstr("21 tokens"));
  EXPECT_THAT(context.message(), HasSubstr("context of 20"));
  EXPECT_TRUE(owner.CheckFits(10, 6).ok());
  EXPECT_EQ(owner.Admit(1, Range(0, 10), 7).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(KvPagesTest, WhenASequenceCannotGrowTheNewestIsPreempted) {
  KvPageOwner owner = MakeOwner(4);
  ASSERT_TRUE(owner.Admit(1, Range(0, 4), 8).ok());
  ASSERT_TRUE(owner.Admit(2, Range(10, 4), 8).ok());
  ASSERT_TRUE(owner.Admit(3, Range(20, 4), 8).ok());
  ASSERT_TRUE(owner.Append(1, {1}).ok());
  absl::Status grow = owner.Append(2, {1});
  EXPECT_EQ(grow.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(owner.NumTokens(2), 4);  // a failed extension changes nothing
  ASSERT_EQ(owner.PreemptionVictim(), 3u);
  EXPECT_TRUE(owner.Preempt(3));
  EXPECT_TRUE(owner.Append(2, {1}).ok());
  EXPECT_EQ(owner.PreemptionVictim(), 2u);
  EXPECT_EQ(owner.counters().preemptions, 1);
  EXPECT_TRUE(owner.BlockTable(3).empty());
}

TEST(KvPagesTest, ForkSharesThePromptsFullPagesAndOwnsItsTail) {
  KvPageOwner owner = MakeOwner(16);
  ASSERT_TRUE(owner.Admit(1, Range(0, 10), 8).ok());
  auto shared = owner.Fork(1, 2, 8);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_EQ(*shared, 8);
  const auto a = owner.BlockTable(1), b = owner.BlockTable(2);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_THAT(std::vector<int>(b.begin(), b.begin() + 2), ElementsAre(a[0], a[1]));
  EXPECT_NE(a[2], b[2]);
  EXPECT_EQ(owner.counters().pages_used, 4);
  ASSERT_TRUE(owner.Append(2, {5}).ok());
  EXPECT_EQ(owner.NumTokens(1), 10);  // the parent's tokens are its own
}

TEST(KvPagesTest, PrefixCachingOffSharesNothingAfterASequenceEnds) {
  KvPagesConfig c;
  c.num_pages = 8;
  c.page_size = 4;
  c.max_seq_len = 64;
  c.prefix_caching = false;
  auto owner = KvPageOwner::Create(c);
  ASSERT_TRUE(owner.ok());
  EXPECT_EQ(AdmitComputed(*owner, 1, Range(0, 9)), 0);
  EXPECT_EQ(AdmitComputed(*owner, 2, Range(0, 9)), 0);
  owner->Free(1);
  EXPECT_EQ(owner->counters().pages_cached, 0);
  EXPECT_EQ(owner->counters().prefix_queries, 0);
}

// A second statement of the rules, as simple as can be: pages are identified by the whole token
// prefix up to their end, found by scanning; eviction scans for the oldest, deepest page.
class ReferenceOwner {
  struct RefPage {
    int refs = 0;
    bool cached = false;
    std::vector<int32_t> prefix;
    int depth = 0;
    uint64_t last_use = 0;
  };
  struct Seq {
    std::vector<int32_t> tokens;
    std::vector<int> table;
    int limit = 0;
    uint64_t order = 0;
    int considered = 0;  // leading full pages published, matched or found already cached
  };

 public:
  ReferenceOwner(int num_pages, int page_size, int margin)
      : P_(page_size), margin_(margin), pages_(num_pages) {}

  int Lookup(const std::vector<int32_t>& prompt) const {
    int n = 0;
    for (int i = 0; i < (static_cast<int>(prompt.size()) - 1) / P_; ++i) {
      if (Find(Prefix(prompt, i)) < 0) break;
      ++n;
    }
    return n;
  }
  int Available() const {
    int n = 0;
    for (const RefPage& p : pages_) n += p.refs == 0;
    return n;
  }
  int Need(int tokens) const { return (tokens + P_ - 1) / P_; }
  int Margin(const Seq& s) const {
    const int len = static_cast<int>(s.tokens.size());
    return std::max(0, Need(len + std::min(std::max(0, s.limit - len), margin_)) -
                           static_cast<int>(s.table.size()));
  }
  int RunningMargin() const {
    int n = 0;
    for (const auto& [id, s] : seqs_) n += Margin(s);
    return n;
  }
  // -1 when refused, else the cached tokens.
  int Admit(uint64_t id, const std::vector<int32_t>& prompt, int max_new) {
    const int hits = Lookup(prompt);
    int hit_free = 0;
    for (int i = 0; i < hits; ++i) hit_free += pages_[Find(Prefix(prompt, i))].refs == 0;
    const int len = static_cast<int>(prompt.size());
    if (Need(len + std::min(max_new, margin_)) - hits + RunningMargin() > Available() - hit_free) {
      return -1;
    }
    Seq s{prompt, {}, len + max_new, ++admissions_, hits};
    for (int i = 0; i < hits; ++i) {
      const int page = Find(Prefix(prompt, i));
      ++pages_[page].refs;
      s.table.push_back(page);
    }
    while (static_cast<int>(s.table.size()) < Need(len)) s.table.push_back(Take());
    seqs_[id] = s;
    return hits * P_;
  }
  bool Append(uint64_t id, int32_t token) {
    Seq& s = seqs_[id];
    if (Need(static_cast<int>(s.tokens.size()) + 1) > static_cast<int>(s.table.size())) {
      if (Available() == 0) return false;
      s.table.push_back(Take());
    }
    s.tokens.push_back(token);
    return true;
  }
  void MarkComputed(uint64_t id) {
    Seq& s = seqs_[id];
    // Each full page is considered once, when it is first computed.
    for (int i = s.considered; i < static_cast<int>(s.tokens.size()) / P_; ++i, ++s.considered) {
      RefPage& p = pages_[s.table[i]];
      const std::vector<int32_t> prefix = Prefix(s.tokens, i);
      if (p.cached || Find(prefix) >= 0) continue;
      p.cached = true;
      p.prefix = prefix;
      p.depth = i;
    }
  }
  void Free(uint64_t id) {
    ++clock_;
    for (int page : seqs_[id].table) {
      if (--pages_[page].refs == 0) pages_[page].last_use = clock_;
    }
    seqs_.erase(id);
  }
  uint64_t Newest() const {
    uint64_t best = 0, id = 0;
    for (const auto& [sid, s] : seqs_) {
      if (s.order > best) best = s.order, id = sid;
    }
    return id;
  }
  int Used() const { return static_cast<int>(pages_.size()) - Available(); }
  int Cached() const {
    int n = 0;
    for (const RefPage& p : pages_) n += p.refs == 0 && p.cached;
    return n;
  }
  size_t TableSize(uint64_t id) const { return seqs_.at(id).table.size(); }

 private:
  std::vector<int32_t> Prefix(const std::vector<int32_t>& t, int page) const {
    return std::vector<int32_t>(t.begin(), t.begin() + (page + 1) * P_);
  }
  int Find(const std::vector<int32_t>& prefix) const {
    for (size_t p = 0; p < pages_.size(); ++p) {
      if (pages_[p].cached && pages_[p].prefix == prefix) return static_cast<int>(p);
    }
    return -1;
  }
  int Take() {
    int best = -1;
    for (size_t p = 0; p < pages_.size(); ++p) {
      const RefPage& c = pages_[p];
      if (c.refs != 0) continue;
      if (!c.cached) {  // a free page before any eviction
        best = static_cast<int>(p);
        break;
      }
      if (best < 0 || std::make_pair(c.last_use, -c.depth) <
                          std::make_pair(pages_[best].last_use, -pages_[best].depth)) {
        best = static_cast<int>(p);
      }
    }
    pages_[best] = RefPage();
    pages_[best].refs = 1;
    return best;
  }

  int P_, margin_;
  std::vector<RefPage> pages_;
  std::map<uint64_t, Seq> seqs_;
  uint64_t clock_ = 0, admissions_ = 0;
};

TEST(KvPagesTest, RandomOperationsFollowTheReferenceModel) {
  constexpr int kPages = 24, kPageSize = 2, kMargin = 2;
  std::mt19937 rng(1234);
  KvPageOwner owner = MakeOwner(kPages, kPageSize, 64, kMargin);
  ReferenceOwner ref(kPages, kPageSize, kMargin);
  // Prompts drawn from a few shared stems and a vocabulary of 3, so that prefixes repeat.
  const std::vector<std::vector<int32_t>> stems = {{}, {0, 1, 2, 0}, {0, 1, 2, 1, 1, 1}, {2, 2}};
  std::vector<uint64_t> live;
  uint64_t next_id = 1;
  int64_t hit_tokens = 0;
  for (int step = 0; step < 3000; ++step) {
    const int op = std::uniform_int_distribution<int>(0, 9)(rng);
    if (op < 3 || live.empty()) {
      std::vector<int32_t> prompt = stems[rng() % stems.size()];
      const int extra = 1 + static_cast<int>(rng() % 6);
      for (int i = 0; i < extra; ++i) prompt.push_back(static_cast<int32_t>(rng() % 3));
      const int max_new = static_cast<int>(rng() % 8);
      const uint64_t id = next_id++;
      auto got = owner.Admit(id, prompt, max_new);
      const int want = ref.Admit(id, prompt, max_new);
      ASSERT_EQ(got.ok(), want >= 0) << "step " << step << ": " << got.status();
      if (want < 0) continue;
      ASSERT_EQ(*got, want) << "step " << step;
      hit_tokens += want;
      live.push_back(id);
      if (rng() % 2) {  // prefill done
        owner.MarkComputed(id, static_cast<int>(prompt.size()));
        ref.MarkComputed(id);
      }
    } else if (op < 7) {
      const uint64_t id = live[rng() % live.size()];
      const int32_t token = static_cast<int32_t>(rng() % 3);
      if (owner.NumTokens(id) >= 64) continue;
      const bool ok = owner.Append(id, {token}).ok();
      ASSERT_EQ(ok, ref.Append(id, token)) << "step " << step;
      if (ok) {
        owner.MarkComputed(id, owner.NumTokens(id));
        ref.MarkComputed(id);
      } else {
        const uint64_t victim = *owner.PreemptionVictim();
        ASSERT_EQ(victim, ref.Newest());
        owner.Preempt(victim);
        ref.Free(victim);
        live.erase(std::find(live.begin(), live.end(), victim));
      }
    } else {
      const size_t at = rng() % live.size();
      owner.Free(live[at]);
      ref.Free(live[at]);
      live.erase(live.begin() + at);
    }
    const KvPageCounters c = owner.counters();
    ASSERT_EQ(c.pages_used, ref.Used()) << "step " << step;
    ASSERT_EQ(c.pages_cached, ref.Cached()) << "step " << step;
    ASSERT_EQ(c.pages_used + c.pages_cached + c.pages_free, kPages);
    std::set<int> held;
    for (uint64_t id : live) {
      const auto table = owner.BlockTable(id);
      ASSERT_EQ(table.size(), ref.TableSize(id)) << "step " << step;
      // At most one page per sequence holds unused rows.
      ASSERT_LT(static_cast<int>(table.size()) * kPageSize - owner.NumTokens(id), kPageSize);
      held.insert(table.begin(), table.end());
    }
    for (int page : held) ASSERT_GT(owner.RefCount(page), 0);
    ASSERT_EQ(static_cast<int64_t>(held.size()), c.pages_used);
  }
  EXPECT_EQ(owner.counters().prefix_hit_tokens, hit_tokens);
  EXPECT_GT(hit_tokens, 0);
  EXPECT_GT(owner.counters().preemptions, 0);
}

}  // namespace
}  // namespace tandem
