// Worker service: assignment, the ordered step loop, the KV-cache RPCs (handed to kv_moves.h).
// Registration and heartbeats: registrar.cc.
#include "worker/service/worker_service.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <optional>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checked_math.h"
#include "common/metrics.h"
#include "common/model_config.h"
#include "common/status_macros.h"
#include "common/thread_name.h"
#include "proto/grpc_status.h"
#include "proto/step_codec.h"
#include "spdlog/spdlog.h"
#include "worker/model_root.h"

namespace tandem {
namespace {

// How often an executor holding a launched step looks whether it ended while it waits for the
// next request.
constexpr absl::Duration kLaunchedPoll = absl::Microseconds(50);
// Positions of the KV-cache of the stage a prepare warms up (Backend::WarmUp).
constexpr int kWarmUpPositions = 16;

v1::StepResult ErrorResult(uint64_t step, const absl::Status& s) {
  v1::StepResult r;
  r.set_step_id(step);
  r.set_error_code(static_cast<int>(s.code()));
  r.set_error_message(std::string(s.message()));
  return r;
}

// Rows of the largest step of an assignment: max_step_rows, or every slot's whole context when
// the coordinator gave none.
int64_t MaxStepRows(const v1::AssignStageRequest& req) {
  if (req.max_step_rows() > 0) return req.max_step_rows();
  return CheckedProduct({std::max(req.max_slots(), 1), std::max(req.max_seq_len(), 1)})
      .value_or(std::numeric_limits<int64_t>::max());
}

// Over gRPC, the largest step's activations must fit one StageLink message.
grpc::Status CheckStepFitsLink(const v1::AssignStageRequest& req, int hidden_size) {
  const int64_t rows = MaxStepRows(req);
  const std::optional<int64_t> bytes = StageMessageBytes(rows, hidden_size);
  if (bytes && *bytes <= kMaxStageMessageBytes) return grpc::Status::OK;
  return grpc::Status(
      grpc::StatusCode::INVALID_ARGUMENT,
      absl::StrFormat("max_step_rows: a step of %d rows x hidden_size %d x 4 bytes does not fit "
                      "the %d bytes of a StageLink message; lower max_batch or prefill_chunk",
                      rows, hidden_size, kMaxStageMessageBytes - kStageMessageHeadroom));
}

}  // namespace

WorkerService::WorkerService(std::unique_ptr<Backend> backend, ActivationInbox& inbox,
                             absl::Duration recv_timeout, LinkOptions link)
    : backend_(std::move(backend)),
      inbox_(inbox),
      recv_timeout_(recv_timeout),
      link_(std::move(link)),
      kv_({.backend = backend_.get(), .peer_auth = link_.peer_auth}) {}

grpc::Status WorkerService::PrepareLink(grpc::ServerContext* ctx,
                                        const v1::PrepareLinkRequest* req,
                                        v1::PrepareLinkResponse* resp) {
  if (grpc::Status a = CheckCaller(*ctx, callers_); !a.ok()) return a;
  if (link_.transport != "nccl" || req->num_stages() < 2) {
    resp->set_transport("grpc");
    return grpc::Status::OK;
  }
  if (!backend_->has_nccl()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "transport nccl: this worker has no NCCL (a CUDA build with --backend=cuda)");
  }
  absl::StatusOr<std::string> id = backend_->MakeNcclId();
  if (!id.ok()) {
    spdlog::error("assignment {}: ncclUniqueId: {}", req->assignment_id(), id.status().ToString());
    return grpc::Status(grpc::StatusCode::INTERNAL,
                        absl::StrCat("ncclUniqueId: ", std::string(id.status().message())));
  }
  resp->set_transport("nccl");
  resp->set_nccl_id(*std::move(id));
  return grpc::Status::OK;
}

grpc::Status WorkerService::CheckAssignment(const v1::AssignStageRequest& req, StageSpec* spec,
                                            std::string* transport) {
  if (req.num_stages() < 1 || req.stage() < 0 || req.stage() >= req.num_stages()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrFormat("stage: %d of %d", req.stage(), req.num_stages()));
  }
  if ((req.stage() + 1 < req.num_stages()) == req.next_address().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "next_address: required on every stage but the last, and only there");
  }
  // A single stage has no neighbour to link to.
  *transport = req.transport().empty() || req.num_stages() == 1 ? "grpc" : req.transport();
  if (*transport != "grpc" && *transport != "nccl") {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("transport: '", *transport, "' (expected grpc or nccl)"));
  }
  if (*transport == "nccl" && !backend_->has_nccl()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "transport nccl: this worker has no NCCL (a CUDA build with --backend=cuda)");
  }
  absl::StatusOr<std::filesystem::path> model_dir = ResolveModelDir(model_root_, req.model_dir());
  if (!model_dir.ok()) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, std::string(model_dir.status().message()));
  }
  spec->model_dir = *model_dir;
  spec->first_layer = req.first_layer();
  spec->last_layer = req.last_layer();
  spec->max_slots = req.max_slots();
  spec->max_seq_len = req.max_seq_len();
  spec->kv_page_size = req.kv_page_size();
  spec->kv_pages = req.kv_pages();
  absl::StatusOr<KvCacheDType> kv_dtype = ParseKvCacheDType(req.kv_cache_dtype(), "kv_cache_dtype");
  if (!kv_dtype.ok()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        std::string(kv_dtype.status().message()));
  }
  spec->kv_cache_fp8 = *kv_dtype == KvCacheDType::kFp8E4M3;
  if (const int most = backend_->tensor_parallel();
      req.tensor_parallel() < 0 || req.tensor_parallel() > most) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("tensor_parallel ", req.tensor_parallel(),
                                     ": this worker splits a stage over at most ", most,
                                     " rank(s) (--tensor_parallel ", most, ")"));
  }
  spec->tensor_parallel = req.tensor_parallel();
  if (spec->kv_cache_fp8 && spec->kv_page_size <= 0) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("kv_cache_dtype ", req.kv_cache_dtype(),
                     " needs the paged KV-cache, but kv_page_size is ", req.kv_page_size()));
  }
  if (spec->kv_cache_fp8 && !backend_->has_fp8_kv_cache()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("kv_cache_dtype ", req.kv_cache_dtype(),
                                     ": this worker's backend keeps no FP8 KV-cache"));
  }
  // A pipeline's link is sized from the model's width (a single stage has none; nccl is only
  // chosen for more than one).
  if (req.num_stages() > 1) {
    absl::StatusOr<ModelConfig> config = LoadModelConfig(spec->model_dir);
    if (!config.ok()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          std::string(config.status().message()));
    }
    if (*transport == "grpc") return CheckStepFitsLink(req, config->hidden_size);
  }
  return grpc::Status::OK;
}

absl::StatusOr<std::unique_ptr<ActivationTransport>> WorkerService::JoinPipelineLink(
    const v1::AssignStageRequest& req, const StageSpec& spec) {
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(spec.model_dir));
  NcclJoin join;
  join.unique_id = req.nccl_id();
  join.rank = req.stage();
  join.world = req.num_stages();
  join.hidden_size = config.hidden_size;
  join.max_rows = MaxStepRows(req);
  absl::StatusOr<std::unique_ptr<ActivationTransport>> t = backend_->JoinNccl(join);
  if (!t.ok()) {
    spdlog::error("assignment {}: NCCL: {}", req.assignment_id(), t.status().ToString());
    return absl::Status(t.status().code() == absl::StatusCode::kInvalidArgument
                            ? absl::StatusCode::kInvalidArgument
                            : absl::StatusCode::kFailedPrecondition,
                        absl::StrCat("NCCL link of stage ", req.stage(), ": ",
                                     t.status().message()));
  }
  return t;
}

grpc::Status WorkerService::Prepare(const v1::AssignStageRequest& req, const StageSpec& spec,
                                    const std::string& transport,
                                    v1::AssignStageResponse* resp) {
  const absl::Time t0 = absl::Now();
  // A checkpoint that cannot be read is refused now rather than when the assignment comes.
  if (absl::StatusOr<ModelConfig> c = LoadModelConfig(spec.model_dir); !c.ok()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, std::string(c.status().message()));
  }
  // One at a time: an older one's weights go, and its link (closing waits for the peers).
  if (prepared_ != nullptr) CloseLinkInBackground(std::move(prepared_->nccl));
  prepared_.reset();
  auto p = std::make_unique<Prepared>();
  p->request = req;
  p->request.set_prepare(false);
  if (transport == "nccl") {
    absl::StatusOr<std::unique_ptr<ActivationTransport>> t = JoinPipelineLink(req, spec);
    if (!t.ok()) return ToGrpcStatus(t.status());
    p->nccl = *std::move(t);
    // The first and last stages' token communicator too (StepRunnerOptions::feed_first).
    if (absl::Status st = p->nccl->SeparateTokens(); !st.ok()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("NCCL link of stage ", req.stage(), ": ",
                                       std::string(st.message())));
    }
  }
  if (backend_->places_weights()) {
    StageSpec want = spec;
    {
      absl::MutexLock lock(&mu_);
      if (current_ != nullptr) want.placed = current_->engine->placed_weights();
    }
    absl::StatusOr<std::shared_ptr<const PlacedWeights>> w = backend_->PlaceWeights(want);
    if (w.ok()) {
      p->weights = *std::move(w);
    } else {
      // Not fatal: the assignment loads them itself.
      spdlog::warn("assignment {}: weights not placed ahead: {}", req.assignment_id(),
                   w.status().ToString());
    }
    // A worker's first stage: a throwaway one on the weights just placed, with a KV-cache of a
    // few positions, so that the libraries' and kernels' code is loaded now, not in the pause.
    if (!made_a_stage_ && p->weights != nullptr) {
      const absl::Time w0 = absl::Now();
      StageSpec small = want;
      small.placed.push_back(p->weights);
      small.max_seq_len = std::min(spec.max_seq_len > 0 ? spec.max_seq_len : kWarmUpPositions,
                                   kWarmUpPositions);
      if (absl::Status st = backend_->WarmUp(small); st.ok()) {
        made_a_stage_ = true;
        spdlog::info("assignment {}: a first stage warmed up in {:.3f} s", req.assignment_id(),
                     absl::ToDoubleSeconds(absl::Now() - w0));
      } else {
        spdlog::warn("assignment {}: no stage warmed up ahead: {}", req.assignment_id(),
                     st.ToString());
      }
    }
  }
  resp->set_placed_bytes(p->weights != nullptr ? p->weights->bytes() : 0);
  resp->set_load_seconds(absl::ToDoubleSeconds(absl::Now() - t0));
  spdlog::info("assignment {}: prepared stage {}/{} layers [{}, {}) in {:.3f} s ({} link, {} "
               "bytes of weights placed)",
               req.assignment_id(), req.stage(), req.num_stages(), req.first_layer(),
               req.last_layer(), resp->load_seconds(), transport, resp->placed_bytes());
  prepared_ = std::move(p);
  return grpc::Status::OK;
}

void WorkerService::CloseInBackground(std::shared_ptr<Assignment> a, bool drained) {
  if (a == nullptr) return;
  std::unique_ptr<ActivationTransport> link;
  if (drained && a.use_count() == 1) {
    a->runner.reset();
    link = std::move(a->transport);
  }
  a.reset();  // the stage: its memory is free for the next one
  CloseLinkInBackground(std::move(link));
}

void WorkerService::CloseLinkInBackground(std::unique_ptr<ActivationTransport> link) {
  if (link == nullptr) return;
  absl::MutexLock lock(&closing_mu_);
  // The closes that ended are joined; one still waiting for its peers is left to its thread.
  std::erase_if(closing_, [](Closing& c) {
    if (!c.done->load()) return false;
    c.thread.join();
    return true;
  });
  auto done = std::make_shared<std::atomic<bool>>(false);
  closing_.push_back({std::thread([link = std::move(link), done]() mutable {
                        SetThreadName("link-close");
                        link.reset();
                        done->store(true);
                      }),
                      done});
}

WorkerService::~WorkerService() {
  absl::MutexLock lock(&closing_mu_);
  for (Closing& c : closing_) c.thread.join();
}

grpc::Status WorkerService::ReleaseStage(grpc::ServerContext* ctx,
                                         const v1::ReleaseStageRequest* req,
                                         v1::ReleaseStageResponse* resp) {
  if (grpc::Status a = CheckCaller(*ctx, callers_); !a.ok()) return a;
  const absl::Time t0 = absl::Now();
  std::shared_ptr<Assignment> old;
  std::unique_ptr<Prepared> prepared;
  {
    absl::MutexLock assign(&assign_mu_);
    absl::MutexLock lock(&mu_);
    if (current_ != nullptr && current_->id == req->assignment_id()) old = std::move(current_);
    if (prepared_ != nullptr && prepared_->request.assignment_id() == req->assignment_id()) {
      prepared = std::move(prepared_);
    }
  }
  resp->set_released(old != nullptr || prepared != nullptr);
  if (prepared != nullptr) {
    CloseLinkInBackground(std::move(prepared->nccl));
    prepared.reset();  // its placed weights, unless a stage took them too
    spdlog::info("assignment {}: prepared stage released", req->assignment_id());
  }
  if (old == nullptr) return grpc::Status::OK;
  CloseInBackground(std::move(old), /*drained=*/true);
  spdlog::info("assignment {}: stage released in {:.3f} s", req->assignment_id(),
               absl::ToDoubleSeconds(absl::Now() - t0));
  return grpc::Status::OK;
}

void WorkerService::DropCurrentFor(StageSpec& spec, bool drained) {
  std::shared_ptr<Assignment> old;
  {
    absl::MutexLock lock(&mu_);
    if (current_ != nullptr) {
      for (std::shared_ptr<const PlacedWeights>& w : current_->engine->placed_weights()) {
        if (w->last_layer() > spec.first_layer &&
            (spec.last_layer < 0 || w->first_layer() < spec.last_layer)) {
          spec.placed.push_back(std::move(w));
        }
      }
    }
    old = std::move(current_);
  }
  CloseInBackground(std::move(old), drained);
}

absl::StatusOr<std::unique_ptr<Stage>> WorkerService::MakeStage(StageSpec& spec) {
  absl::StatusOr<std::unique_ptr<Stage>> stage = backend_->MakeStage(spec);
  if (absl::IsResourceExhausted(stage.status()) && kv_.SpillToHost() > 0) {
    stage = backend_->MakeStage(spec);  // with the GPU memory the stash held
  }
  if (absl::IsResourceExhausted(stage.status()) && !spec.placed.empty()) {
    spec.placed.clear();  // arenas held whole for some of their layers: load just what it needs
    stage = backend_->MakeStage(spec);
  }
  return stage;
}

grpc::Status WorkerService::StageError(const v1::AssignStageRequest& req, const absl::Status& s) {
  spdlog::error("assignment {}: {}", req.assignment_id(), s.ToString());
  // INVALID_ARGUMENT (sizes that overflow, a malformed checkpoint) and RESOURCE_EXHAUSTED (a
  // KV-cache that does not fit) keep their code; other failures are the worker's state.
  const bool sizes = s.code() == absl::StatusCode::kInvalidArgument ||
                     s.code() == absl::StatusCode::kResourceExhausted;
  return grpc::Status(
      sizes ? static_cast<grpc::StatusCode>(s.code()) : grpc::StatusCode::FAILED_PRECONDITION,
      std::string(s.message()));
}

absl::StatusOr<std::shared_ptr<Assignment>> WorkerService::NewAssignment(
    const v1::AssignStageRequest& req, const StageSpec& spec, std::unique_ptr<Stage> stage,
    std::unique_ptr<ActivationTransport> nccl) {
  // The link's work goes on the stage's stream, so decode steps send from the device.
  bool device_sends = false;
  if (nccl != nullptr) {
    absl::StatusOr<bool> bound = nccl->BindStage(*stage);
    if (!bound.ok()) {
      spdlog::error("assignment {}: NCCL: {}", req.assignment_id(), bound.status().ToString());
      return absl::FailedPreconditionError(
          absl::StrCat("NCCL link of stage ", req.stage(), ": ", bound.status().message()));
    }
    device_sends = *bound;
  }
  auto a = std::make_shared<Assignment>();
  a->id = req.assignment_id();
  a->stage = req.stage();
  a->num_stages = req.num_stages();
  a->first_layer = spec.first_layer;
  a->last_layer = stage->config().num_layers;
  if (spec.last_layer >= 0 && spec.last_layer < a->last_layer) a->last_layer = spec.last_layer;
  a->max_seq_len = req.max_seq_len() > 0 ? req.max_seq_len() : stage->config().max_positions;
  a->engine = std::move(stage);
  inbox_.Reset(a->id);
  StepRunnerOptions run;
  run.stage = a->stage;
  run.num_stages = a->num_stages;
  if (nccl != nullptr) {
    a->transport = std::move(nccl);
    run.host_link = false;
    run.feed_first = true;  // the first stage gets the last one's tokens over NCCL
    run.device_sends = device_sends;
  } else {
    a->transport =
        std::make_unique<GrpcTransport>(a->stage > 0 ? &inbox_ : nullptr, a->id, req.next_address(),
                                        recv_timeout_, link_.peer_auth);
  }
  absl::StatusOr<std::unique_ptr<StepRunner>> runner =
      StepRunner::Create(*a->engine, a->transport.get(), std::move(run));
  if (!runner.ok()) {
    spdlog::error("assignment {}: {}", req.assignment_id(), runner.status().ToString());
    return absl::FailedPreconditionError(runner.status().message());
  }
  a->runner = *std::move(runner);
  return a;
}

grpc::Status WorkerService::AssignStage(grpc::ServerContext* ctx, const v1::AssignStageRequest* req,
                                        v1::AssignStageResponse* resp) {
  if (grpc::Status a = CheckCaller(*ctx, callers_); !a.ok()) return a;
  absl::MutexLock assign(&assign_mu_);
  const absl::Time t0 = absl::Now();
  StageSpec spec;
  std::string transport;
  if (grpc::Status st = CheckAssignment(*req, &spec, &transport); !st.ok()) return st;
  if (req->prepare()) return Prepare(*req, spec, transport, resp);
  // What a prepare of this very assignment got ready; any other is dropped.
  std::unique_ptr<Prepared> prepared = std::move(prepared_);
  if (prepared != nullptr && prepared->request.SerializeAsString() != req->SerializeAsString()) {
    CloseLinkInBackground(std::move(prepared->nccl));
    prepared.reset();
  }
  // Drop the old stage first: two full stages may not fit in memory. A prepared assignment follows
  // a layout change that drained the old pipeline first.
  const absl::Time dropping = absl::Now();
  DropCurrentFor(spec, /*drained=*/prepared != nullptr);
  const absl::Duration dropped = absl::Now() - dropping;
  if (prepared != nullptr && prepared->weights != nullptr) {
    spec.placed.push_back(prepared->weights);
  }
  // NCCL: join before loading (unless a prepare did). Every stage joins at once (the coordinator
  // assigns them concurrently), so a slow load elsewhere does not eat the join's timeout, and the
  // link's buffers are taken before the KV-cache sizes itself from the free memory.
  std::unique_ptr<ActivationTransport> nccl;
  if (prepared != nullptr && prepared->nccl != nullptr) {
    nccl = std::move(prepared->nccl);
  } else if (transport == "nccl") {
    absl::StatusOr<std::unique_ptr<ActivationTransport>> t = JoinPipelineLink(*req, spec);
    if (!t.ok()) return ToGrpcStatus(t.status());
    nccl = *std::move(t);
  }
  absl::StatusOr<std::unique_ptr<Stage>> stage = MakeStage(spec);
  if (!stage.ok()) return StageError(*req, stage.status());
  made_a_stage_ = true;
  absl::StatusOr<std::shared_ptr<Assignment>> made =
      NewAssignment(*req, spec, *std::move(stage), std::move(nccl));
  if (!made.ok()) return ToGrpcStatus(made.status());
  std::shared_ptr<Assignment> a = *std::move(made);
  kv_.BeginAssignment(a->id);
  {
    absl::MutexLock lock(&mu_);
    current_ = a;
  }
  int64_t taken = 0;  // bytes of weights the stage took rather than loaded
  for (const std::shared_ptr<const PlacedWeights>& w : a->engine->placed_weights()) {
    if (std::find(spec.placed.begin(), spec.placed.end(), w) != spec.placed.end()) {
      taken += w->bytes();
    }
  }
  resp->set_load_seconds(absl::ToDoubleSeconds(absl::Now() - t0));
  resp->set_feeds_previous_samples(a->runner->feeds_previous_samples());
  resp->set_placed_bytes(taken);
  resp->set_kv_pages(a->engine->kv_pages());
  const std::string kv_layout =
      spec.kv_page_size > 0
          ? absl::StrCat(a->engine->kv_pages(), " pages of ", spec.kv_page_size, " tokens")
          : std::string("contiguous slots");
  spdlog::info(
      "assignment {}: pipeline {} stage {}/{} layers [{}, {}) next {} over {}{}, ready "
      "in {:.3f} s (the stage before dropped in {:.3f} s; {} bytes of weights already "
      "placed); KV-cache {} in {}",
      a->id, req->pipeline_id(), a->stage, a->num_stages, req->first_layer(), req->last_layer(),
      req->next_address().empty() ? "-" : req->next_address(), transport,
      prepared != nullptr ? " (prepared)" : "", resp->load_seconds(),
      absl::ToDoubleSeconds(dropped), taken,
      spec.kv_cache_fp8 ? "fp8_e4m3" : "of the model's dtype", kv_layout);
  return grpc::Status::OK;
}

v1::StepResult WorkerService::RunStep(Assignment& a, const StepDescriptor& d,
                                      const std::function<bool()>& cancelled) {
  kv_.OpenKvOuts(a, d);
  return ResultOf(a, d, a.runner->Run(d, cancelled));
}

v1::StepResult WorkerService::ResultOf(Assignment& a, const StepDescriptor& d,
                                       absl::StatusOr<StepRun> run) {
  if (!run.ok()) return ErrorResult(d.id, run.status());
  if (metrics_ != nullptr) {
    const StepTimes& t = run->times;
    if (!a.runner->first()) {
      metrics_->ObserveTransfer(a.stage, "recv", absl::ToDoubleSeconds(t.recv),
                                static_cast<double>(t.recv_bytes));
    }
    metrics_->ObserveCompute(a.stage, absl::ToDoubleSeconds(t.compute));
    metrics_->CountStep(a.stage);
    if (!a.runner->last()) {
      metrics_->ObserveTransfer(a.stage, "send", absl::ToDoubleSeconds(t.send),
                                static_cast<double>(t.send_bytes));
    }
  }
  if (step_trace_ != nullptr) {
    const StepTimes& t = run->times;
    int prompts = 0;
    for (const SequenceStep& s : d.seqs) prompts += s.num_tokens > 1 ? 1 : 0;
    std::fprintf(step_trace_, "%lld\t%llu\t%zu\t%zu\t%d\t%.3f\t%.3f\t%.3f\n",
                 static_cast<long long>(absl::ToUnixMicros(absl::Now())),
                 static_cast<unsigned long long>(d.id), d.seqs.size(), d.tokens.size(), prompts,
                 absl::ToDoubleMilliseconds(t.recv), absl::ToDoubleMilliseconds(t.compute),
                 absl::ToDoubleMilliseconds(t.send));
  }
  v1::StepResult r;
  r.set_step_id(d.id);
  if (a.runner->last()) {
    r.mutable_tokens()->Assign(run->tokens.begin(), run->tokens.end());
    AddLogprobs(run->output.logprobs, r);
  }
  return r;
}

// What one Steps stream's three threads share: the handler thread reads requests into `queue`;
// the executor (StepExecutor) runs them in arrival order and puts their results in `results`;
// the writer sends those. A long step never stops the coordinator from queueing the next ones,
// and the next step starts while the last one's result is still being written.
struct WorkerService::StepStream {
  grpc::ServerContext* ctx = nullptr;
  grpc::ServerReaderWriter<v1::StepResult, v1::StepRequest>* stream = nullptr;
  absl::Mutex mu;
  std::deque<v1::StepRequest> queue ABSL_GUARDED_BY(mu);
  std::deque<v1::StepResult> results ABSL_GUARDED_BY(mu);
  bool reading_done ABSL_GUARDED_BY(mu) = false;
  bool executing_done ABSL_GUARDED_BY(mu) = false;
  std::atomic<bool> failed{false};
  grpc::Status result ABSL_GUARDED_BY(mu) = grpc::Status::OK;

  bool cancelled() const { return ctx->IsCancelled() || failed.load(); }
  void Send(v1::StepResult r) {
    absl::MutexLock lock(&mu);
    results.push_back(std::move(r));
  }
  // The writer: sends the results until the executor is done and none is left.
  void WriteResults() {
    SetThreadName("results");
    while (true) {
      v1::StepResult r;
      {
        absl::MutexLock lock(&mu);
        auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
          return !results.empty() || executing_done;
        };
        mu.Await(absl::Condition(&ready));
        if (results.empty()) return;
        r = std::move(results.front());
        results.pop_front();
      }
      if (!stream->Write(r)) {
        failed.store(true);
        return;
      }
    }
  }
};

// The executor of a Steps stream. Decode steps of a single stage are launched ahead
// (StepRunner::Launch) where the stage can: the next step goes to the device before the one
// running there has finished, and the result of that one is taken after. The executor holds at
// most one launched step between steps, and while it waits for the next request it also watches
// that step end, so that its result never waits for a request that only comes after it.
class WorkerService::StepExecutor {
 public:
  StepExecutor(WorkerService& service, StepStream& s) : service_(service), s_(s) {}

  void Run() {
    SetThreadName("steps");
    // On the way out, steps still launched are finished (their results sent while the stream
    // lasts), so that the runner holds none when the next stream comes.
    absl::Cleanup drop = [&] {
      while (launched() > 0) {
        a_->LockForStep();
        (void)a_->runner->Finish();
        a_->run_mu.Unlock();
      }
    };
    while (true) {
      v1::StepRequest req;
      if (!Next(req)) {
        if (launched() == 0 || !Finish()) return;
        continue;
      }
      if (!Execute(req)) return;
    }
  }

 private:
  // Steps of a_ launched and not finished.
  int launched() const { return a_ != nullptr ? a_->runner->launched() : 0; }

  // The next request in `req`; false where there is none (the reading is done) or the launched
  // step ended first.
  bool Next(v1::StepRequest& req) {
    while (true) {
      {
        absl::MutexLock lock(&s_.mu);
        auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_.mu) {
          return !s_.queue.empty() || s_.reading_done;
        };
        if (launched() == 0) {
          s_.mu.Await(absl::Condition(&ready));
        } else {
          s_.mu.AwaitWithTimeout(absl::Condition(&ready), kLaunchedPoll);
        }
        if (!s_.queue.empty()) {
          req = std::move(s_.queue.front());
          s_.queue.pop_front();
          return true;
        }
        if (s_.reading_done) return false;
      }
      if (a_->runner->LaunchedDone()) return false;
    }
  }

  // Runs or launches `req`; false where the stream is to end (a step failed, or it is for
  // another assignment).
  bool Execute(const v1::StepRequest& req) {
    if (a_ == nullptr) {
      absl::MutexLock lock(&service_.mu_);
      a_ = service_.current_;
    }
    if (a_ == nullptr || a_->id != req.assignment_id()) {
      if (a_ != nullptr && !FinishAll()) return false;
      const absl::Status s = absl::FailedPreconditionError(absl::StrFormat(
          "step %d is for assignment %d, but this worker holds %s", req.step_id(),
          req.assignment_id(), a_ ? absl::StrCat("assignment ", a_->id) : "no stage"));
      s_.Send(ErrorResult(req.step_id(), s));
      s_.failed.store(true);
      absl::MutexLock lock(&s_.mu);
      s_.result = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, std::string(s.message()));
      return false;
    }
    const StepDescriptor d = FromStepRequest(req);
    const LaunchAhead mode = service_.launch_ahead_;
    const bool ahead = mode == LaunchAhead::kAlways ||
                       (mode == LaunchAhead::kAuto && a_->engine->LaunchOverlaps());
    if (ahead && a_->runner->CanLaunch(d)) return Launch(d);
    if (!FinishAll()) return false;
    a_->LockForStep();
    v1::StepResult r = service_.RunStep(*a_, d, [this] { return s_.cancelled(); });
    a_->run_mu.Unlock();
    if (r.error_code() != 0) return Failed(std::move(r));
    if (a_->stage + 1 == a_->num_stages) s_.Send(std::move(r));
    return true;
  }

  // Launches `d`, finishing the step launched before it unless it is the only one.
  bool Launch(const StepDescriptor& d) {
    a_->LockForStep();
    absl::Status launch = a_->runner->Launch(d);
    a_->run_mu.Unlock();
    if (!launch.ok()) {
      if (!FinishAll()) return false;
      return Failed(ErrorResult(d.id, launch));
    }
    // One launched step stays behind: it runs while the next request is read.
    return launched() <= 1 || Finish();
  }

  // Finishes the oldest launched step and sends its result; false where it failed.
  bool Finish() {
    StepDescriptor d;
    a_->LockForStep();
    absl::StatusOr<StepRun> run = a_->runner->Finish(&d);
    a_->run_mu.Unlock();
    v1::StepResult r = service_.ResultOf(*a_, d, std::move(run));
    if (r.error_code() != 0) return Failed(std::move(r));
    s_.Send(std::move(r));
    return true;
  }

  bool FinishAll() {
    while (launched() > 0) {
      if (!Finish()) return false;
    }
    return true;
  }

  // Sends the error result `r` and ends the stream: false.
  bool Failed(v1::StepResult r) {
    if (!s_.ctx->IsCancelled()) {
      spdlog::warn("assignment {} step {}: {}", a_->id, r.step_id(), r.error_message());
    }
    s_.Send(std::move(r));
    s_.failed.store(true);
    return false;
  }

  WorkerService& service_;
  StepStream& s_;
  std::shared_ptr<Assignment> a_;
};

grpc::Status WorkerService::Steps(
    grpc::ServerContext* ctx, grpc::ServerReaderWriter<v1::StepResult, v1::StepRequest>* stream) {
  if (grpc::Status a = CheckCaller(*ctx, callers_); !a.ok()) return a;
  StepStream s;
  s.ctx = ctx;
  s.stream = stream;
  std::thread writer([&s] { s.WriteResults(); });
  std::thread executor([&] { StepExecutor(*this, s).Run(); });
  v1::StepRequest req;
  while (!s.failed.load() && stream->Read(&req)) {
    absl::MutexLock lock(&s.mu);
    s.queue.push_back(std::move(req));
  }
  {
    absl::MutexLock lock(&s.mu);
    s.reading_done = true;
    s.queue.clear();
  }
  s.failed.store(true);  // stops a Recv that waits for an input which will not come
  executor.join();
  kv_.EndSteps();
  {
    absl::MutexLock lock(&s.mu);
    s.executing_done = true;  // the writer sends what is left, then ends
  }
  writer.join();
  absl::MutexLock lock(&s.mu);
  return s.result;
}

// ---------------------------------------------------------------------------------------------
// Moving sequences with their KV-cache (kv_moves.h)

absl::StatusOr<std::shared_ptr<Assignment>> WorkerService::AssignmentFor(uint64_t id) {
  absl::MutexLock lock(&mu_);
  if (current_ == nullptr || current_->id != id) {
    return absl::FailedPreconditionError(absl::StrCat(
        "assignment ", id, ": this worker holds ",
        current_ ? absl::StrCat("assignment ", current_->id) : std::string("no stage")));
  }
  return current_;
}

grpc::Status WorkerService::ExportKv(grpc::ServerContext* ctx, const v1::ExportKvRequest* req,
                                     v1::ExportKvResponse* resp) {
  if (grpc::Status a = CheckCaller(*ctx, callers_); !a.ok()) return a;
  absl::StatusOr<std::shared_ptr<Assignment>> a = AssignmentFor(req->assignment_id());
  if (!a.ok()) return ToGrpcStatus(a.status());
  return ToGrpcStatus(kv_.Export(**a, *req, *resp));
}

grpc::Status WorkerService::ImportKv(grpc::ServerContext* ctx, const v1::ImportKvRequest* req,
                                     v1::ImportKvResponse* resp) {
  if (grpc::Status a = CheckCaller(*ctx, callers_); !a.ok()) return a;
  if (req->assignment_id() == 0 && req->seqs().empty()) return ToGrpcStatus(kv_.MakeLinks(*req));
  absl::StatusOr<std::shared_ptr<Assignment>> a = AssignmentFor(req->assignment_id());
  if (!a.ok()) return ToGrpcStatus(a.status());
  return ToGrpcStatus(kv_.Import(**a, *req, *resp));
}

grpc::Status WorkerService::FetchKv(grpc::ServerContext* ctx, const v1::FetchKvRequest* req,
                                    grpc::ServerWriter<v1::KvChunk>* writer) {
  if (grpc::Status a = CheckCaller(*ctx, callers_); !a.ok()) return a;
  const KvChunkSink sink{.write = [writer](const v1::KvChunk& c) { return writer->Write(c); },
                         .cancelled = [ctx] { return ctx->IsCancelled(); },
                         .deadline = absl::FromChrono(ctx->deadline())};
  return ToGrpcStatus(kv_.Send(*req, sink));
}

grpc::Status WorkerService::DropKv(grpc::ServerContext* ctx, const v1::DropKvRequest* req,
                                   v1::DropKvResponse*) {
  if (grpc::Status a = CheckCaller(*ctx, callers_); !a.ok()) return a;
  kv_.Drop(std::span<const uint64_t>(req->keys().data(), req->keys().size()));
  return grpc::Status::OK;
}

}  // namespace tandem
