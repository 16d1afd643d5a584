// The scheduler on a paged KV-cache (coordinator/scheduler.h, docs/paged-kv.md): each pipeline's
// KvPageOwner admits sequences by free pages, skips their cached prompt tokens, grows them page
// by page as steps are formed, and preempts the newest sequence when one cannot grow.
#include <algorithm>

#include "absl/status/status.h"
#include "common/metrics.h"
#include "coordinator/scheduler.h"

namespace tandem {

absl::Status Scheduler::CheckFits(int prompt_tokens, int max_new_tokens) const {
  absl::Status first = absl::OkStatus();
  for (const auto& [id, p] : pipelines_) {
    if (!p.pages) continue;
    absl::Status fits = p.pages->CheckFits(prompt_tokens, max_new_tokens);
    if (fits.ok()) return fits;
    if (first.ok()) first = std::move(fits);
  }
  return first;
}

std::optional<KvPageCounters> Scheduler::kv_page_counters(int id) const {
  auto it = pipelines_.find(id);
  if (it == pipelines_.end() || !it->second.pages) return std::nullopt;
  return it->second.pages->counters();
}

Scheduler::KvNeed Scheduler::NeedOf(const Sequence& seq, std::vector<int32_t>& tokens) const {
  const ValidatedRequest& rq = seq.request->request();
  tokens = rq.prompt;
  tokens.insert(tokens.end(), seq.generated.begin(), seq.generated.end());
  const int len = static_cast<int>(tokens.size());
  const int left = rq.max_new_tokens - static_cast<int>(seq.generated.size());
  // A sequence that still scores its prompt computes all of it.
  return {.tokens = tokens,
          .max_new_tokens = std::max(0, std::min(left, options_.context_length - len)),
          .use_cache = rq.prompt_logprobs < 0 || !seq.generated.empty()};
}

void Scheduler::AdmitPages(Sequence& seq) {
  Pipeline& p = pipelines_.at(seq.pipeline);
  if (!p.pages) return;
  std::vector<int32_t> tokens;
  const KvNeed need = NeedOf(seq, tokens);
  // PlacementForNext chose a pipeline whose owner can admit it, so this succeeds.
  const absl::StatusOr<int> cached =
      p.pages->Admit(seq.id, need.tokens, need.max_new_tokens, need.use_cache);
  seq.kv_known = static_cast<int>(tokens.size());
  if (metrics_ != nullptr && cached.ok() && need.use_cache && options_.prefix_caching) {
    metrics_->CountPrefixLookup(static_cast<int>(tokens.size()), *cached);
  }
  if (!cached.ok() || *cached == 0) return;
  // Its first step starts after the cached prompt tokens (fewer than pending: the last prompt
  // token is always computed).
  seq.position = *cached;
  seq.pending.erase(seq.pending.begin(), seq.pending.begin() + *cached);
}

Scheduler::ForkFrom Scheduler::ForkParentOf(const ValidatedRequest& rq,
                                            const KvNeed& need) const {
  const int len = static_cast<int>(rq.prompt.size());
  const int page = options_.kv_page_size;
  // The parent's full pages within its first len - 1 tokens (the last is always computed).
  const int shared = page > 0 && len > 0 ? (len - 1) / page * page : 0;
  if (shared == 0 || rq.prompt_logprobs >= 0) return {};  // nothing to share, or scores it all
  for (const auto& [id, p] : pipelines_) {
    if (!p.pages || p.draining || p.paused || p.role != PipelineRole::kBoth) continue;
    for (uint64_t seq_id : p.running) {
      Sequence& s = *seqs_.at(seq_id);
      const ValidatedRequest& sr = s.request->request();
      if (s.moving || !s.generated.empty() || sr.request_id != rq.request_id ||
          sr.prompt != rq.prompt || p.pages->NumTokens(s.id) != len) {
        continue;
      }
      // A child reads the shared pages from its first step on: it may only be formed after the
      // steps that write them (every stage runs steps in the order they were formed).
      if (s.position < shared) return {.parent = nullptr, .wait = true};
      if (p.slots.free() == 0 ||
          !p.pages->CanAdmit(need.tokens, need.max_new_tokens, need.use_cache)) {
        return {};
      }
      return {.parent = &s, .wait = false};
    }
  }
  return {};
}

bool Scheduler::ForkPages(Sequence& seq, const Sequence& parent) {
  Pipeline& p = pipelines_.at(seq.pipeline);
  const ValidatedRequest& rq = seq.request->request();
  const int len = static_cast<int>(rq.prompt.size());
  const absl::StatusOr<int> shared = p.pages->Fork(
      parent.id, seq.id, std::max(0, std::min(rq.max_new_tokens, options_.context_length - len)));
  if (!shared.ok()) return false;
  seq.kv_known = len;
  seq.position = *shared;
  seq.pending.erase(seq.pending.begin(), seq.pending.begin() + *shared);
  return true;
}

bool Scheduler::GrowPages(Pipeline& p, Sequence& seq, int n, bool ahead,
                          const std::vector<StepEntry>& step_seqs, std::vector<Sequence*>& ready) {
  const int have = p.pages->NumTokens(seq.id);
  const int more = seq.position + n - have;
  if (more <= 0) return true;  // a prompt's pages come with its admission
  // The tokens at positions [have, position + n): the row's last ones, or the token the step in
  // flight samples, unknown yet.
  std::vector<int32_t> tokens;
  if (ahead) {
    tokens.assign(more, kPreviousSample);
  } else {
    tokens.assign(seq.pending.begin() + (n - more), seq.pending.begin() + n);
  }
  // A victim in the step being formed would write pages that another row of the same step is
  // given; one that scores its prompt and has no token yet would send its prompt logprobs twice.
  auto eligible = [&](uint64_t id) {
    if (id == seq.id) return true;
    auto it = seqs_.find(id);
    // The owner also holds the pages of a hand-off into this pipeline until it ends, whose
    // sequence may have ended meanwhile.
    if (it == seqs_.end()) return false;
    const Sequence& s = *it->second;
    if (s.moving || (s.request->request().prompt_logprobs >= 0 && s.generated.empty())) {
      return false;
    }
    return std::none_of(step_seqs.begin(), step_seqs.end(),
                        [id](const StepEntry& e) { return e.seq == id; });
  };
  while (true) {
    const absl::Status grown = p.pages->Append(seq.id, tokens);
    if (grown.ok()) break;
    // Only ResourceExhausted is possible here: the length rule ends a sequence at the context.
    uint64_t victim = seq.id;  // the last resort, always eligible
    if (std::optional<uint64_t> newest = p.pages->PreemptionVictim();
        newest && eligible(*newest)) {
      victim = *newest;
    } else {
      auto r = std::find_if(p.running.rbegin(), p.running.rend(), eligible);
      if (r != p.running.rend()) victim = *r;
    }
    Sequence& v = *seqs_.at(victim);
    std::erase(ready, &v);
    PreemptSequence(p, v);
    if (&v == &seq) return false;
  }
  if (!ahead && seq.kv_known == have) seq.kv_known = have + more;
  return true;
}

void Scheduler::PreemptSequence(Pipeline& p, Sequence& seq) {
  p.pages->Preempt(seq.id);
  if (metrics_ != nullptr) metrics_->kv_preemptions.Increment();
  p.slots.Free(seq.slot);
  std::erase(p.running, seq.id);
  seq.pipeline = seq.slot = -1;
  Recompute(seq, absl::ResourceExhaustedError("preempted for KV-cache pages"),
            absl::InfinitePast(), /*preempted=*/true);
}

}  // namespace tandem
