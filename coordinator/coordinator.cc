// Pipelines of stage workers, what happens when workers come and go, and the wiring of the
// scheduler (scheduler.h) to their streams.
#include "coordinator/coordinator.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <utility>

#include "absl/random/distributions.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/checked_math.h"
#include "common/metrics.h"
#include "common/status_macros.h"
#include "common/thread_name.h"
#include "proto/step_codec.h"
#include "spdlog/spdlog.h"

namespace tandem {
namespace {

constexpr int kMaxMessageBytes = 512 << 20;

// The most workers one topology may ask for: stages x replicas is formed as an int.
constexpr int kMaxTopologyWorkers = 1 << 16;

absl::Status CheckTopologySize(int stages, int replicas) {
  if (!CheckedProduct({stages, replicas}, kMaxTopologyWorkers)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "stages x replicas: %d x %d is more than the %d workers a topology may have", stages,
        replicas, kMaxTopologyWorkers));
  }
  return absl::OkStatus();
}
// A stage may load gigabytes from disk before it answers AssignStage.
constexpr absl::Duration kAssignTimeout = absl::Seconds(300);
// An export or import of a move: gigabytes of KV-cache over gRPC at worst.
constexpr absl::Duration kMoveTimeout = absl::Seconds(300);
// Each RPC of a prefill hand-off: the KV-cache of a few prompts.
constexpr absl::Duration kHandoffTimeout = absl::Seconds(60);

std::shared_ptr<grpc::Channel> MakeWorkerChannel(const std::string& address,
                                                const ClientAuth& auth) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // A dead worker should fail calls fast rather than wait for a reconnect.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return MakeChannel(address, auth, args);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Construction and threads

Coordinator::Coordinator(const CoordinatorConfig& config) : config_(config) {}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(const CoordinatorConfig& config) {
  if (absl::Status s = ValidateCoordinatorConfig(config); !s.ok()) return s;
  RETURN_IF_ERROR(CheckModelDir(config.model_dir));
  std::unique_ptr<Coordinator> c(new Coordinator(config));
  absl::StatusOr<ModelConfig> model = LoadModelConfig(config.model_dir);
  if (!model.ok()) return model.status();
  c->model_ = *model;
  c->limits_.vocab_size = model->vocab_size;
  c->limits_.context_length = config.max_seq_len > 0
                                  ? std::min(config.max_seq_len, model->max_positions)
                                  : model->max_positions;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromDir(config.model_dir);
  if (tok.ok()) {
    c->tokenizer_ = std::move(*tok);
  } else if (tok.status().code() == absl::StatusCode::kNotFound) {
    spdlog::warn("no tokenizer in {} ({}); only token_ids prompts will be accepted",
                 config.model_dir.string(), tok.status().ToString());
  } else {
    // A tokenizer that would split text differently from the model's own is worse than none.
    spdlog::error("the tokenizer in {} cannot be used: {}; only token_ids prompts will be "
                  "accepted",
                  config.model_dir.string(), tok.status().ToString());
  }
  absl::StatusOr<TextConfig> text = LoadTextConfig(config.model_dir, *model, c->tokenizer_.get());
  if (!text.ok()) return text.status();
  c->text_config_ = std::move(*text);
  c->limits_.eos_token_ids = c->text_config_.eos_token_ids;
  c->limits_.eos_token_id =
      c->limits_.eos_token_ids.empty() ? model->eos_token_id : c->limits_.eos_token_ids.front();
  RETURN_IF_ERROR(CheckTopologySize(config.stages, config.replicas));
  if (config.stages > model->num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "config: stages (%d) exceeds the model's %d layers (each stage runs one or more); set "
        "--stages to at most %d",
        config.stages, model->num_layers, model->num_layers));
  }
  SchedulerOptions options{.max_waiting = config.max_waiting.value_or(-1),
                           .max_slots = config.max_slots,
                           .max_batch = config.max_batch,
                           .prefill_chunk = config.prefill_chunk,
                           .prefill_budget = config.prefill_budget,
                           .micro_batches = config.micro_batches,
                           .decode_ahead = config.decode_ahead,
                           .decode_ahead_time = absl::Milliseconds(config.decode_ahead_ms),
                           .max_resumes = config.max_resumes,
                           .admission_quiet = absl::Milliseconds(config.admission_quiet_ms),
                           .admission_wait = absl::Milliseconds(config.admission_wait_ms),
                           .vocab_size = c->limits_.vocab_size,
                           .context_length = c->limits_.context_length,
                           .decode = {}};
  if (const Tokenizer* tokenizer = c->tokenizer_.get()) {
    options.decode = [tokenizer](std::span<const int32_t> ids) { return tokenizer->Decode(ids); };
  }
  absl::MutexLock lock(&c->mu_);
  c->scheduler_ = std::make_unique<Scheduler>(std::move(options));
  c->wanted_stages_ = c->effective_stages_ = config.stages;
  c->wanted_replicas_ = config.replicas;
  c->wanted_prefill_replicas_ = config.prefill_replicas;
  c->next_assignment_ = absl::Uniform<uint64_t>(c->random_, 1, uint64_t{1} << 62);
  return c;
}

// A Coordinator that Create gave up on has no scheduler and no threads: nothing to shut down.
Coordinator::~Coordinator() {
  if (scheduler_ != nullptr) Shutdown();
}

void Coordinator::set_metrics(CoordinatorMetrics* metrics) {
  absl::MutexLock lock(&mu_);
  metrics_ = metrics;
  scheduler_->set_metrics(metrics);
}

void Coordinator::Start() {
  threads_.emplace_back([this] {
    SetThreadName("scheduler");
    SchedulerLoop();
  });
  threads_.emplace_back([this] {
    SetThreadName("health");
    HealthLoop();
  });
  threads_.emplace_back([this] {
    SetThreadName("planner");
    PlannerLoop();
  });
  threads_.emplace_back([this] {
    SetThreadName("handoff");
    HandoffLoop();
  });
  threads_.emplace_back([this] {
    SetThreadName("kv-stream");
    KvStreamLoop();
  });
}

void Coordinator::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    wake_scheduler_ = replan_needed_ = true;
    const absl::Status why = absl::UnavailableError("the coordinator is shutting down");
    scheduler_->FailWaiting(why, absl::Now());
    std::vector<int> ids;
    for (auto& [id, p] : pipelines_) ids.push_back(id);
    for (int id : ids) FailPipeline(id, why);
  }
  for (auto& t : threads_) t.join();
  threads_.clear();
  CloseLinks();
}

void Coordinator::SchedulerLoop() {
  while (true) {
    std::vector<std::shared_ptr<PipelineLink>> out;
    {
      absl::MutexLock lock(&mu_);
      // Woken by arrivals, results and changes; or when new requests held back for others to
      // arrive are due (Scheduler::admit_at).
      const absl::Time now = absl::Now(), admit_at = scheduler_->admit_at();
      const absl::Duration idle = absl::Milliseconds(100);
      mu_.AwaitWithTimeout(absl::Condition(&wake_scheduler_),
                           admit_at > now ? std::min(admit_at - now, idle) : idle);
      if (stopping_) return;
      wake_scheduler_ = false;
      scheduler_->Admit(absl::Now());
      for (auto& [id, p] : pipelines_) {
        if (QueueSteps(*p)) out.push_back(p->link);
      }
      UpdateGauges();
    }
    // Writes happen outside mu_ (a slow stream must not stall the callbacks), in the order the
    // steps were formed under it, whichever thread writes them (PipelineLink::Flush).
    for (auto& link : out) link->Flush();
  }
}

bool Coordinator::QueueSteps(Pipeline& p) {
  bool queued = false;
  for (const StepDescriptor& step : scheduler_->FormSteps(p.id)) {
    p.link->Queue(ToStepRequest(step, p.assignment));
    queued = true;
  }
  return queued;
}

void Coordinator::HealthLoop() {
  std::optional<bool> reported;
  while (true) {
    bool serving = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(50));
      if (stopping_) return;
      MarkSilentWorkersDown();
      serving = !pipelines_.empty();
    }
    if (readiness_observer_ && reported != serving) {
      readiness_observer_(serving);
      reported = serving;
    }
  }
}

void Coordinator::MarkSilentWorkersDown() {
  const absl::Duration timeout = absl::Milliseconds(config_.heartbeat_timeout_ms);
  const absl::Time now = absl::Now();
  std::vector<int64_t> silent;
  for (auto& [id, w] : workers_) {
    if (w.state != v1::WORKER_STATE_DOWN && now - w.last_heartbeat > timeout) silent.push_back(id);
  }
  for (int64_t id : silent) {
    MarkDown(id, absl::StrFormat("no heartbeat for %s", absl::FormatDuration(timeout)));
  }
}

void Coordinator::PlannerLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&replan_needed_), absl::Milliseconds(200));
      if (stopping_) return;
      if (!replan_needed_) continue;
    }
    if (absl::Status s = RunPlan(); !s.ok()) spdlog::warn("re-plan: {}", s.ToString());
  }
}

// ---------------------------------------------------------------------------------------------
// Requests

absl::StatusOr<std::vector<std::shared_ptr<RequestState>>> Coordinator::Submit(
    std::vector<ValidatedRequest> sequences) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the coordinator is shutting down");
  const int planned_slots = (wanted_replicas_ - wanted_prefill_replicas_) * config_.max_slots;
  RETURN_IF_ERROR(scheduler_->CheckRoom(static_cast<int>(sequences.size()), planned_slots));
  if (pipelines_.empty() && !planning_ && !replan_needed_) return NoPipelineErrorLocked();
  const bool wants_prompt_logprobs =
      std::any_of(sequences.begin(), sequences.end(),
                  [](const ValidatedRequest& r) { return r.prompt_logprobs >= 0; });
  if (wants_prompt_logprobs) {
    // The CUDA backend's head scores only the rows it samples.
    for (const auto& [id, w] : workers_) {
      if (w.state == v1::WORKER_STATE_SERVING && w.backend == "cuda") {
        return absl::UnimplementedError(
            "sampling.prompt_logprobs: not computed by CUDA workers, which serve this model");
      }
    }
  }
  std::vector<std::shared_ptr<RequestState>> out;
  const absl::Time now = absl::Now();
  for (ValidatedRequest& r : sequences) {
    if (r.request_id.empty() && !out.empty()) r.request_id = out.front()->request().request_id;
    out.push_back(scheduler_->Enqueue(std::move(r), now));
  }
  wake_scheduler_ = true;
  return out;
}

void Coordinator::Cancel(const std::shared_ptr<RequestState>& request, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  scheduler_->Cancel(request, why, absl::Now());
  wake_scheduler_ = true;
}

void Coordinator::OnStepResult(int pipeline, uint64_t assignment, int stage,
                               const v1::StepResult& r) {
  std::shared_ptr<PipelineLink> link;
  {
    absl::MutexLock lock(&mu_);
    link = OnStepResultLocked(pipeline, assignment, stage, r);
  }
  // This reader thread writes the pipeline's next steps itself: no hand-off to the scheduler
  // thread between a result and the step it allows.
  if (link != nullptr) link->Flush();
}

std::shared_ptr<PipelineLink> Coordinator::OnStepResultLocked(int pipeline, uint64_t assignment,
                                                              int stage, const v1::StepResult& r) {
  auto pit = pipelines_.find(pipeline);
  if (pit == pipelines_.end() || pit->second->assignment != assignment) return nullptr;
  // A failed step (or a result that cannot be trusted) ends the pipeline; its requests continue
  // elsewhere, recomputed, as after a loss (each at most max_resumes times, so that a request
  // that makes steps fail ends with the cause instead of taking the service down).
  if (r.error_code() != 0) {
    FailPipeline(pipeline,
                 absl::Status(static_cast<absl::StatusCode>(r.error_code()),
                              absl::StrFormat("pipeline %d stage %d step %d: %s", pipeline, stage,
                                              r.step_id(), r.error_message())),
                 /*resume=*/true);
    return nullptr;
  }
  const std::vector<SequenceLogprobs> logprobs = LogprobsFromProto(r);
  const std::span<const int32_t> tokens(r.tokens().data(), r.tokens().size());
  if (absl::Status s = scheduler_->OnStepResult(pipeline, r.step_id(), tokens, logprobs,
                                                absl::Now());
      !s.ok()) {
    FailPipeline(pipeline, s, /*resume=*/true);
    return nullptr;
  }
  // The scheduler thread admits waiting requests (a sequence that ended freed its slot) and
  // forms the other pipelines' steps.
  if (scheduler_->waiting() > 0) wake_scheduler_ = true;
  Pipeline& p = *pit->second;
  return QueueSteps(p) ? p.link : nullptr;
}

// ---------------------------------------------------------------------------------------------
// Failures

void Coordinator::OnLinkBroken(int pipeline, uint64_t assignment, int stage,
                               const absl::Status& s) {
  absl::MutexLock lock(&mu_);
  auto pit = pipelines_.find(pipeline);
  if (pit == pipelines_.end() || pit->second->assignment != assignment) return;
  const int64_t worker = pit->second->workers[stage];
  const std::string address = workers_.count(worker) ? workers_[worker].address : "?";
  const std::string why = absl::StrFormat("worker %d (%s), pipeline %d stage %d: %s", worker,
                                          address, pipeline, stage, s.message());
  // A transport failure means the process is gone or unreachable; anything else (a failed step)
  // leaves the worker usable for the re-plan.
  if (s.code() == absl::StatusCode::kUnavailable) {
    MarkDown(worker, why);
  } else {
    FailPipeline(pipeline, absl::UnavailableError(why), /*resume=*/true);
  }
}

void Coordinator::MarkDown(int64_t worker_id, const std::string& why) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.state == v1::WORKER_STATE_DOWN) return;
  WorkerEntry& w = it->second;
  spdlog::warn("worker {} ({}) is down: {}", w.id, w.address, why);
  const int pipeline = w.pipeline;
  w.state = v1::WORKER_STATE_DOWN;
  if (pipeline >= 0) {
    // Its running requests continue on the pipeline that takes them next.
    FailPipeline(pipeline,
                 absl::UnavailableError(absl::StrFormat("worker %d (%s) of pipeline %d is down: %s",
                                                        w.id, w.address, pipeline, why)),
                 /*resume=*/true);
  }
  w.pipeline = -1;
  replan_needed_ = true;
}

void Coordinator::FailPipeline(int pipeline, const absl::Status& why, bool resume) {
  auto pit = pipelines_.find(pipeline);
  if (pit == pipelines_.end()) return;
  Pipeline& p = *pit->second;
  if (const int running = scheduler_->running(pipeline); running > 0) {
    spdlog::warn("pipeline {} removed, {} {} requests: {}", pipeline,
                 resume ? "resuming elsewhere" : "failing", running, why.ToString());
  }
  scheduler_->RemovePipeline(pipeline, why, absl::Now(), resume);
  for (int64_t wid : p.workers) {
    auto wit = workers_.find(wid);
    if (wit == workers_.end()) continue;
    if (wit->second.state == v1::WORKER_STATE_SERVING) wit->second.state = v1::WORKER_STATE_IDLE;
    if (wit->second.pipeline == pipeline) {
      wit->second.pipeline = -1;
      wit->second.stage = -1;
    }
  }
  if (p.link) links_to_close_.push_back(std::move(p.link));
  pipelines_.erase(pit);
  replan_needed_ = true;
  wake_scheduler_ = true;
}

void Coordinator::CloseLinks() {
  std::vector<std::shared_ptr<PipelineLink>> links;
  {
    absl::MutexLock lock(&mu_);
    links.swap(links_to_close_);
  }
  for (auto& l : links) l->Close();
}

// ---------------------------------------------------------------------------------------------
// Planning

std::vector<int> Coordinator::RetiringLocked() {
  std::vector<int> retiring;
  int kept = 0;
  for (auto& [id, p] : pipelines_) {
    bool retire =
        scheduler_->draining(id) || static_cast<int>(p->workers.size()) != effective_stages_;
    for (int64_t w : p->workers) retire |= workers_[w].state == v1::WORKER_STATE_DRAINED;
    if (!retire && kept >= wanted_replicas_) retire = true;
    if (retire) {
      retiring.push_back(id);
    } else {
      ++kept;
    }
  }
  return retiring;
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
    const std::vector<int> retiring = RetiringLocked();
    if (retiring.empty()) return {};
    // The workers RunPlan will find idle once these retire, in its order.
    std::set<int64_t> freed;
    std::vector<KvStage> holders;
    for (int id : retiring) {
      const Pipeline& p = *pipelines_.at(id);
      for (int64_t w : p.workers) freed.insert(w);
      for (KvStage& h : StagesOf(p)) holders.push_back(std::move(h));
    }
    std::vector<int64_t> idle;
    for (auto& [wid, w] : workers_) {
      if (w.state == v1::WORKER_STATE_IDLE ||
          (w.state == v1::WORKER_STATE_SERVING && freed.contains(wid))) {
        idle.push_back(wid);
      }
    }
    const int stages = effective_stages_;
    int live = static_cast<int>(pipelines_.size() - retiring.size());
    absl::StatusOr<std::vector<LayerRange>> ranges = PlanEvenPartition(model_.num_layers, stages);
    if (!ranges.ok()) return {};
    size_t next = 0;
    while (live < wanted_replicas_ && idle.size() - next >= static_cast<size_t>(stages)) {
      Planned plan;
      plan.id = next_pipeline_id_++;
      plan.assignment = next_assignment_++;
      plan.workers.assign(idle.begin() + next, idle.begin() + next + stages);
      plan.ranges = *ranges;
      next += stages;
      ++live;
      std::vector<std::string> addresses;
      std::vector<std::shared_ptr<grpc::Channel>> chans;
      bool cuda = true;
      for (int s = 0; s < stages; ++s) {
        const WorkerEntry& w = workers_.at(plan.workers[s]);
        addresses.push_back(w.address);
        chans.push_back(w.channel);
        cuda = cuda && w.backend == "cuda";
        if (!config_.move_kv || w.backend != "cuda") continue;
        for (const KvStage& h : holders) {
          const bool overlap = h.layers.first < plan.ranges[s].last &&
                               plan.ranges[s].first < h.layers.last;
          if (overlap && h.worker != w.id && workers_.at(h.worker).backend == "cuda") {
            kv_sources[w.id].insert(h.address);
            kv_takers[w.id] = w.channel;
          }
        }
      }
      plan.requests = StageRequests(plan.id, plan.assignment, addresses, plan.ranges);
      for (v1::AssignStageRequest& r : plan.requests) r.set_prepare(true);
      plans.push_back(std::move(plan));
      channels.push_back(std::move(chans));
      all_cuda.push_back(cuda);
    }
  }
  std::vector<Planned> ready;
  for (size_t i = 0; i < plans.size(); ++i) {
    Planned& plan = plans[i];
    const absl::Time t0 = absl::Now();
    std::vector<v1::AssignStageResponse> responses;
    if (std::optional<StageAssignError> err = AssignPipelineStages(
            channels[i], plan.requests, kAssignTimeout, &responses, all_cuda[i])) {
      spdlog::warn("pipeline {} not prepared ahead (its stages load when assigned): stage {}: {}",
                   plan.id, err->stage, err->status.error_message());
      continue;
    }
    int64_t placed = 0;
    for (const v1::AssignStageResponse& r : responses) placed += r.placed_bytes();
    spdlog::info("pipeline {} prepared in {:.3f} s ({} bytes of weights placed ahead)", plan.id,
                 absl::ToDoubleSeconds(absl::Now() - t0), placed);
    ready.push_back(std::move(plan));
  }
  // The KV links the moves will fetch over, made now rather than in the pause.
  for (const auto& [worker, addresses] : kv_sources) {
    const absl::Time t0 = absl::Now();
    v1::ImportKvRequest req;
    for (const std::string& a : addresses) req.add_sources()->set_address(a);
    v1::ImportKvResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + kHandoffTimeout));
    const grpc::Status st = v1::Worker::NewStub(kv_takers[worker])->ImportKv(&ctx, req, &resp);
    if (st.ok()) {
      spdlog::info("KV links of worker {} to {} made in {:.3f} s", worker,
                   absl::StrJoin(addresses, ", "), absl::ToDoubleSeconds(absl::Now() - t0));
    } else {
      spdlog::warn("KV links of worker {} not made ahead (the move makes them): {}", worker,
                   st.error_message());
    }
  }
  return ready;
}

absl::Status Coordinator::RunPlan() {
  absl::MutexLock plan(&plan_mu_);
  CloseLinks();
  std::vector<Planned> planned = PrepareReplacements();
  std::vector<std::pair<std::shared_ptr<grpc::Channel>, uint64_t>> releases;
  std::vector<int> retiring;
  std::vector<Departure> departures;
  const absl::Time paused = absl::Now();
  double drain_s = config_.drain_timeout_s;
  {
    absl::MutexLock lock(&mu_);
    planning_ = true;
    replan_needed_ = false;
    RestoreWantedStages();
    retiring = RetiringLocked();
    for (int id : retiring) scheduler_->SetDraining(id);
    // The retiring stages of workers that no prepared pipeline takes.
    for (int id : retiring) {
      const Pipeline& p = *pipelines_.at(id);
      for (int64_t w : p.workers) {
        const bool taken = std::any_of(planned.begin(), planned.end(), [w](const Planned& n) {
          return std::find(n.workers.begin(), n.workers.end(), w) != n.workers.end();
        });
        if (!taken) releases.emplace_back(workers_.at(w).channel, p.assignment);
      }
    }
    if (!retiring.empty() && config_.move_kv) {
      departures = DetachForMove(retiring);
    } else if (!retiring.empty()) {
      spdlog::info("draining {} pipeline(s) for the new topology", retiring.size());
      auto drained = [this, &retiring]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        for (int id : retiring) {
          if (scheduler_->running(id) > 0) return false;
        }
        return true;
      };
      mu_.AwaitWithTimeout(absl::Condition(&drained), absl::Seconds(drain_s));
    }
    if (!retiring.empty()) {
      for (int id : retiring) {
        FailPipeline(id,
                     absl::UnavailableError(
                         "the pipeline was retired by a topology change before it drained"),
                     /*resume=*/true);
      }
    }
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
  std::vector<std::thread> releasing;
  auto release = [&releasing](std::shared_ptr<grpc::Channel> channel, uint64_t assignment) {
    releasing.emplace_back([channel = std::move(channel), assignment] {
      v1::ReleaseStageRequest req;
      req.set_assignment_id(assignment);
      v1::ReleaseStageResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + kAssignTimeout));
      const grpc::Status st = v1::Worker::NewStub(channel)->ReleaseStage(&ctx, req, &resp);
      if (!st.ok() && st.error_code() != grpc::StatusCode::UNIMPLEMENTED) {
        spdlog::warn("assignment {}: stage not released: {}", assignment, st.error_message());
      }
    });
  };
  for (const auto& [channel, assignment] : releases) release(channel, assignment);

  absl::Status result;
  while (true) {
    std::vector<int64_t> chosen;
    std::vector<LayerRange> ranges;
    std::vector<v1::AssignStageRequest> requests;  // a prepare's
    int id = 0;
    uint64_t assignment = 0;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
      const int live = static_cast<int>(pipelines_.size());
      if (live >= wanted_replicas_) break;
      std::vector<int64_t> idle;
      for (auto& [wid, w] : workers_) {
        if (w.state == v1::WORKER_STATE_IDLE) idle.push_back(wid);
      }
      int stages = effective_stages_;
      if (static_cast<int>(idle.size()) < stages) {
        // After a loss, serve on what is left rather than not at all.
        if (live == 0 && planned_once_ && !idle.empty()) {
          stages = static_cast<int>(idle.size());
          spdlog::warn("only {} workers left: serving with {} stage(s) instead of {}", stages,
                       stages, effective_stages_);
          effective_stages_ = stages;
        } else {
          break;
        }
      }
      absl::StatusOr<std::vector<LayerRange>> plan = PlanEvenPartition(model_.num_layers, stages);
      if (!plan.ok()) {
        result = plan.status();
        break;
      }
      ranges = *plan;
      // A prepared pipeline where its workers are idle as planned; otherwise the first idle ones.
      auto prepared = std::find_if(planned.begin(), planned.end(), [&](const Planned& p) {
        return p.ranges == ranges &&
               std::all_of(p.workers.begin(), p.workers.end(), [&](int64_t w) {
                 return std::find(idle.begin(), idle.end(), w) != idle.end();
               });
      });
      if (prepared != planned.end()) {
        id = prepared->id;
        assignment = prepared->assignment;
        chosen = prepared->workers;
        requests = std::move(prepared->requests);
        planned.erase(prepared);
      } else {
        chosen.assign(idle.begin(), idle.begin() + stages);
        id = next_pipeline_id_++;
        assignment = next_assignment_++;
      }
      for (int s = 0; s < stages; ++s) {
        WorkerEntry& w = workers_[chosen[s]];
        w.state = v1::WORKER_STATE_SERVING;
        w.pipeline = id;
        w.stage = s;
        w.layers = ranges[s];
      }
    }
    absl::Status s = BuildPipeline(id, assignment, chosen, ranges, std::move(requests));
    if (!s.ok()) {
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
        result = s;
        break;
      }
    }
  }

  // Pipelines prepared but not built (their workers were not idle as planned): the workers drop
  // what they got ready for them (their links and placed weights).
  for (const Planned& plan : planned) {
    spdlog::info("pipeline {} was prepared but not built: its workers drop what they prepared",
                 plan.id);
    for (int64_t w : plan.workers) {
      std::shared_ptr<grpc::Channel> channel;
      {
        absl::MutexLock lock(&mu_);
        auto it = workers_.find(w);
        if (it != workers_.end()) channel = it->second.channel;
      }
      if (channel != nullptr) release(std::move(channel), plan.assignment);
    }
  }
  for (std::thread& t : releasing) t.join();
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
    for (const Scheduler::Held& h : scheduler_->Detach(id)) {
      d.seqs.push_back({.key = h.seq, .slot = h.slot, .positions = h.positions});
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
        arrivals[t->pipeline].push_back({.key = q.key, .slot = t->slot, .positions = q.positions});
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

std::vector<v1::AssignStageRequest> Coordinator::StageRequests(
    int id, uint64_t assignment, const std::vector<std::string>& addresses,
    const std::vector<LayerRange>& ranges) const {
  const int stages = static_cast<int>(addresses.size());
  std::vector<v1::AssignStageRequest> requests(stages);
  for (int s = 0; s < stages; ++s) {
    v1::AssignStageRequest& req = requests[s];
    req.set_assignment_id(assignment);
    req.set_pipeline_id(id);
    req.set_stage(s);
    req.set_num_stages(stages);
    req.set_model_dir(config_.model_dir.string());
    req.set_first_layer(ranges[s].first);
    req.set_last_layer(ranges[s].last);
    req.set_max_slots(config_.max_slots);
    req.set_max_seq_len(limits_.context_length);
    req.set_max_step_rows(static_cast<int64_t>(config_.max_batch) * config_.prefill_chunk);
    if (s + 1 < stages) req.set_next_address(addresses[s + 1]);
  }
  return requests;
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
    requests = StageRequests(id, assignment, addresses, ranges);
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
  p->link = std::move(link);
  pipelines_.emplace(id, std::move(p));
  // Steps may go ahead of the tokens they feed where the first stage gets them from the last.
  const bool fed_by_last =
      stages > 1 && std::all_of(responses.begin(), responses.end(),
                                [](const v1::AssignStageResponse& r) {
                                  return r.feeds_previous_samples();
                                });
  scheduler_->AddPipeline(id, stages, PipelineRole::kBoth, fed_by_last);
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
        in.push_back({.key = k.seq, .slot = k.to_slot, .positions = k.positions});
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
        out.push_back({.key = h.seq, .slot = h.from_slot, .positions = h.positions});
        in.push_back({.key = h.seq, .slot = h.to_slot, .positions = h.positions});
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

void Coordinator::RestoreWantedStages() {
  if (effective_stages_ >= wanted_stages_ || UsableWorkers() < wanted_stages_) return;
  spdlog::info("{} workers are up: back to {} stage(s) from {}", UsableWorkers(), wanted_stages_,
               effective_stages_);
  effective_stages_ = wanted_stages_;
}

void Coordinator::ForgetDownWorkers() {
  std::erase_if(workers_, [](const auto& entry) {
    return entry.second.state == v1::WORKER_STATE_DOWN;
  });
}

int Coordinator::UsableWorkers() {
  int usable = 0;
  for (auto& [id, w] : workers_) {
    usable += w.state == v1::WORKER_STATE_IDLE || w.state == v1::WORKER_STATE_SERVING;
  }
  return usable;
}

// ---------------------------------------------------------------------------------------------
// Registry and Admin

int64_t Coordinator::NewWorkerId() {
  while (true) {
    const int64_t id = absl::Uniform<int64_t>(random_, 1, std::numeric_limits<int64_t>::max());
    if (!workers_.contains(id)) return id;
  }
}

int64_t Coordinator::RegisterWorker(const std::string& address, const std::string& backend) {
  absl::MutexLock lock(&mu_);
  // A worker that restarted on the same address replaces its old entry.
  std::vector<int64_t> stale;
  for (auto& [id, w] : workers_) {
    if (w.address == address && w.state != v1::WORKER_STATE_DOWN) stale.push_back(id);
  }
  for (int64_t id : stale) MarkDown(id, "it registered again");
  WorkerEntry w;
  w.id = NewWorkerId();
  w.address = address;
  w.backend = backend;
  w.channel = MakeWorkerChannel(address, worker_auth_);
  w.last_heartbeat = absl::Now();
  spdlog::info("worker {} registered: {} ({})", w.id, address, backend);
  const int64_t id = w.id;
  workers_.emplace(id, std::move(w));
  replan_needed_ = true;
  return id;
}

bool Coordinator::Heartbeat(int64_t worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.state == v1::WORKER_STATE_DOWN) return false;
  it->second.last_heartbeat = absl::Now();
  return true;
}

int Coordinator::LivePipelines() { return static_cast<int>(pipelines_.size()); }

void Coordinator::UpdateGauges() {
  if (metrics_ == nullptr) return;
  int running = 0;
  std::vector<CoordinatorMetrics::KvUse> kv;
  for (auto& [id, p] : pipelines_) {
    running += scheduler_->running(id);
    // Every stage of a pipeline holds the same slots (the scheduler allocates them).
    for (size_t s = 0; s < p->workers.size(); ++s) {
      kv.push_back({id, static_cast<int>(s), scheduler_->used_slots(id), config_.max_slots});
    }
  }
  metrics_->running_sequences.Set(running);
  metrics_->waiting_sequences.Set(scheduler_->waiting());
  metrics_->SetKvSlots(kv);
  for (auto& [address, up] : addresses_up_) up = false;
  for (auto& [id, w] : workers_) {
    const bool is_up =
        w.state == v1::WORKER_STATE_IDLE || w.state == v1::WORKER_STATE_SERVING;
    addresses_up_[w.address] |= is_up;  // a restarted worker reuses its address
  }
  metrics_->SetWorkersUp(addresses_up_);
}

absl::Status Coordinator::NoPipelineErrorLocked() const {
  return absl::UnavailableError(
      plan_error_.ok() ? "no pipeline is serving: no (or too few) workers are up"
                       : absl::StrCat("no pipeline is serving: ", plan_error_.message()));
}

v1::Topology Coordinator::TopologyLocked() {
  v1::Topology t;
  t.set_stages(wanted_stages_);
  t.set_replicas(wanted_replicas_);
  t.set_prefill_replicas(wanted_prefill_replicas_);
  t.set_waiting_requests(scheduler_->waiting());
  if (!plan_error_.ok()) t.set_plan_error(plan_error_.ToString());
  for (auto& [id, p] : pipelines_) {
    v1::PipelineInfo* pi = t.add_pipelines();
    pi->set_pipeline_id(id);
    pi->set_running_sequences(scheduler_->running(id));
    pi->set_free_slots(scheduler_->free_slots(id));
    const PipelineRole role = scheduler_->role(id);
    pi->set_role(role == PipelineRole::kPrefill  ? "prefill"
                 : role == PipelineRole::kDecode ? "decode"
                                                    : "both");
    for (size_t s = 0; s < p->workers.size(); ++s) {
      v1::StagePlacement* sp = pi->add_stages();
      sp->set_stage(static_cast<int>(s));
      sp->set_worker_id(p->workers[s]);
      sp->set_worker_address(workers_[p->workers[s]].address);
      sp->set_first_layer(p->ranges[s].first);
      sp->set_last_layer(p->ranges[s].last);
    }
  }
  return t;
}

v1::Topology Coordinator::GetTopology() {
  absl::MutexLock lock(&mu_);
  return TopologyLocked();
}

absl::StatusOr<v1::Topology> Coordinator::SetTopology(int stages, int replicas,
                                                      std::optional<int> prefill_replicas) {
  if (stages < 1 || stages > model_.num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "stages: must be between 1 and the model's %d layers, got %d", model_.num_layers, stages));
  }
  if (replicas < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("replicas: must be >= 1, got %d", replicas));
  }
  if (prefill_replicas && (*prefill_replicas < 0 ||
                           (*prefill_replicas > 0 && *prefill_replicas >= replicas))) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "prefill_replicas: %d (expected 0, or fewer than the %d replicas, so that one decodes)",
        *prefill_replicas, replicas));
  }
  RETURN_IF_ERROR(CheckTopologySize(stages, replicas));
  const int needed = stages * replicas;  // at most kMaxTopologyWorkers
  {
    absl::MutexLock lock(&mu_);
    const int usable = UsableWorkers();
    if (needed > usable) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%d stages x %d replicas needs %d workers; %d are registered and up", stages, replicas,
          needed, usable));
    }
    spdlog::info("topology change: {} stage(s) x {} replica(s)", stages, replicas);
    wanted_stages_ = effective_stages_ = stages;
    wanted_replicas_ = replicas;
    if (prefill_replicas) wanted_prefill_replicas_ = *prefill_replicas;
  }
  absl::Status s = RunPlan();
  absl::MutexLock lock(&mu_);
  if (!s.ok()) return s;
  if (LivePipelines() < wanted_replicas_) {
    return absl::UnavailableError(absl::StrFormat(
        "only %d of %d pipelines could be built (workers failed while loading)", LivePipelines(),
        wanted_replicas_));
  }
  return TopologyLocked();
}

std::vector<v1::WorkerInfo> Coordinator::ListWorkers() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  std::vector<v1::WorkerInfo> out;
  for (auto& [id, w] : workers_) {
    v1::WorkerInfo wi;
    wi.set_worker_id(id);
    wi.set_address(w.address);
    wi.set_backend(w.backend);
    wi.set_state(w.state);
    wi.set_pipeline_id(w.pipeline);
    wi.set_stage(w.pipeline >= 0 ? w.stage : -1);
    wi.set_first_layer(w.pipeline >= 0 ? w.layers.first : 0);
    wi.set_last_layer(w.pipeline >= 0 ? w.layers.last : 0);
    wi.set_seconds_since_heartbeat(absl::ToDoubleSeconds(now - w.last_heartbeat));
    out.push_back(std::move(wi));
  }
  return out;
}

absl::StatusOr<Coordinator::WorkerEntry*> Coordinator::FindWorker(int64_t worker_id) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrFormat("worker_id: no worker %d", worker_id));
  }
  return &it->second;
}

absl::StatusOr<v1::Topology> Coordinator::Drain(int64_t worker_id) {
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<WorkerEntry*> w = FindWorker(worker_id);
    if (!w.ok()) return w.status();
    if ((*w)->state == v1::WORKER_STATE_DOWN) {
      return absl::FailedPreconditionError(
          absl::StrFormat("worker_id: worker %d is already down", worker_id));
    }
    (*w)->state = v1::WORKER_STATE_DRAINED;
    replan_needed_ = true;
  }
  if (absl::Status s = RunPlan(); !s.ok()) return s;
  return GetTopology();
}

absl::StatusOr<v1::Topology> Coordinator::Undrain(int64_t worker_id) {
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<WorkerEntry*> w = FindWorker(worker_id);
    if (!w.ok()) return w.status();
    if ((*w)->state != v1::WORKER_STATE_DRAINED) {
      return absl::FailedPreconditionError(
          absl::StrFormat("worker_id: worker %d is not drained (it is %s)", worker_id,
                          v1::WorkerState_Name((*w)->state)));
    }
    spdlog::info("worker {} ({}) is back in service", worker_id, (*w)->address);
    (*w)->state = v1::WORKER_STATE_IDLE;
    replan_needed_ = true;
  }
  if (absl::Status s = RunPlan(); !s.ok()) return s;
  return GetTopology();
}

}  // namespace tandem
