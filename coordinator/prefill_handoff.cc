// The coordinator's KV threads between prefill and decode pipelines: "kv-stream" has decode
// pipelines import a prompt's KV-cache layer by layer as the prefill step writes it out, and
// "handoff" moves the KV-cache of finished prompts to their decode pipeline (or makes the KV links
// between two pipelines ahead of their first hand-off). Both take their work from the scheduler
// under mu_ and call the workers outside it (kv_move.h).
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "common/metrics.h"
#include "coordinator/coordinator.h"
#include "coordinator/kv_move.h"
#include "coordinator/topology_executor.h"
#include "spdlog/spdlog.h"

namespace tandem {

void Coordinator::KvStreamLoop() {
  // Streams of one step between the same two pipelines go together: one import.
  struct Batch {
    std::vector<KvStage> holders;  // the prefill pipeline's stages
    std::vector<KvStage> takers;   // the decode pipeline's
    std::vector<Scheduler::KvStream> streams;
  };
  while (true) {
    std::map<std::tuple<int, int, uint64_t>, Batch> batches;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || scheduler_->kv_streams_ready();
      };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      for (const Scheduler::KvStream& k : scheduler_->TakeKvStreams()) {
        auto from = pipelines_.find(k.from_pipeline);
        auto to = pipelines_.find(k.to_pipeline);
        if (from == pipelines_.end() || to == pipelines_.end()) {
          scheduler_->KvStreamEnded(k.id, absl::UnavailableError("a pipeline is gone"));
          continue;
        }
        Batch& b = batches[{k.from_pipeline, k.to_pipeline, k.step}];
        if (b.streams.empty()) {
          b.holders = StagesOf(*from->second);
          b.takers = StagesOf(*to->second);
        }
        b.streams.push_back(k);
      }
    }
    // One batch after another, in the order of their steps (the prefill pipeline's order).
    for (auto& [key, b] : batches) {
      const absl::Time t0 = absl::Now();
      std::vector<KvSeq> in;
      for (const Scheduler::KvStream& k : b.streams) {
        in.push_back(
            {.key = k.seq, .slot = k.to_slot, .positions = k.positions, .block_table = {}});
      }
      const absl::StatusOr<int64_t> written =
          ImportKvAll(b.takers, b.holders, in, kHandoffTimeout, std::get<2>(key));
      if (!written.ok()) {
        spdlog::warn("pipeline {} to {}: KV stream of step {} ({} sequence(s)) failed; they are "
                     "handed off after the prompt: {}",
                     std::get<0>(key), std::get<1>(key), std::get<2>(key), b.streams.size(),
                     written.status().ToString());
      }
      absl::MutexLock lock(&mu_);
      for (const Scheduler::KvStream& k : b.streams) {
        scheduler_->KvStreamEnded(k.id, written.status());
      }
      wake_scheduler_ = true;
      if (metrics_ != nullptr && written.ok()) {
        metrics_->kv_transfer_bytes.Increment(static_cast<double>(*written));
        metrics_->kv_streams.Increment(static_cast<double>(b.streams.size()));
        metrics_->kv_stream_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - t0));
      }
    }
  }
}

void Coordinator::HandoffLoop() {
  // Hand-offs between the same two pipelines go together, those of one prefill step's write-out
  // apart from the others: one export, import and drop each.
  struct Batch {
    std::vector<KvStage> holders;  // the prefill pipeline's stages
    std::vector<KvStage> takers;   // the decode pipeline's
    std::vector<Scheduler::Handoff> handoffs;
  };
  while (true) {
    std::map<std::tuple<int, int, uint64_t, bool>, Batch> batches;
    std::vector<Batch> warmups;  // links to make: no hand-off
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || scheduler_->handoffs_ready() || !link_warmups_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      for (const auto& [from_id, to_id] : std::exchange(link_warmups_, {})) {
        auto from = pipelines_.find(from_id);
        auto to = pipelines_.find(to_id);
        if (from == pipelines_.end() || to == pipelines_.end()) continue;
        warmups.push_back({StagesOf(*from->second), StagesOf(*to->second), {}});
      }
      for (const Scheduler::Handoff& h : scheduler_->TakeHandoffs()) {
        auto from = pipelines_.find(h.from_pipeline);
        auto to = pipelines_.find(h.to_pipeline);
        if (from == pipelines_.end() || to == pipelines_.end()) {
          scheduler_->HandedOff(h.id, false,
                                absl::UnavailableError("its prefill or decode pipeline is gone"),
                                absl::Now());
          continue;
        }
        Batch& b = batches[{h.from_pipeline, h.to_pipeline, h.kv_out_step, h.streamed}];
        if (b.handoffs.empty()) {
          b.holders = StagesOf(*from->second);
          b.takers = StagesOf(*to->second);
        }
        b.handoffs.push_back(h);
      }
      wake_scheduler_ = true;
    }
    for (const Batch& w : warmups) {
      const absl::Time t0 = absl::Now();
      const absl::StatusOr<int64_t> made = ImportKvAll(w.takers, w.holders, {}, kHandoffTimeout);
      if (made.ok()) {
        spdlog::info("KV links for hand-offs made in {:.3f} s",
                     absl::ToDoubleSeconds(absl::Now() - t0));
      } else {
        spdlog::warn("KV links for hand-offs not made ahead (the first hand-off makes them): {}",
                     made.status().ToString());
      }
    }
    for (auto& [key, b] : batches) {
      const auto& [from_pipeline, to_pipeline, kv_out_step, streamed] = key;
      const absl::Time t0 = absl::Now();
      std::vector<KvSeq> out;
      std::vector<KvSeq> in;
      for (const Scheduler::Handoff& h : b.handoffs) {
        out.push_back({.key = h.seq,
                       .slot = h.from_slot,
                       .positions = h.positions,
                       .block_table = h.from_table});
        in.push_back({.key = h.seq,
                      .slot = h.to_slot,
                      .positions = h.positions,
                      .block_table = h.to_table});
      }
      // Streamed: the KV-cache is there (its bytes counted by the stream). Written out by the
      // prefill step: fetched from that. Otherwise, or where that fails, exported from the slot.
      absl::StatusOr<int64_t> written = int64_t{0};
      if (!streamed) {
        if (kv_out_step != 0) {
          written = ImportKvAll(b.takers, b.holders, in, kHandoffTimeout, kv_out_step);
          if (!written.ok()) {
            spdlog::debug("pipeline {} to {}: write-out of step {} not imported, exported "
                          "instead: {}",
                          from_pipeline, to_pipeline, kv_out_step, written.status().ToString());
          }
        }
        if (kv_out_step == 0 || !written.ok()) {
          const absl::Status exported = ExportKvAll(b.holders, out, kHandoffTimeout);
          written = exported.ok() ? ImportKvAll(b.takers, b.holders, in, kHandoffTimeout)
                                  : absl::StatusOr<int64_t>(exported);
        }
      }
      if (!written.ok()) {
        spdlog::warn("pipeline {} to {}: {} sequence(s) are recomputed: {}", from_pipeline,
                     to_pipeline, b.handoffs.size(), written.status().ToString());
      }
      {
        absl::MutexLock lock(&mu_);
        for (const Scheduler::Handoff& h : b.handoffs) {
          scheduler_->HandedOff(h.id, written.ok(), written.status(), absl::Now());
        }
        wake_scheduler_ = true;
        if (metrics_ != nullptr && written.ok()) {
          metrics_->kv_transfer_bytes.Increment(static_cast<double>(*written));
          metrics_->prefill_handoff_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - t0));
        }
      }
      // The prefill stages' copies go once the sequences decode (freeing device memory waits for
      // the prefill GPU's queued work).
      DropKvAll(b.holders, out);
    }
  }
}

}  // namespace tandem
