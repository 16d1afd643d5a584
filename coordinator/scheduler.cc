// Continuous batching (coordinator/scheduler.h): admission, step formation, results, the end.
#include "coordinator/scheduler.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/metrics.h"

namespace tandem {

Scheduler::Scheduler(SchedulerOptions options, CoordinatorMetrics* metrics)
    : options_(std::move(options)), metrics_(metrics) {}

// ---------------------------------------------------------------------------------------------
// Waiting queue and pipelines

int Scheduler::capacity() const {
  bool prefill = false;
  bool decode = false;
  for (const auto& [id, p] : pipelines_) {
    if (p.draining) continue;
    prefill |= p.role == PipelineRole::kPrefill;
    decode |= p.role == PipelineRole::kDecode;
  }
  // With prefill and decode pipelines serving, a sequence takes a decode slot on admission (set
  // aside while its prompt runs): the decode slots bound what runs at once.
  int slots = 0;
  for (const auto& [id, p] : pipelines_) {
    if (!(prefill && decode && p.role == PipelineRole::kPrefill)) slots += p.slots.capacity();
  }
  return slots;
}

absl::Status Scheduler::CheckRoom(int sequences, int planned_slots) const {
  const int slots = capacity();
  const int waiting =
      options_.max_waiting >= 0 ? options_.max_waiting : DefaultMaxWaiting(planned_slots);
  const int most = std::max(slots, planned_slots) + waiting;
  if (sequences > most) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the request has %d sequences (prompts x n), more than the service can ever hold at once: "
        "%d (%d KV slots: replicas x --max_slots, plus --max_waiting %d); split the request or "
        "raise --max_waiting or --max_slots",
        sequences, most, std::max(slots, planned_slots), waiting));
  }
  if (in_service() + sequences > slots + waiting) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "the service is full: %d of the %d requests it holds (%d KV slots plus --max_waiting %d) "
        "run or wait, and this one has %d; retry later",
        in_service(), slots + waiting, slots, waiting, sequences));
  }
  return absl::OkStatus();
}

std::shared_ptr<RequestState> Scheduler::Enqueue(ValidatedRequest request, absl::Time now) {
  if (request.request_id.empty()) request.request_id = absl::StrCat("req-", next_seq_id_);
  auto state = std::make_shared<RequestState>(std::move(request), now);
  waiting_.push_back(state);
  if (burst_left_ > 0) --burst_left_;  // a successor, perhaps
  return state;
}

void Scheduler::FailWaiting(const absl::Status& why, absl::Time now) {
  std::vector<uint64_t> handing_off;
  for (const auto& [id, pending] : handoffs_) handing_off.push_back(pending.handoff.seq);
  for (uint64_t seq : handing_off) EndSequence(seq, why, FinishReason::kNone, -1, now);
  const std::deque<uint64_t> resumed = resumed_;
  for (uint64_t seq : resumed) EndSequence(seq, why, FinishReason::kNone, -1, now);
  const std::vector<uint64_t> held = held_;
  for (uint64_t seq : held) EndSequence(seq, why, FinishReason::kNone, -1, now);
  for (auto& r : waiting_) r->Finish(why, FinishReason::kNone, -1, now);
  waiting_.clear();
}

void Scheduler::AddPipeline(int id, int stages, PipelineRole role, bool fed_by_last,
                            int kv_pages) {
  auto [it, added] =
      pipelines_.emplace(std::piecewise_construct, std::forward_as_tuple(id),
                         std::forward_as_tuple(stages, options_.max_slots, role, fed_by_last));
  if (options_.kv_page_size > 0 && added) {
    // The coordinator checks that a paged pipeline has pages; a pool that cannot be made
    // admits nothing (every request is then refused by CheckFits's twin in Admit).
    absl::StatusOr<KvPageOwner> owner =
        KvPageOwner::Create({.num_pages = std::max(kv_pages, 1),
                             .page_size = options_.kv_page_size,
                             .max_seq_len = std::max(options_.context_length, 1),
                             .prefix_caching = options_.prefix_caching,
                             .margin_tokens = options_.kv_margin_tokens});
    if (owner.ok()) it->second.pages.emplace(*std::move(owner));
  }
}

void Scheduler::SetRole(int id, PipelineRole role) {
  auto it = pipelines_.find(id);
  if (it != pipelines_.end()) it->second.role = role;
}

PipelineRole Scheduler::role(int id) const {
  auto it = pipelines_.find(id);
  return it == pipelines_.end() ? PipelineRole::kBoth : it->second.role;
}

void Scheduler::RemovePipeline(int id, const absl::Status& why, absl::Time now, bool resume) {
  auto it = pipelines_.find(id);
  if (it == pipelines_.end()) return;
  const std::vector<uint64_t> running = it->second.running;
  for (uint64_t seq_id : running) {
    if (!resume) {
      EndSequence(seq_id, why, FinishReason::kNone, -1, now);
      continue;
    }
    Sequence& seq = *seqs_.at(seq_id);
    it->second.slots.Free(seq.slot);
    seq.pipeline = seq.slot = -1;
    Recompute(seq, why, now);
  }
  pipelines_.erase(it);
}

void Scheduler::Recompute(Sequence& seq, const absl::Status& why, absl::Time now,
                          bool preempted) {
  const ValidatedRequest& rq = seq.request->request();
  ++seq.epoch;
  if (preempted) {
    // Victims never are prompt-logprob sequences without a token (GrowPages), nor past a limit.
  } else if (rq.prompt_logprobs >= 0 && seq.generated.empty()) {
    EndSequence(seq.id, why, FinishReason::kNone, -1, now);
    return;
  }
  if (seq.resumes >= options_.max_resumes) {
    EndSequence(seq.id,
                absl::Status(why.code(), absl::StrFormat("%s (request %s resumed %d times before)",
                                                         why.message(), rq.request_id,
                                                         seq.resumes)),
                FinishReason::kNone, -1, now);
    return;
  }
  // What its lost steps fed and sampled is gone: the KV-cache is rebuilt from every token the
  // sequence has, and the next sample is the one the lost steps would have made.
  ReleaseDecodeSlot(seq);
  seq.handoff = 0;
  if (!preempted) ++seq.resumes;
  seq.moving = false;
  seq.position = seq.in_flight = seq.fed_ahead = 0;
  seq.pending = rq.prompt;
  seq.pending.insert(seq.pending.end(), seq.generated.begin(), seq.generated.end());
  resumed_.push_back(seq.id);
  if (metrics_ != nullptr) {
    metrics_->recomputed_sequences.Increment();
    metrics_->recomputed_tokens.Increment(static_cast<double>(seq.pending.size()));
  }
}

void Scheduler::SetDraining(int id) {
  auto it = pipelines_.find(id);
  if (it != pipelines_.end()) it->second.draining = true;
}

bool Scheduler::draining(int id) const {
  auto it = pipelines_.find(id);
  return it != pipelines_.end() && it->second.draining;
}

int Scheduler::running(int id) const {
  auto it = pipelines_.find(id);
  return it == pipelines_.end() ? 0 : static_cast<int>(it->second.running.size());
}

int Scheduler::used_slots(int id) const {
  auto it = pipelines_.find(id);
  return it == pipelines_.end() ? 0 : it->second.slots.used();
}

int Scheduler::free_slots(int id) const {
  auto it = pipelines_.find(id);
  return it == pipelines_.end() ? 0 : it->second.slots.free();
}

// ---------------------------------------------------------------------------------------------
// Admission and steps

std::optional<Scheduler::Placement> Scheduler::PlacementForNext(bool fed,
                                                                const KvNeed* need) const {
  bool prefill = false;
  bool decode = false;
  for (const auto& [id, p] : pipelines_) {
    if (p.draining) continue;
    prefill |= p.role == PipelineRole::kPrefill;
    decode |= p.role == PipelineRole::kDecode;
  }
  // Among pipelines with room that `take` accepts, the one of the least `load` (the lowest id on
  // ties).
  auto fewest = [this, need](auto take, auto load) -> std::optional<int> {
    std::optional<int> best;
    size_t least = 0;
    for (const auto& [id, p] : pipelines_) {
      if (p.draining || p.slots.free() == 0 || !take(p)) continue;
      if (need != nullptr && p.pages &&
          !p.pages->CanAdmit(need->tokens, need->max_new_tokens, need->use_cache)) {
        continue;
      }
      if (!best || static_cast<size_t>(load(p)) < least) {
        best = id;
        least = static_cast<size_t>(load(p));
      }
    }
    return best;
  };
  auto any = [](const Pipeline&) { return true; };
  auto running = [](const Pipeline& q) { return q.running.size(); };
  auto used = [](const Pipeline& q) { return q.slots.used(); };
  if (!(prefill && decode)) {
    if (std::optional<int> p = fewest(any, running)) return Placement{.pipeline = *p};
    return std::nullopt;
  }
  if (fed) {
    std::optional<int> p =
        fewest([](const Pipeline& q) { return q.role != PipelineRole::kPrefill; }, running);
    if (!p) p = fewest(any, running);
    if (p) return Placement{.pipeline = *p};
    return std::nullopt;
  }
  const std::optional<int> p =
      fewest([](const Pipeline& q) { return q.role == PipelineRole::kPrefill; }, running);
  const std::optional<int> d =
      fewest([](const Pipeline& q) { return q.role == PipelineRole::kDecode; }, used);
  if (!p || !d) return std::nullopt;
  return Placement{.pipeline = *p, .decode = *d};
}

void Scheduler::Place(Sequence& seq, const Placement& to) {
  Pipeline& p = pipelines_.at(to.pipeline);
  seq.pipeline = to.pipeline;
  seq.slot = *p.slots.Allocate();
  p.running.push_back(seq.id);
  if (to.decode >= 0) {
    seq.decode_pipeline = to.decode;
    seq.decode_slot = *pipelines_.at(to.decode).slots.Allocate();
  }
}

void Scheduler::ReleaseDecodeSlot(Sequence& seq) {
  if (seq.decode_pipeline < 0) return;
  auto stream = streams_.find(seq.kv_stream);
  if (stream != streams_.end() && !stream->second.ended) {
    stream->second.orphan = true;  // the slot is the stream's until it ends
  } else if (auto it = pipelines_.find(seq.decode_pipeline); it != pipelines_.end()) {
    it->second.slots.Free(seq.decode_slot);
  }
  if (stream != streams_.end() && stream->second.ended) streams_.erase(stream);
  seq.decode_pipeline = seq.decode_slot = -1;
  seq.kv_stream = seq.kv_out_step = 0;
}

bool Scheduler::SlotIdle(int pipeline, int slot) const {
  auto p = pipelines_.find(pipeline);
  if (p == pipelines_.end()) return true;
  for (const auto& [step, entries] : p->second.inflight) {
    for (const StepEntry& e : entries) {
      if (e.slot == slot) return false;
    }
  }
  return true;
}

void Scheduler::Admit(absl::Time now) {
  // Sequences on their way to a new layout take their slots first.
  if (!held_.empty()) return;
  std::vector<int32_t> tokens;
  while (!resumed_.empty()) {
    Sequence& seq = *seqs_.at(resumed_.front());
    const KvNeed need = NeedOf(seq, tokens);
    const std::optional<Placement> best = PlacementForNext(false, &need);
    if (!best) return;
    Place(seq, *best);
    AdmitPages(seq);
    resumed_.pop_front();
  }
  if (now < admit_at()) return;
  while (!waiting_.empty()) {
    const ValidatedRequest& rq = waiting_.front()->request();
    const KvNeed need{.tokens = rq.prompt,
                      .max_new_tokens = std::min(rq.max_new_tokens,
                                                 options_.context_length -
                                                     static_cast<int>(rq.prompt.size())),
                      .use_cache = rq.prompt_logprobs < 0};
    if (absl::Status fits =
            CheckFits(static_cast<int>(need.tokens.size()), need.max_new_tokens);
        !fits.ok()) {
      waiting_.front()->Finish(fits, FinishReason::kNone, -1, now);  // no pipeline can hold it
      waiting_.pop_front();
      continue;
    }
    // n > 1: siblings share the prompt's full pages, once the first sibling's steps write them.
    const ForkFrom fork = ForkParentOf(rq, need);
    if (fork.wait) return;
    const std::optional<Placement> best =
        fork.parent != nullptr ? Placement{.pipeline = fork.parent->pipeline}
                               : PlacementForNext(false, &need);
    if (!best) return;
    std::shared_ptr<RequestState> req = std::move(waiting_.front());
    waiting_.pop_front();
    auto seq = std::make_unique<Sequence>();
    seq->id = next_seq_id_++;
    seq->request = req;
    seq->pending = req->request().prompt;
    const SamplingParams& sp = req->request().sampling;
    if (sp.repetition_penalty != 1.0f) {
      for (int32_t t : seq->pending) seq->seen[t].second = true;
    }
    Place(*seq, *best);
    if (fork.parent == nullptr || !ForkPages(*seq, *fork.parent)) AdmitPages(*seq);
    seq_of_request_[req.get()] = seq->id;
    req->Admitted(now);
    if (metrics_ != nullptr) {
      metrics_->queue_time.Observe(absl::ToDoubleSeconds(now - req->arrival()));
      metrics_->prompt_tokens.Increment(static_cast<double>(req->request().prompt.size()));
    }
    seqs_.emplace(seq->id, std::move(seq));
  }
}

absl::Time Scheduler::admit_at() const {
  if (options_.admission_quiet <= absl::ZeroDuration() || waiting_.empty()) {
    return absl::InfinitePast();
  }
  // Nothing to gather for once the waiting requests fill a step, or every slot that is free or
  // frees within kEndingSoonSteps (a round split in two comes together again: the successors of
  // the first part wait for those of the part about to end).
  int free = 0;
  for (const auto& [id, p] : pipelines_) {
    if (!p.draining && !p.paused && p.role != PipelineRole::kDecode) {
      free += p.slots.free() + EndingSoon(p);
    }
  }
  if (static_cast<int>(waiting_.size()) >= std::min(options_.max_batch, free)) {
    return absl::InfinitePast();
  }
  const absl::Time quiet =
      burst_left_ > 0 ? burst_at_ + options_.admission_wait
      : ManyEndingSoon()
          ? absl::InfiniteFuture()
          : std::max(waiting_.back()->arrival(), last_end_) + options_.admission_quiet;
  return std::min(quiet, waiting_.front()->arrival() + options_.admission_wait);
}

int Scheduler::EndingSoon(const Pipeline& p) const {
  int soon = 0;
  for (uint64_t seq_id : p.running) {
    auto it = seqs_.find(seq_id);
    if (it == seqs_.end()) continue;
    const Sequence& seq = *it->second;
    const int count = static_cast<int>(seq.generated.size()) + seq.in_flight;
    if (ReachesLength(seq.request->request(), count + kEndingSoonSteps, options_.context_length)) {
      ++soon;
    }
  }
  return soon;
}

bool Scheduler::ManyEndingSoon() const {
  for (const auto& [id, p] : pipelines_) {
    const int soon = EndingSoon(p);
    if (soon >= 2 && 4 * soon >= static_cast<int>(p.running.size())) return true;
  }
  return false;
}

SequenceStep Scheduler::RowOf(const Sequence& seq, int num_tokens, bool sample) const {
  const ValidatedRequest& rq = seq.request->request();
  SequenceStep row;
  row.slot = seq.slot;
  row.position = seq.position;
  row.num_tokens = num_tokens;
  row.sample = sample;
  row.sampling = rq.sampling;
  // Every step in flight samples for the sequence when this one goes ahead of them.
  row.sample_index = static_cast<uint64_t>(seq.generated.size() + seq.in_flight);
  if (sample && rq.sampling.has_penalties()) {
    row.seen.reserve(seq.seen.size());
    for (const auto& [token, seen] : seq.seen) {
      row.seen.push_back({.id = token, .output_count = seen.first, .in_prompt = seen.second});
    }
  }
  if (sample && rq.logprobs >= 0) row.logprobs = rq.logprobs;
  if (sample) row.constraint = rq.constraint;
  // Prompt logprobs score the prompt as it is fed, chunk by chunk, before the first token.
  if (seq.generated.empty() && rq.prompt_logprobs >= 0) {
    row.prompt_logprobs = rq.prompt_logprobs;
    row.next_prompt_token = sample ? -1 : seq.pending[num_tokens];
  }
  return row;
}

bool Scheduler::EndsByLength(const Sequence& seq) const {
  const int count = static_cast<int>(seq.generated.size()) + seq.in_flight;
  return ReachesLength(seq.request->request(), count, options_.context_length);
}

bool Scheduler::Ready(const Sequence& seq, int ahead) const {
  if (seq.moving) return false;
  if (seq.in_flight == 0) return true;
  // Ahead: the steps in flight sample (nothing of the prompt is left to feed) and the stage
  // that embeds has the token the step feeds (ahead > 0 only then: a single stage, or a first
  // stage fed by the last).
  const ValidatedRequest& rq = seq.request->request();
  return seq.in_flight <= ahead && seq.pending.empty() && !rq.sampling.has_penalties() &&
         rq.prompt_logprobs < 0 && !EndsByLength(seq);
}

int Scheduler::DecodeAhead(const Pipeline& p) const {
  if (!options_.decode_ahead || (p.stages != 1 && !p.fed_by_last) ||
      p.role == PipelineRole::kPrefill) {
    return 0;
  }
  if (p.step_time <= absl::ZeroDuration()) return 1;
  const int64_t fit = options_.decode_ahead_time / p.step_time;
  return static_cast<int>(std::clamp<int64_t>(fit, 1, kMaxDecodeAhead));
}

int Scheduler::decode_ahead(int id) const {
  auto it = pipelines_.find(id);
  return it == pipelines_.end() ? 0 : DecodeAhead(it->second);
}

int Scheduler::PromptTokens(const Sequence& seq) const {
  // A decode feeds one token; a resumed sequence feeds its prompt and its tokens again.
  if (seq.in_flight > 0 || (!seq.generated.empty() && seq.pending.size() <= 1)) return 0;
  return std::min(static_cast<int>(seq.pending.size()), options_.prefill_chunk);
}

Scheduler::StepEntry Scheduler::AddRow(Sequence& seq, StepDescriptor& step, int max_tokens) {
  if (seq.in_flight > 0) {
    step.seqs.push_back(RowOf(seq, 1, true));
    step.tokens.push_back(kPreviousSample);
    ++seq.fed_ahead;
    seq.position += 1;
  } else {
    const int pending = static_cast<int>(seq.pending.size());
    const int nt = std::min({pending, options_.prefill_chunk, max_tokens});
    step.seqs.push_back(RowOf(seq, nt, nt == pending));
    step.tokens.insert(step.tokens.end(), seq.pending.begin(), seq.pending.begin() + nt);
    seq.pending.erase(seq.pending.begin(), seq.pending.begin() + nt);
    seq.position += nt;
    // The prompt's last step in a prefill pipeline: its KV-cache is written out as the step goes
    // (layer by layer), unless the token it samples is the sequence's last (its length).
    if (nt == pending && seq.decode_pipeline >= 0 &&
        !ReachesLength(seq.request->request(), static_cast<int>(seq.generated.size()) + 1,
                       options_.context_length)) {
      step.seqs.back().kv_out_key = seq.id;
      StartKvStream(seq, step.id);
    }
  }
  ++seq.in_flight;
  seq.left_out = false;
  seq.last_step = step.id;
  if (const Pipeline& p = pipelines_.at(seq.pipeline); p.pages) {
    // The pages that hold positions [0, position): a prompt's are all allocated at admission.
    const absl::Span<const int> table = p.pages->BlockTable(seq.id);
    const int pages = (seq.position + options_.kv_page_size - 1) / options_.kv_page_size;
    step.seqs.back().block_table.assign(table.begin(), table.begin() + pages);
  }
  return {.seq = seq.id,
          .slot = seq.slot,
          .sample = step.seqs.back().sample,
          .epoch = seq.epoch,
          .end = seq.position};
}

std::vector<StepDescriptor> Scheduler::FormSteps(int id) {
  std::vector<StepDescriptor> out;
  auto pit = pipelines_.find(id);
  if (pit == pipelines_.end()) return out;
  Pipeline& p = pit->second;
  if (p.paused) return out;
  // At least one micro-batch per stage in flight, so that no stage waits for the others; going
  // ahead, each may have its successors in flight too.
  const int lanes = std::max(options_.micro_batches, p.stages);
  const int ahead = DecodeAhead(p);
  const int limit = (1 + ahead) * lanes;
  // Going ahead through several stages, a micro-batch's next step waits until another one's has
  // gone in behind its newest (the first stage runs that one while the last samples the tokens it
  // feeds), unless it is the pipeline's only micro-batch: the first stage's steps take turns.
  const bool take_turns = p.stages > 1 && ahead > 0;
  while (static_cast<int>(p.inflight.size()) < limit) {
    const bool one_batch = take_turns && OneMicroBatch(p);
    std::vector<Sequence*> ready;
    for (uint64_t seq_id : p.running) {
      Sequence& seq = *seqs_.at(seq_id);
      if (!Ready(seq, ahead)) continue;
      if (take_turns && seq.in_flight > 0 && !one_batch &&
          std::distance(p.inflight.upper_bound(seq.last_step), p.inflight.end()) < p.stages - 1) {
        continue;
      }
      ready.push_back(&seq);
    }
    if (ready.empty()) break;
    // Sequences with nothing in flight first, so that going ahead never starves them.
    std::stable_partition(ready.begin(), ready.end(),
                          [](const Sequence* s) { return s->in_flight == 0; });
    int free = std::min(lanes, limit - static_cast<int>(p.inflight.size()));
    bool ahead_first = false;  // the micro-batch going ahead before the newcomers joining it
    if (take_turns) {
      const int turn = NextTurn(p, lanes, ready);
      if (turn == 0) break;  // newcomers wait for a micro-batch to go ahead with
      ahead_first = std::any_of(ready.begin(), ready.end(),
                                [](const Sequence* s) { return s->in_flight > 0; });
      free = turn == 1 ? 1 : std::min(free, turn);
    }
    // Micro-batches stay even (without going ahead, where every lane holds different sequences,
    // unless they take turns): a lane freed while another step holds most of the sequences takes
    // its share only, and those left out go first next time (a micro-batch going ahead before
    // them: those of it left out lose their step ahead once).
    const bool even = lanes > 1 && (ahead == 0 || take_turns);
    if (even) {
      std::stable_partition(ready.begin(), ready.end(),
                            [](const Sequence* s) { return s->left_out; });
    }
    if (ahead_first) {
      std::stable_partition(ready.begin(), ready.end(),
                            [](const Sequence* s) { return s->in_flight > 0; });
    }
    const int share =
        even ? (static_cast<int>(p.running.size()) + lanes - 1) / lanes : options_.max_batch;
    while (free > 0 && !ready.empty()) {
      const int left = static_cast<int>(ready.size());
      const int n = std::min({options_.max_batch, share, (left + free - 1) / free});
      StepDescriptor step = FormStep(p, ready, n);
      if (!step.seqs.empty()) out.push_back(std::move(step));
      --free;
    }
    if (even) {
      for (Sequence* s : ready) s->left_out = true;
    }
  }
  return out;
}

bool Scheduler::OneMicroBatch(const Pipeline& p) const {
  for (uint64_t seq_id : p.running) {
    const Sequence& seq = *seqs_.at(seq_id);
    if (seq.in_flight == 0 || seq.last_step != seqs_.at(p.running.front())->last_step) {
      return false;
    }
  }
  return true;
}

int Scheduler::NextTurn(const Pipeline& p, int lanes, std::vector<Sequence*>& ready) const {
  uint64_t oldest = UINT64_MAX;  // the oldest micro-batch that may go ahead
  for (const Sequence* s : ready) {
    if (s->in_flight > 0) oldest = std::min(oldest, s->last_step);
  }
  absl::flat_hash_set<uint64_t> batches;
  for (uint64_t seq_id : p.running) {
    const Sequence& s = *seqs_.at(seq_id);
    if (s.in_flight > 0) batches.insert(s.last_step);
  }
  const int open = lanes - static_cast<int>(batches.size());
  if (ready.front()->in_flight == 0 && open > 0) {
    std::erase_if(ready, [](const Sequence* s) { return s->in_flight > 0; });
    return open;
  }
  if (oldest == UINT64_MAX) return 0;
  std::erase_if(ready, [oldest](const Sequence* s) {
    return s->in_flight > 0 && s->last_step != oldest;
  });
  return 1;
}

StepDescriptor Scheduler::FormStep(Pipeline& p, std::vector<Sequence*>& ready, int n) {
  StepDescriptor step;
  step.id = p.next_step++;
  int budget = options_.prefill_budget > 0 ? options_.prefill_budget : INT_MAX;
  std::vector<StepEntry> entries;
  // The first of `ready` always fits (the budget is at least one token), so a step is empty only
  // when its sequences were preempted for pages.
  for (auto it = ready.begin(); it != ready.end() && static_cast<int>(entries.size()) < n;) {
    const bool prompt = PromptTokens(**it) > 0;
    if (prompt && budget == 0) {
      ++it;
      continue;
    }
    if (p.pages) {
      Sequence& seq = **it;
      const bool ahead = seq.in_flight > 0;
      const int n = ahead ? 1
                          : std::min({static_cast<int>(seq.pending.size()),
                                      options_.prefill_chunk, prompt ? budget : INT_MAX});
      // Victims leave `ready`; what is before `it` there are prompts left out for the budget.
      if (!GrowPages(p, seq, n, ahead, entries, ready)) {
        it = ready.begin();  // preempted itself
        continue;
      }
      it = std::find(ready.begin(), ready.end(), &seq);
    }
    entries.push_back(AddRow(**it, step, prompt ? budget : INT_MAX));
    if (prompt) budget -= step.seqs.back().num_tokens;
    it = ready.erase(it);
  }
  if (entries.empty()) {  // its only rows were preempted for pages
    --p.next_step;
    return StepDescriptor{};
  }
  if (metrics_ != nullptr) metrics_->batch_size.Observe(static_cast<double>(entries.size()));
  p.inflight.emplace(step.id, std::move(entries));
  return step;
}

// ---------------------------------------------------------------------------------------------
// Results and the end of sequences

absl::Status Scheduler::OnStepResult(int id, uint64_t step_id, std::span<const int32_t> tokens,
                                     std::span<const SequenceLogprobs> logprobs, absl::Time now) {
  auto pit = pipelines_.find(id);
  if (pit == pipelines_.end()) {
    return absl::InternalError(absl::StrFormat("pipeline %d: no such pipeline", id));
  }
  Pipeline& p = pit->second;
  auto it = p.inflight.find(step_id);
  if (it == p.inflight.end()) {
    return absl::InternalError(
        absl::StrFormat("pipeline %d: result for unknown step %d", id, step_id));
  }
  std::vector<StepEntry> entries = std::move(it->second);
  p.inflight.erase(it);
  // The stage went from the step before straight to this one: the gap is its step time.
  if (p.busy_at_last_result) {
    const absl::Duration gap = now - p.last_result;
    p.step_time = p.step_time <= absl::ZeroDuration() ? gap : (p.step_time * 4 + gap) / 5;
  }
  p.last_result = now;
  p.busy_at_last_result = !p.inflight.empty();
  const int running_before = static_cast<int>(p.running.size());
  const uint64_t ends_before = ends_;
  const int sampled = static_cast<int>(
      std::count_if(entries.begin(), entries.end(), [](const StepEntry& e) { return e.sample; }));
  if (sampled != static_cast<int>(tokens.size())) {
    return absl::InternalError(absl::StrFormat("pipeline %d step %d: %d tokens returned, %d expected",
                                               id, step_id, tokens.size(), sampled));
  }
  // The logprobs of entry i, if its sequence asked for any.
  std::vector<const SequenceLogprobs*> logprobs_of(entries.size(), nullptr);
  for (const SequenceLogprobs& l : logprobs) {
    if (l.seq >= 0 && l.seq < static_cast<int>(entries.size())) logprobs_of[l.seq] = &l;
  }
  int k = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const StepEntry& e = entries[i];
    const int32_t token = e.sample ? tokens[k++] : -1;
    auto sit = seqs_.find(e.seq);
    if (sit == seqs_.end()) continue;  // cancelled while the step ran
    Sequence& seq = *sit->second;
    if (seq.epoch != e.epoch) continue;  // preempted while the step ran
    --seq.in_flight;
    if (p.pages) p.pages->MarkComputed(seq.id, std::min(e.end, seq.kv_known));
    const SequenceLogprobs* lp = logprobs_of[i];
    if (lp != nullptr && !lp->prompt.empty()) seq.request->AppendPromptLogprobs(lp->prompt);
    if (!e.sample) continue;
    if (token < 0 || token >= options_.vocab_size) {
      return absl::InternalError(absl::StrFormat(
          "pipeline %d: sampled token %d outside the vocabulary", id, token));
    }
    std::optional<TokenLogprob> logprob;
    if (lp != nullptr && lp->has_sampled) logprob = lp->sampled;
    const bool prefilled = seq.decode_pipeline >= 0;  // in a prefill pipeline, its prompt done
    AppendToken(seq, token, logprob ? &*logprob : nullptr, now);
    // On to its decode slot, unless the token ended it (AppendToken then forgot it).
    if (prefilled && seqs_.contains(e.seq) && seq.in_flight == 0) StartHandoff(seq);
  }
  const int ended = static_cast<int>(ends_ - ends_before);
  if (ended >= 2 && 4 * ended >= running_before) {
    burst_at_ = now;
    burst_left_ = ended;
  }
  return absl::OkStatus();
}

void Scheduler::AppendToken(Sequence& seq, int32_t token, TokenLogprob* logprob, absl::Time now) {
  const ValidatedRequest& r = seq.request->request();
  seq.generated.push_back(token);
  if (r.sampling.has_penalties()) ++seq.seen[token].first;
  // Decided before the request sees the token, so that a last token and the end reach it at once.
  if (seq.stop_text == nullptr && !r.stop_strings.empty() && options_.decode) {
    seq.stop_text = std::make_unique<StopText>(options_.decode);
  }
  const StopDecision stop =
      CheckStop(r, seq.generated, options_.context_length, seq.stop_text.get());
  if (stop.ends()) {
    seq.request->AppendLast(token, now, logprob, stop.finish, stop.text_limit);
  } else {
    seq.request->Append(token, now, logprob);
  }
  if (metrics_ != nullptr) {
    metrics_->generated_tokens.Increment();
    if (seq.generated.size() == 1) {
      metrics_->time_to_first_token.Observe(absl::ToDoubleSeconds(now - seq.request->arrival()));
    } else {
      metrics_->inter_token_latency.Observe(absl::ToDoubleSeconds(now - seq.last_token));
    }
    seq.last_token = now;
  }
  if (stop.ends()) {
    EndSequence(seq.id, absl::OkStatus(), stop.finish, stop.text_limit, now);
  } else if (seq.fed_ahead > 0) {
    --seq.fed_ahead;  // the step after fed it already
  } else {
    seq.pending.assign(1, token);
  }
}

void Scheduler::EndSequence(uint64_t seq_id, absl::Status status, FinishReason finish,
                            int text_limit, absl::Time now) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  Sequence& seq = *it->second;
  ReleaseDecodeSlot(seq);
  auto pit = pipelines_.find(seq.pipeline);
  if (pit != pipelines_.end()) {
    pit->second.slots.Free(seq.slot);
    // Pages, like slots, are reused only by steps issued later, which every stage runs after
    // the steps in flight that still write them.
    if (pit->second.pages) pit->second.pages->Free(seq_id);
    auto& running = pit->second.running;
    running.erase(std::remove(running.begin(), running.end(), seq_id), running.end());
  } else {
    resumed_.erase(std::remove(resumed_.begin(), resumed_.end(), seq_id), resumed_.end());
    held_.erase(std::remove(held_.begin(), held_.end(), seq_id), held_.end());
  }
  seq.request->Finish(std::move(status), finish, text_limit, now);
  seq_of_request_.erase(seq.request.get());
  seqs_.erase(it);
  last_end_ = std::max(last_end_, now);
  ++ends_;
}

void Scheduler::Cancel(const std::shared_ptr<RequestState>& request, const absl::Status& why,
                       absl::Time now) {
  auto w = std::find(waiting_.begin(), waiting_.end(), request);
  if (w != waiting_.end()) {
    waiting_.erase(w);
    request->Finish(why, FinishReason::kNone, -1, now);
    return;
  }
  auto it = seq_of_request_.find(request.get());
  if (it != seq_of_request_.end()) {
    EndSequence(it->second, why, FinishReason::kNone, -1, now);
  } else {
    request->Finish(why, FinishReason::kNone, -1, now);
  }
}

}  // namespace tandem
