// The coordinator's re-plan: it asks the topology policy (topology_policy.h) what to do from a
// snapshot of the cluster taken under mu_, and performs it (topology_executor.h: RPCs, threads,
// timeouts) outside mu_, serialized by plan_mu_. Also the moves of running sequences with their
// KV-cache from retiring pipelines to the new ones, and the pipelines' prefill/decode roles.
#include <algorithm>
#include <climits>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/metrics.h"
#include "coordinator/coordinator.h"
#include "coordinator/kv_move.h"
#include "coordinator/topology_executor.h"
#include "coordinator/topology_policy.h"
#include "spdlog/spdlog.h"

namespace tandem {
namespace {

WorkerHealth HealthOf(v1::WorkerState state) {
  switch (state) {
    case v1::WORKER_STATE_SERVING: return WorkerHealth::kServing;
    case v1::WORKER_STATE_DRAINED: return WorkerHealth::kDrained;
    case v1::WORKER_STATE_DOWN: return WorkerHealth::kDown;
    default: return WorkerHealth::kIdle;
  }
}

}  // namespace

ClusterState Coordinator::ClusterStateLocked() {
  ClusterState s{.num_layers = model_.num_layers,
                 .wanted_stages = wanted_stages_,
                 .wanted_replicas = wanted_replicas_,
                 .effective_stages = effective_stages_,
                 .planned_once = planned_once_,
                 .wanted_tensor_parallel = wanted_tensor_parallel_,
                 .workers = {},
                 .pipelines = {}};
  for (const auto& [id, w] : workers_) {
    s.workers.push_back({.id = id,
                         .health = HealthOf(w.state),
                         .cuda = w.backend == "cuda",
                         .tensor_parallel = w.tensor_parallel});
  }
  for (const auto& [id, p] : pipelines_) {
    s.pipelines.push_back({.id = id,
                           .assignment = p->assignment,
                           .workers = p->workers,
                           .ranges = p->ranges,
                           .draining = scheduler_->draining(id),
                           .tensor_parallel = p->tensor_parallel});
  }
  return s;
}

StageSettings Coordinator::StageSettingsOf() const {
  return {.model_dir = config_.model_dir.string(),
          .max_slots = MaxSlots(config_),
          .max_seq_len = limits_.context_length,
          .max_step_rows = MaxStepRows(config_),
          .kv_page_size = config_.kv_page_size,
          .kv_pages = config_.kv_pages.value_or(0),
          .kv_cache_dtype = KvCacheDTypeOf(config_) == KvCacheDType::kAuto
                                ? std::string()
                                : std::string(KvCacheDTypeName(KvCacheDTypeOf(config_))),
          .tensor_parallel = wanted_tensor_parallel_};
}

std::vector<Coordinator::Planned> Coordinator::PrepareReplacements() {
  std::vector<Planned> plans;
  std::vector<std::vector<std::shared_ptr<grpc::Channel>>> channels;
  std::vector<bool> all_cuda;
  // Per new stage's worker, the addresses of the old holders of its layers (CUDA workers both).
  std::map<int64_t, std::set<std::string>> kv_sources;
  std::map<int64_t, std::shared_ptr<grpc::Channel>> kv_takers;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return {};
    RestoreWantedStages();
    const ClusterState state = ClusterStateLocked();
    const TopologyActions actions = PlanTopology(state);
    // A pipeline of fewer stages than asked for is built only once nothing serves.
    if (actions.retiring.empty() || !actions.builds.ok() || actions.builds->fewer_stages) return {};
    for (const NewPipeline& n : actions.builds->pipelines) {
      Planned plan{.id = next_pipeline_id_++,
                   .assignment = next_assignment_++,
                   .workers = n.workers,
                   .ranges = n.ranges,
                   .requests = {}};
      std::vector<std::string> addresses;
      std::vector<std::shared_ptr<grpc::Channel>> chans;
      bool cuda = true;
      for (int64_t wid : plan.workers) {
        const WorkerEntry& w = workers_.at(wid);
        addresses.push_back(w.address);
        chans.push_back(w.channel);
        cuda = cuda && w.backend == "cuda";
      }
      plan.requests = StageRequests(StageSettingsOf(), plan.id, plan.assignment, addresses,
                                    plan.ranges);
      for (v1::AssignStageRequest& r : plan.requests) r.set_prepare(true);
      plans.push_back(std::move(plan));
      channels.push_back(std::move(chans));
      all_cuda.push_back(cuda);
    }
    if (config_.move_kv) {
      for (const auto& [taker, holders] :
           KvLinksToMake(state, actions.retiring, actions.builds->pipelines)) {
        for (int64_t h : holders) kv_sources[taker].insert(workers_.at(h).address);
        kv_takers[taker] = workers_.at(taker).channel;
      }
    }
  }
  std::vector<Planned> ready;
  for (size_t i = 0; i < plans.size(); ++i) {
    if (PrepareStages(plans[i].id, channels[i], plans[i].requests, all_cuda[i])) {
      ready.push_back(std::move(plans[i]));
    }
  }
  // The KV links the moves will fetch over, made now rather than in the pause.
  for (const auto& [worker, addresses] : kv_sources) {
    MakeKvLinks(worker, kv_takers[worker], addresses);
  }
  return ready;
}

absl::Status Coordinator::RunPlan() {
  absl::MutexLock plan(&plan_mu_);
  CloseLinks();
  std::vector<Planned> planned = PrepareReplacements();
  std::vector<std::pair<std::shared_ptr<grpc::Channel>, uint64_t>> releases;
  std::vector<Departure> departures;
  const absl::Time paused = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    planning_ = true;
    replan_needed_ = false;
    RestoreWantedStages();
    const ClusterState state = ClusterStateLocked();
    const std::vector<int> retiring = RetiringPipelines(state);
    // The retiring stages of workers that no prepared pipeline takes.
    std::vector<NewPipeline> taking;
    for (const Planned& p : planned) taking.push_back({.workers = p.workers, .ranges = p.ranges});
    for (const StageRelease& r : StagesToRelease(state, retiring, taking)) {
      releases.emplace_back(workers_.at(r.worker).channel, r.assignment);
    }
    departures = RetireLocked(retiring);
  }
  CloseLinks();
  // The old stages stash the KV-cache before any of them is given a new stage.
  for (Departure& d : departures) {
    const absl::Time t0 = absl::Now();
    if (d.status.ok()) d.status = ExportKvAll(d.holders, d.seqs, kMoveTimeout);
    spdlog::info("pipeline {}: {} sequence(s) stashed in {:.3f} s (paused {:.3f} s before)",
                 d.pipeline, d.seqs.size(), absl::ToDoubleSeconds(absl::Now() - t0),
                 absl::ToDoubleSeconds(t0 - paused));
  }
  // Workers left without a stage drop theirs as the others take new ones: the links between the
  // old stages close on both sides at once.
  StageReleaser releaser;
  for (auto& [channel, assignment] : releases) releaser.Release(std::move(channel), assignment);
  const absl::Status result = BuildPipelines(planned);
  // Pipelines prepared but not built (their workers were not idle as planned): the workers drop
  // what they got ready for them (their links and placed weights).
  for (const Planned& p : planned) {
    spdlog::info("pipeline {} was prepared but not built: its workers drop what they prepared",
                 p.id);
    for (int64_t w : p.workers) {
      std::shared_ptr<grpc::Channel> channel;
      {
        absl::MutexLock lock(&mu_);
        auto it = workers_.find(w);
        if (it != workers_.end()) channel = it->second.channel;
      }
      if (channel != nullptr) releaser.Release(std::move(channel), p.assignment);
    }
  }
  releaser.Join();
  ArriveMoved(departures, paused);
  absl::MutexLock lock(&mu_);
  planning_ = false;
  ForgetDownWorkers();
  AssignRoles();
  if (!pipelines_.empty()) planned_once_ = true;
  if (!result.ok()) {
    plan_error_ = result;
  } else if (static_cast<int>(pipelines_.size()) >= wanted_replicas_) {
    plan_error_ = absl::OkStatus();
  }
  if (pipelines_.empty() && !replan_needed_) {
    // Nothing can serve: waiting requests would otherwise wait for their deadlines.
    scheduler_->FailWaiting(NoPipelineErrorLocked(), absl::Now());
  }
  wake_scheduler_ = true;
  return result;
}

std::vector<Coordinator::Departure> Coordinator::RetireLocked(const std::vector<int>& retiring) {
  if (retiring.empty()) return {};
  for (int id : retiring) scheduler_->SetDraining(id);
  std::vector<Departure> departures;
  if (config_.move_kv) {
    departures = DetachForMove(retiring);
  } else {
    spdlog::info("draining {} pipeline(s) for the new topology", retiring.size());
    auto drained = [this, &retiring]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (int id : retiring) {
        if (scheduler_->running(id) > 0) return false;
      }
      return true;
    };
    mu_.AwaitWithTimeout(absl::Condition(&drained), absl::Seconds(config_.drain_timeout_s));
  }
  for (int id : retiring) {
    FailPipeline(id,
                 absl::UnavailableError(
                     "the pipeline was retired by a topology change before it drained"),
                 /*resume=*/true);
  }
  return departures;
}

absl::Status Coordinator::BuildPipelines(std::vector<Planned>& planned) {
  while (true) {
    std::vector<int64_t> chosen;
    std::vector<LayerRange> ranges;
    std::vector<v1::AssignStageRequest> requests;  // a prepare's
    int id = 0;
    uint64_t assignment = 0;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return absl::OkStatus();
      // Asked anew after each pipeline: one that failed to build marked its worker down.
      absl::StatusOr<BuildPlan> plan = PlanBuilds(ClusterStateLocked());
      if (!plan.ok()) return plan.status();
      if (plan->pipelines.empty()) return absl::OkStatus();
      if (plan->fewer_stages) {
        spdlog::warn("only {} workers left: serving with {} stage(s) instead of {}", plan->stages,
                     plan->stages, effective_stages_);
        effective_stages_ = plan->stages;
      }
      ranges = plan->pipelines.front().ranges;
      // A prepared pipeline where its workers are idle as planned; otherwise the policy's choice.
      auto idle = [this](int64_t w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        auto it = workers_.find(w);
        return it != workers_.end() && it->second.state == v1::WORKER_STATE_IDLE;
      };
      auto prepared = std::find_if(planned.begin(), planned.end(), [&](const Planned& p) {
        return p.ranges == ranges && std::all_of(p.workers.begin(), p.workers.end(), idle);
      });
      if (prepared != planned.end()) {
        id = prepared->id;
        assignment = prepared->assignment;
        chosen = prepared->workers;
        requests = std::move(prepared->requests);
        planned.erase(prepared);
      } else {
        chosen = plan->pipelines.front().workers;
        id = next_pipeline_id_++;
        assignment = next_assignment_++;
      }
      for (size_t s = 0; s < chosen.size(); ++s) {
        WorkerEntry& w = workers_[chosen[s]];
        w.state = v1::WORKER_STATE_SERVING;
        w.pipeline = id;
        w.stage = static_cast<int>(s);
        w.layers = ranges[s];
      }
    }
    absl::Status s = BuildPipeline(id, assignment, chosen, ranges, std::move(requests));
    if (s.ok()) continue;
    spdlog::warn("building pipeline {}: {}", id, s.ToString());
    absl::MutexLock lock(&mu_);
    for (int64_t wid : chosen) {
      WorkerEntry& w = workers_[wid];
      if (w.pipeline == id) {
        w.pipeline = -1;
        w.stage = -1;
      }
      if (w.state == v1::WORKER_STATE_SERVING) w.state = v1::WORKER_STATE_IDLE;
    }
    // Worker-side trouble marks that worker down and the loop tries the others; anything else
    // (a bad checkpoint) would fail the same way again.
    if (s.code() != absl::StatusCode::kUnavailable &&
        s.code() != absl::StatusCode::kDeadlineExceeded) {
      return s;
    }
  }
}

std::vector<KvStage> Coordinator::StagesOf(const Pipeline& p) {
  std::vector<KvStage> out;
  for (size_t s = 0; s < p.workers.size(); ++s) {
    const WorkerEntry& w = workers_[p.workers[s]];
    out.push_back({.worker = w.id,
                   .address = w.address,
                   .channel = w.channel,
                   .assignment = p.assignment,
                   .layers = p.ranges[s]});
  }
  return out;
}

std::vector<Coordinator::Departure> Coordinator::DetachForMove(const std::vector<int>& retiring) {
  for (int id : retiring) scheduler_->Pause(id);
  // Every step in flight ends (results are handled as usual), so that the KV-cache holds what
  // the sequences were fed.
  auto idle = [this, &retiring]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (int id : retiring) {
      if (scheduler_->steps_in_flight(id) > 0) return false;
    }
    return true;
  };
  mu_.AwaitWithTimeout(absl::Condition(&idle), absl::Seconds(config_.drain_timeout_s));
  std::vector<Departure> out;
  for (int id : retiring) {
    auto pit = pipelines_.find(id);
    if (pit == pipelines_.end() || scheduler_->steps_in_flight(id) > 0) continue;
    const Pipeline& p = *pit->second;
    Departure d;
    d.pipeline = id;
    d.holders = StagesOf(p);
    for (Scheduler::Held& h : scheduler_->Detach(id)) {
      d.seqs.push_back({.key = h.seq,
                        .slot = h.slot,
                        .positions = h.positions,
                        .block_table = std::move(h.block_table)});
    }
    if (!d.seqs.empty()) {
      spdlog::info("pipeline {}: moving {} sequence(s) with their KV-cache", id, d.seqs.size());
      out.push_back(std::move(d));
    }
  }
  return out;
}

void Coordinator::ArriveMoved(std::vector<Departure>& departures, absl::Time paused) {
  if (departures.empty()) return;
  int64_t bytes = 0;
  const absl::Time t0 = absl::Now();
  for (Departure& d : departures) {
    // Where each sequence goes, grouped by the pipeline that takes it.
    std::map<int, std::vector<KvSeq>> arrivals;
    std::map<int, std::vector<KvStage>> takers;
    {
      absl::MutexLock lock(&mu_);
      for (const KvSeq& q : d.seqs) {
        std::optional<Scheduler::Target> t;
        if (d.status.ok()) t = scheduler_->PlaceHeld(q.key);
        if (!t) {
          scheduler_->Moved(q.key, false,
                            d.status.ok() ? absl::UnavailableError("no pipeline had room for it")
                                          : d.status,
                            absl::Now());
          continue;
        }
        arrivals[t->pipeline].push_back({.key = q.key,
                                         .slot = t->slot,
                                         .positions = q.positions,
                                         .block_table = std::move(t->block_table)});
        if (!takers.contains(t->pipeline)) {
          takers[t->pipeline] = StagesOf(*pipelines_.at(t->pipeline));
        }
      }
    }
    for (auto& [pipeline, seqs] : arrivals) {
      absl::StatusOr<int64_t> written = ImportKvAll(takers[pipeline], d.holders, seqs,
                                                    kMoveTimeout);
      if (written.ok()) {
        bytes += *written;
      } else {
        spdlog::warn("pipeline {}: sequences from pipeline {} are recomputed: {}", pipeline,
                     d.pipeline, written.status().ToString());
      }
      absl::MutexLock lock(&mu_);
      for (const KvSeq& q : seqs) {
        scheduler_->Moved(q.key, written.ok(), written.status(), absl::Now());
      }
      wake_scheduler_ = true;
    }
    if (!d.status.ok()) {
      spdlog::warn("pipeline {}: sequences are recomputed: {}", d.pipeline, d.status.ToString());
    }
    DropKvAll(d.holders, d.seqs);
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - paused);
  spdlog::info("moved sequences with {} bytes of KV-cache: imported in {:.3f} s, paused {:.3f} s",
               bytes, absl::ToDoubleSeconds(absl::Now() - t0), seconds);
  if (metrics_ != nullptr) {
    metrics_->kv_transfer_bytes.Increment(static_cast<double>(bytes));
    metrics_->kv_move_seconds.Observe(seconds);
  }
}

absl::Status Coordinator::BuildPipeline(int id, uint64_t assignment,
                                        const std::vector<int64_t>& workers,
                                        const std::vector<LayerRange>& ranges,
                                        std::vector<v1::AssignStageRequest> requests) {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::string> addresses;
  bool all_cuda = true;  // only CUDA workers link over NCCL
  {
    absl::MutexLock lock(&mu_);
    for (int64_t w : workers) {
      channels.push_back(workers_[w].channel);
      addresses.push_back(workers_[w].address);
      all_cuda = all_cuda && workers_[w].backend == "cuda";
    }
  }
  const int stages = static_cast<int>(workers.size());
  const bool prepared = !requests.empty();
  if (prepared) {
    for (v1::AssignStageRequest& r : requests) r.set_prepare(false);
  } else {
    requests = StageRequests(StageSettingsOf(), id, assignment, addresses, ranges);
  }
  std::vector<v1::AssignStageResponse> responses;
  if (std::optional<StageAssignError> err =
          AssignPipelineStages(channels, requests, kAssignTimeout, &responses, all_cuda)) {
    const int s = err->stage;
    const grpc::Status& st = err->status;
    const std::string why = absl::StrFormat("AssignStage to worker %d (%s): %s", workers[s],
                                            addresses[s], st.error_message());
    const auto code = static_cast<absl::StatusCode>(st.error_code());
    if (code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded) {
      absl::MutexLock lock(&mu_);
      MarkDown(workers[s], why);
    }
    return absl::Status(code, why);
  }
  for (int s = 0; s < stages; ++s) {
    spdlog::info("pipeline {} stage {}: worker {} ({}) {} layers [{}, {}) in {:.3f} s ({} bytes "
                 "of weights already placed)",
                 id, s, workers[s], addresses[s], prepared ? "took its prepared" : "loaded",
                 ranges[s].first, ranges[s].last, responses[s].load_seconds(),
                 responses[s].placed_bytes());
  }
  // Every stage holds the same positions of different layers: the pipeline has the fewest pages
  // any of its stages holds.
  int kv_pages = 0;
  if (config_.kv_page_size > 0) {
    kv_pages = INT_MAX;
    for (const v1::AssignStageResponse& r : responses) {
      kv_pages = std::min<int64_t>(kv_pages, r.kv_pages());
    }
    if (kv_pages <= 0) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "pipeline %d: a stage holds no KV-cache pages (its worker does not page its KV-cache, "
          "or its memory holds no page of %d tokens); run --kv_page_size 0 or give the stages "
          "more memory",
          id, config_.kv_page_size));
    }
  }
  PipelineLink::Callbacks cb;
  cb.on_result = [this, id, assignment](int stage, const v1::StepResult& r) {
    OnStepResult(id, assignment, stage, r);
  };
  cb.on_broken = [this, id, assignment](int stage, const absl::Status& s) {
    OnLinkBroken(id, assignment, stage, s);
  };
  auto link = std::make_shared<PipelineLink>(channels, std::move(cb),
                                             absl::StrFormat("p%da%d", id, assignment));
  absl::MutexLock lock(&mu_);
  for (int64_t w : workers) {
    if (workers_[w].state != v1::WORKER_STATE_SERVING || workers_[w].pipeline != id) {
      links_to_close_.push_back(std::move(link));
      return absl::UnavailableError(
          absl::StrFormat("worker %d went away while pipeline %d was built", w, id));
    }
  }
  auto p = std::make_unique<Pipeline>();
  p->id = id;
  p->assignment = assignment;
  p->workers = workers;
  p->ranges = ranges;
  p->tensor_parallel = requests[0].tensor_parallel();
  p->link = std::move(link);
  pipelines_.emplace(id, std::move(p));
  // Steps may go ahead of the tokens they feed where the first stage gets them from the last.
  const bool fed_by_last =
      stages > 1 && std::all_of(responses.begin(), responses.end(),
                                [](const v1::AssignStageResponse& r) {
                                  return r.feeds_previous_samples();
                                });
  scheduler_->AddPipeline(id, stages, PipelineRole::kBoth, fed_by_last, kv_pages);
  spdlog::info("pipeline {} serves with {} stage(s){}", id, stages,
               fed_by_last ? ", the last stage's tokens fed to the first over the link" : "");
  AssignRoles();
  wake_scheduler_ = true;
  return absl::OkStatus();
}

void Coordinator::AssignRoles() {
  const int want = wanted_prefill_replicas_;
  const bool split = want > 0 && static_cast<int>(pipelines_.size()) > want;
  // Who runs prompts, in order of preference, so that roles change as little as they can: the
  // prefill pipelines (oldest first), those that did both (oldest first), decode ones (newest
  // first).
  std::vector<int> order;
  for (PipelineRole r : {PipelineRole::kPrefill, PipelineRole::kBoth}) {
    for (const auto& [id, p] : pipelines_) {
      if (scheduler_->role(id) == r) order.push_back(id);
    }
  }
  for (auto it = pipelines_.rbegin(); it != pipelines_.rend(); ++it) {
    if (scheduler_->role(it->first) == PipelineRole::kDecode) order.push_back(it->first);
  }
  for (size_t i = 0; i < order.size(); ++i) {
    const PipelineRole role = !split                          ? PipelineRole::kBoth
                              : static_cast<int>(i) < want ? PipelineRole::kPrefill
                                                           : PipelineRole::kDecode;
    if (scheduler_->role(order[i]) == role) continue;
    scheduler_->SetRole(order[i], role);
    spdlog::info("pipeline {} {}", order[i],
                 role == PipelineRole::kPrefill  ? "runs prompts only"
                 : role == PipelineRole::kDecode ? "decodes only"
                                                 : "runs prompts and decodes");
  }
  // Every prefill pipeline hands off to every decode one: their workers' KV links are made now
  // (joining an NCCL communicator takes most of a second) rather than at the first hand-off.
  if (!split) return;
  for (const auto& [from, p] : pipelines_) {
    if (scheduler_->role(from) != PipelineRole::kPrefill) continue;
    for (const auto& [to, q] : pipelines_) {
      if (scheduler_->role(to) != PipelineRole::kDecode) continue;
      if (warmed_pairs_.insert({from, to}).second) link_warmups_.emplace_back(from, to);
    }
  }
}


void Coordinator::RestoreWantedStages() {
  const int stages = RestoredStages(ClusterStateLocked());
  if (stages == effective_stages_) return;
  spdlog::info("{} workers are up: back to {} stage(s) from {}", UsableWorkers(), stages,
               effective_stages_);
  effective_stages_ = stages;
}

void Coordinator::ForgetDownWorkers() {
  std::erase_if(workers_, [](const auto& entry) {
    return entry.second.state == v1::WORKER_STATE_DOWN;
  });
}


}  // namespace tandem
