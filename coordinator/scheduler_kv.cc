// The scheduler's part in moving KV-cache between pipelines (coordinator/scheduler.h): the
// prefill-to-decode hand-offs and layer-by-layer streams of a prompt's KV-cache, and the moves of
// running sequences out of retiring pipelines. The coordinator's threads perform the transfers
// (prefill_handoff.cc, replan.cc) and report back here.
#include <optional>
#include <span>
#include <utility>

#include "common/metrics.h"
#include "coordinator/scheduler.h"

namespace tandem {

// ---------------------------------------------------------------------------------------------
// Moves out of retiring pipelines

void Scheduler::Pause(int id) {
  auto it = pipelines_.find(id);
  if (it == pipelines_.end()) return;
  it->second.paused = true;
  it->second.draining = true;
}

int Scheduler::steps_in_flight(int id) const {
  auto it = pipelines_.find(id);
  return it == pipelines_.end() ? 0 : static_cast<int>(it->second.inflight.size());
}

std::vector<Scheduler::Held> Scheduler::Detach(int id) {
  std::vector<Held> out;
  auto it = pipelines_.find(id);
  if (it == pipelines_.end()) return out;
  for (uint64_t seq_id : it->second.running) {
    Sequence& seq = *seqs_.at(seq_id);
    if (seq.position == 0) {
      // Admitted but not fed yet: nothing to move; it waits for its first step elsewhere, ahead
      // of the waiting requests.
      seq.pipeline = seq.slot = -1;
      resumed_.push_back(seq_id);
      continue;
    }
    Held h{.seq = seq_id, .slot = seq.slot, .positions = seq.position, .block_table = {}};
    if (it->second.pages) {
      // The owner goes with the pipeline: its pages are free once the stages dropped the stash.
      const absl::Span<const int> table = it->second.pages->BlockTable(seq_id);
      const int pages = (seq.position + options_.kv_page_size - 1) / options_.kv_page_size;
      h.block_table.assign(table.begin(), table.begin() + pages);
    }
    out.push_back(std::move(h));
    ReleaseDecodeSlot(seq);
    seq.pipeline = seq.slot = -1;
    seq.moving = true;
    held_.push_back(seq_id);
  }
  pipelines_.erase(it);
  return out;
}

std::optional<Scheduler::Target> Scheduler::PlaceHeld(uint64_t seq_id) {
  auto h = std::find(held_.begin(), held_.end(), seq_id);
  if (h == held_.end()) return std::nullopt;
  Sequence& seq = *seqs_.at(seq_id);
  // With pages: the positions its KV-cache holds (what it was fed), on pages of its own (a cached
  // prefix would be written while other sequences read it), with room to finish.
  std::vector<int32_t> tokens;
  KvNeed need = NeedOf(seq, tokens);
  need.max_new_tokens += static_cast<int>(tokens.size()) - seq.position;
  need.tokens = std::span<const int32_t>(tokens).first(seq.position);
  need.use_cache = false;
  const std::optional<Placement> best = PlacementForNext(/*fed=*/true, &need);
  if (!best) return std::nullopt;
  held_.erase(h);
  Place(seq, *best);
  Target to{.pipeline = seq.pipeline, .slot = seq.slot, .block_table = {}};
  if (Pipeline& p = pipelines_.at(seq.pipeline); p.pages) {
    // PlacementForNext checked that the owner admits it.
    if (p.pages->Admit(seq.id, need.tokens, need.max_new_tokens, /*use_cache=*/false).ok()) {
      const absl::Span<const int> table = p.pages->BlockTable(seq.id);
      to.block_table.assign(table.begin(), table.end());
    }
    seq.kv_known = 0;  // until its KV-cache is there (Moved)
  }
  return to;
}

void Scheduler::Moved(uint64_t seq_id, bool ok, const absl::Status& why, absl::Time now) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end() || !it->second->moving) return;  // ended meanwhile
  Sequence& seq = *it->second;
  if (ok && seq.pipeline >= 0) {
    seq.moving = false;
    if (Pipeline& p = pipelines_.at(seq.pipeline); p.pages) {
      p.pages->MarkComputed(seq.id, seq.position);
      seq.kv_known = seq.position;
    }
    if (metrics_ != nullptr) metrics_->migrated_sequences.Increment();
    return;
  }
  if (auto pit = pipelines_.find(seq.pipeline); pit != pipelines_.end()) {
    pit->second.slots.Free(seq.slot);
    if (pit->second.pages) pit->second.pages->Free(seq_id);
    auto& running = pit->second.running;
    running.erase(std::remove(running.begin(), running.end(), seq_id), running.end());
  }
  held_.erase(std::remove(held_.begin(), held_.end(), seq_id), held_.end());
  seq.pipeline = seq.slot = -1;
  Recompute(seq, why, now);
}

// ---------------------------------------------------------------------------------------------
// Hand-offs and streams from prefill to decode pipelines

void Scheduler::StartKvStream(Sequence& seq, uint64_t step) {
  seq.kv_out_step = step;
  // Streamed into the decode slot while the step runs, where that slot is idle; otherwise the
  // hand-off after the prompt imports the write-out. On pages always the latter: the decode
  // pipeline's pages are given at the hand-off (HandoffPages).
  if (options_.kv_page_size > 0 || !SlotIdle(seq.decode_pipeline, seq.decode_slot)) return;
  const KvStream k{.id = next_stream_++,
                   .seq = seq.id,
                   .from_pipeline = seq.pipeline,
                   .to_pipeline = seq.decode_pipeline,
                   .to_slot = seq.decode_slot,
                   .positions = seq.position,
                   .step = step};
  seq.kv_stream = k.id;
  PendingStream pending;
  pending.stream = k;
  streams_.emplace(k.id, std::move(pending));
}

std::vector<Scheduler::KvStream> Scheduler::TakeKvStreams() {
  std::vector<KvStream> out;
  for (auto& [id, pending] : streams_) {
    if (pending.taken) continue;
    pending.taken = true;
    out.push_back(pending.stream);
  }
  return out;
}

bool Scheduler::kv_streams_ready() const {
  return std::any_of(streams_.begin(), streams_.end(),
                     [](const auto& entry) { return !entry.second.taken; });
}

void Scheduler::KvStreamEnded(uint64_t id, const absl::Status& st) {
  auto it = streams_.find(id);
  if (it == streams_.end()) return;
  PendingStream& p = it->second;
  p.ended = true;
  p.status = st;
  if (!p.orphan) return;  // its hand-off (or its end) takes it
  if (auto to = pipelines_.find(p.stream.to_pipeline); to != pipelines_.end()) {
    to->second.slots.Free(p.stream.to_slot);
  }
  streams_.erase(it);
}

void Scheduler::StartHandoff(Sequence& seq) {
  Pipeline& from = pipelines_.at(seq.pipeline);
  if (!pipelines_.contains(seq.decode_pipeline)) {
    ReleaseDecodeSlot(seq);  // decodes where it is
    return;
  }
  Handoff h{.id = next_handoff_++,
            .seq = seq.id,
            .from_pipeline = seq.pipeline,
            .from_slot = seq.slot,
            .positions = seq.position,
            .to_pipeline = seq.decode_pipeline,
            .to_slot = seq.decode_slot,
            .kv_out_step = seq.kv_out_step,
            .streamed = false,
            .from_table = {},
            .to_table = {}};
  if (from.pages && !HandoffPages(seq, h)) {
    ReleaseDecodeSlot(seq);  // no pages there now: decodes where it is
    return;
  }
  // The hand-off owns both slots from here on.
  from.running.erase(std::remove(from.running.begin(), from.running.end(), seq.id),
                     from.running.end());
  seq.pipeline = seq.slot = seq.decode_pipeline = seq.decode_slot = -1;
  seq.moving = true;
  seq.handoff = h.id;
  const uint64_t pages_at_step = from.pages ? pipelines_.at(h.to_pipeline).next_step : 0;
  handoffs_.emplace(h.id, PendingHandoff{.handoff = h,
                                         .taken = false,
                                         .stream = seq.kv_stream,
                                         .pages_at_step = pages_at_step});
  seq.kv_stream = seq.kv_out_step = 0;
}

bool Scheduler::HandoffPages(const Sequence& seq, Handoff& h) {
  Pipeline& from = pipelines_.at(h.from_pipeline);
  Pipeline& to = pipelines_.at(h.to_pipeline);
  if (!to.pages) return false;
  std::vector<int32_t> tokens;
  KvNeed need = NeedOf(seq, tokens);
  need.max_new_tokens += static_cast<int>(tokens.size()) - h.positions;
  need.tokens = std::span<const int32_t>(tokens).first(h.positions);
  // Pages of its own (no cached page: the import writes them).
  if (!to.pages->Admit(seq.id, need.tokens, need.max_new_tokens, /*use_cache=*/false).ok()) {
    return false;
  }
  const absl::Span<const int> held = from.pages->BlockTable(seq.id);
  const int pages = (h.positions + options_.kv_page_size - 1) / options_.kv_page_size;
  h.from_table.assign(held.begin(), held.begin() + pages);
  const absl::Span<const int> given = to.pages->BlockTable(seq.id);
  h.to_table.assign(given.begin(), given.end());
  return true;
}

bool Scheduler::HandoffCanStart(const PendingHandoff& h) const {
  // After its stream (which owns the decode slot until it ends); without one, once no step in
  // flight uses the decode slot.
  if (auto k = streams_.find(h.stream); k != streams_.end()) return k->second.ended;
  if (h.pages_at_step != 0) {
    auto to = pipelines_.find(h.handoff.to_pipeline);
    if (to != pipelines_.end() && !to->second.inflight.empty() &&
        to->second.inflight.begin()->first < h.pages_at_step) {
      return false;
    }
  }
  return SlotIdle(h.handoff.to_pipeline, h.handoff.to_slot);
}

bool Scheduler::handoffs_ready() const {
  return std::any_of(handoffs_.begin(), handoffs_.end(), [this](const auto& entry) {
    return !entry.second.taken && HandoffCanStart(entry.second);
  });
}

std::vector<Scheduler::Handoff> Scheduler::TakeHandoffs() {
  std::vector<Handoff> out;
  for (auto& [id, pending] : handoffs_) {
    if (pending.taken || !HandoffCanStart(pending)) continue;
    pending.taken = true;
    Handoff h = pending.handoff;
    if (auto k = streams_.find(pending.stream); k != streams_.end()) {
      h.streamed = k->second.status.ok();
      streams_.erase(k);
    }
    out.push_back(h);
  }
  return out;
}

void Scheduler::HandedOff(uint64_t id, bool ok, const absl::Status& why, absl::Time now) {
  auto hit = handoffs_.find(id);
  if (hit == handoffs_.end()) return;
  const Handoff h = hit->second.handoff;
  handoffs_.erase(hit);
  if (auto from = pipelines_.find(h.from_pipeline); from != pipelines_.end()) {
    from->second.slots.Free(h.from_slot);
    if (from->second.pages) from->second.pages->Free(h.seq);  // exported, or lost
  }
  auto to = pipelines_.find(h.to_pipeline);
  auto sit = seqs_.find(h.seq);
  Sequence* seq = sit != seqs_.end() && sit->second->handoff == id ? sit->second.get() : nullptr;
  if (seq != nullptr && ok && to != pipelines_.end()) {
    if (to->second.pages) {
      to->second.pages->MarkComputed(h.seq, h.positions);
      seq->kv_known = h.positions;
    }
    seq->pipeline = h.to_pipeline;
    seq->slot = h.to_slot;
    seq->moving = false;
    seq->handoff = 0;
    to->second.running.push_back(seq->id);
    if (metrics_ != nullptr) metrics_->prefill_handoffs.Increment();
    return;
  }
  if (to != pipelines_.end()) {
    to->second.slots.Free(h.to_slot);
    if (to->second.pages) to->second.pages->Free(h.seq);
  }
  if (seq == nullptr) return;  // ended meanwhile
  Recompute(*seq, ok ? absl::UnavailableError("its decode pipeline is gone") : why, now);
}

}  // namespace tandem
