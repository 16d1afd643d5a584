// The coordinator's wiring (coordinator.h): its threads, requests in and results back between the
// scheduler (scheduler.h) and the pipelines' streams, failures, the registry and the Admin calls.
// Re-plans are in replan.cc, the KV threads in prefill_handoff.cc.
#include "coordinator/coordinator.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <span>
#include <utility>

#include "absl/random/distributions.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(const CoordinatorConfig& given) {
  if (absl::Status s = ValidateCoordinatorConfig(given); !s.ok()) return s;
  RETURN_IF_ERROR(CheckModelDir(given.model_dir));
  absl::StatusOr<ModelConfig> model = LoadModelConfig(given.model_dir);
  if (!model.ok()) return model.status();
  const int group = model->num_heads / model->num_kv_heads;
  const CoordinatorConfig config = WithModelDefaults(given, model->head_dim, group);
  if (given.kv_page_size < 0 && config.kv_page_size == 0) {
    spdlog::info("KV-cache in contiguous slots: the CUDA backend cannot page heads of head_dim {} "
                 "with {} query heads per kv head (--kv_page_size 16 pages it on CPU workers)",
                 model->head_dim, group);
  }
  if (given.kv_page_size < 0 && KvCacheDTypeOf(config) == KvCacheDType::kFp8E4M3 &&
      !CudaPagesTakeHeads(model->head_dim, group)) {
    spdlog::warn(
        "--kv_cache_dtype {} pages the KV-cache ({} tokens a page), which the CUDA "
        "backend cannot do for heads of head_dim {} with {} query heads per kv head: "
        "CPU workers only",
        config.kv_cache_dtype, config.kv_page_size, model->head_dim, group);
  }
  std::unique_ptr<Coordinator> c(new Coordinator(config));
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
                           .max_slots = MaxSlots(config),
                           .max_batch = MaxBatch(config),
                           .prefill_chunk = config.prefill_chunk,
                           .prefill_budget = PrefillBudget(config),
                           .micro_batches = config.micro_batches,
                           .decode_ahead = config.decode_ahead,
                           .decode_ahead_time = absl::Milliseconds(config.decode_ahead_ms),
                           .max_resumes = config.max_resumes,
                           .admission_quiet = absl::Milliseconds(config.admission_quiet_ms),
                           .admission_wait = absl::Milliseconds(config.admission_wait_ms),
                           .vocab_size = c->limits_.vocab_size,
                           .context_length = c->limits_.context_length,
                           .decode = {},
                           .kv_page_size = config.kv_page_size,
                           .prefix_caching = config.prefix_caching};
  if (const Tokenizer* tokenizer = c->tokenizer_.get()) {
    options.decode = [tokenizer](std::span<const int32_t> ids) { return tokenizer->Decode(ids); };
  }
  absl::MutexLock lock(&c->mu_);
  c->scheduler_ = std::make_unique<Scheduler>(std::move(options));
  c->wanted_stages_ = c->effective_stages_ = config.stages;
  c->wanted_replicas_ = config.replicas;
  c->wanted_prefill_replicas_ = config.prefill_replicas;
  c->wanted_tensor_parallel_ = config.tensor_parallel;
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
  const int planned_slots = (wanted_replicas_ - wanted_prefill_replicas_) * MaxSlots(config_);
  RETURN_IF_ERROR(scheduler_->CheckRoom(static_cast<int>(sequences.size()), planned_slots));
  for (const ValidatedRequest& r : sequences) {
    const int prompt = static_cast<int>(r.prompt.size());
    RETURN_IF_ERROR(scheduler_->CheckFits(
        prompt, std::min(r.max_new_tokens, limits_.context_length - prompt)));
  }
  if (pipelines_.empty() && !planning_ && !replan_needed_) return NoPipelineErrorLocked();
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

int Coordinator::UsableWorkers(int tensor_parallel) {
  int usable = 0;
  for (auto& [id, w] : workers_) {
    usable += (w.state == v1::WORKER_STATE_IDLE || w.state == v1::WORKER_STATE_SERVING) &&
              w.tensor_parallel >= tensor_parallel;
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

int64_t Coordinator::RegisterWorker(const std::string& address, const std::string& backend,
                                    int tensor_parallel) {
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
  w.tensor_parallel = tensor_parallel;
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
      kv.push_back({id, static_cast<int>(s), scheduler_->used_slots(id), MaxSlots(config_)});
    }
  }
  metrics_->running_sequences.Set(running);
  metrics_->waiting_sequences.Set(scheduler_->waiting());
  metrics_->SetKvSlots(kv);
  std::vector<CoordinatorMetrics::KvPageUse> pages;
  for (const auto& [id, p] : pipelines_) {
    if (std::optional<KvPageCounters> c = scheduler_->kv_page_counters(id)) {
      pages.push_back({.pipeline = id,
                       .total = c->pages_total,
                       .used = c->pages_used,
                       .cached = c->pages_cached});
    }
  }
  metrics_->SetKvPages(pages);
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
  t.set_tensor_parallel(wanted_tensor_parallel_);
  t.set_waiting_requests(scheduler_->waiting());
  if (!plan_error_.ok()) t.set_plan_error(plan_error_.ToString());
  for (auto& [id, p] : pipelines_) {
    v1::PipelineInfo* pi = t.add_pipelines();
    pi->set_pipeline_id(id);
    pi->set_tensor_parallel(p->tensor_parallel);
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
                                                      std::optional<int> prefill_replicas,
                                                      std::optional<int> tensor_parallel) {
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
  if (tensor_parallel && *tensor_parallel < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor_parallel: must be >= 1 (or 0: each worker's own), got %d", *tensor_parallel));
  }
  RETURN_IF_ERROR(CheckTopologySize(stages, replicas));
  const int needed = stages * replicas;  // at most kMaxTopologyWorkers
  {
    absl::MutexLock lock(&mu_);
    const int tp = tensor_parallel.value_or(wanted_tensor_parallel_);
    const int usable = UsableWorkers(tp);
    if (needed > usable) {
      return absl::FailedPreconditionError(
          tp > 1 ? absl::StrFormat("%d stages x %d replicas of %d ranks needs %d workers of at "
                                   "least %d ranks (--tensor_parallel); %d are registered and up",
                                   stages, replicas, tp, needed, tp, usable)
                 : absl::StrFormat("%d stages x %d replicas needs %d workers; %d are registered "
                                   "and up",
                                   stages, replicas, needed, usable));
    }
    spdlog::info("topology change: {} stage(s) x {} replica(s), tensor parallel {}", stages,
                 replicas, tp == 0 ? std::string("each worker's") : std::to_string(tp));
    wanted_stages_ = effective_stages_ = stages;
    wanted_replicas_ = replicas;
    if (prefill_replicas) wanted_prefill_replicas_ = *prefill_replicas;
    wanted_tensor_parallel_ = tp;
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
    wi.set_tensor_parallel(w.tensor_parallel);
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
