// Worker service: assignment, the ordered step loop, the KV-cache RPCs (handed to kv_moves.h),
// registration and heartbeats.
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

grpc::Status WorkerService::AssignStage(grpc::ServerContext* ctx,
                                        const v1::AssignStageRequest* req,
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
  // Drop the old stage first: two full stages may not fit in memory. The weights of it that hold
  // layers of the new stage stay for it to take.
  const absl::Time dropping = absl::Now();
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
  // A prepared assignment follows a layout change that drained the old pipeline first.
  CloseInBackground(std::move(old), /*drained=*/prepared != nullptr);
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
  absl::StatusOr<std::unique_ptr<Stage>> stage = backend_->MakeStage(spec);
  if (absl::IsResourceExhausted(stage.status()) && kv_.SpillToHost() > 0) {
    stage = backend_->MakeStage(spec);  // with the GPU memory the stash held
  }
  if (absl::IsResourceExhausted(stage.status()) && !spec.placed.empty()) {
    spec.placed.clear();  // arenas held whole for some of their layers: load just what it needs
    stage = backend_->MakeStage(spec);
  }
  if (stage.ok()) made_a_stage_ = true;
  if (!stage.ok()) {
    spdlog::error("assignment {}: {}", req->assignment_id(), stage.status().ToString());
    // INVALID_ARGUMENT (sizes that overflow, a malformed checkpoint) and RESOURCE_EXHAUSTED (a
    // KV-cache that does not fit) keep their code; other failures are the worker's state.
    const absl::StatusCode code = stage.status().code();
    const bool sizes = code == absl::StatusCode::kInvalidArgument ||
                       code == absl::StatusCode::kResourceExhausted;
    return grpc::Status(sizes ? static_cast<grpc::StatusCode>(code)
                              : grpc::StatusCode::FAILED_PRECONDITION,
                        std::string(stage.status().message()));
  }
  // The link's work goes on the stage's stream, so decode steps send from the device.
  bool device_sends = false;
  if (nccl != nullptr) {
    absl::StatusOr<bool> bound = nccl->BindStage(**stage);
    if (!bound.ok()) {
      spdlog::error("assignment {}: NCCL: {}", req->assignment_id(), bound.status().ToString());
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("NCCL link of stage ", req->stage(), ": ",
                                       std::string(bound.status().message())));
    }
    device_sends = *bound;
  }
  auto a = std::make_shared<Assignment>();
  a->id = req->assignment_id();
  a->stage = req->stage();
  a->num_stages = req->num_stages();
  a->first_layer = spec.first_layer;
  a->last_layer = (*stage)->config().num_layers;
  if (spec.last_layer >= 0 && spec.last_layer < a->last_layer) a->last_layer = spec.last_layer;
  a->max_seq_len = req->max_seq_len() > 0 ? req->max_seq_len() : (*stage)->config().max_positions;
  a->engine = *std::move(stage);
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
        std::make_unique<GrpcTransport>(a->stage > 0 ? &inbox_ : nullptr, a->id,
                                        req->next_address(), recv_timeout_, link_.peer_auth);
  }
  absl::StatusOr<std::unique_ptr<StepRunner>> runner =
      StepRunner::Create(*a->engine, a->transport.get(), std::move(run));
  if (!runner.ok()) {
    spdlog::error("assignment {}: {}", req->assignment_id(), runner.status().ToString());
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        std::string(runner.status().message()));
  }
  a->runner = *std::move(runner);
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
  spdlog::info("assignment {}: pipeline {} stage {}/{} layers [{}, {}) next {} over {}{}, ready "
               "in {:.3f} s (the stage before dropped in {:.3f} s; {} bytes of weights already "
               "placed)",
               a->id, req->pipeline_id(), a->stage, a->num_stages, req->first_layer(),
               req->last_layer(), req->next_address().empty() ? "-" : req->next_address(),
               transport, prepared != nullptr ? " (prepared)" : "", resp->load_seconds(),
               absl::ToDoubleSeconds(dropped), taken);
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

grpc::Status WorkerService::Steps(
    grpc::ServerContext* ctx, grpc::ServerReaderWriter<v1::StepResult, v1::StepRequest>* stream) {
  if (grpc::Status a = CheckCaller(*ctx, callers_); !a.ok()) return a;
  // This handler thread reads; the executor runs steps in arrival order; the writer sends their
  // results. A long step never stops the coordinator from queueing the next ones, and the next
  // step starts while the last one's result is still being written.
  absl::Mutex mu;
  std::deque<v1::StepRequest> queue;
  std::deque<v1::StepResult> results;
  bool reading_done = false;
  bool executing_done = false;
  std::atomic<bool> failed{false};
  grpc::Status result = grpc::Status::OK;
  auto cancelled = [&] { return ctx->IsCancelled() || failed.load(); };
  auto send = [&](v1::StepResult r) {
    absl::MutexLock lock(&mu);
    results.push_back(std::move(r));
  };

  std::thread writer([&] {
    SetThreadName("results");
    while (true) {
      v1::StepResult r;
      {
        absl::MutexLock lock(&mu);
        auto ready = [&]() { return !results.empty() || executing_done; };
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
  });

  // Decode steps of a single stage are launched ahead (StepRunner::Launch) where the stage can:
  // the next step goes to the device before the one running there has finished, and the result
  // of that one is taken after. The executor holds at most one launched step between steps, and
  // while it waits for the next request it also watches that step end, so that its result never
  // waits for a request that only comes after it.
  std::thread executor([&] {
    SetThreadName("steps");
    std::shared_ptr<Assignment> a;
    // Steps of a launched and not finished.
    auto launched = [&] { return a != nullptr ? a->runner->launched() : 0; };
    // Finishes the oldest launched step and sends its result; false where it failed.
    auto finish = [&]() -> bool {
      StepDescriptor d;
      a->LockForStep();
      absl::StatusOr<StepRun> run = a->runner->Finish(&d);
      a->run_mu.Unlock();
      v1::StepResult r = ResultOf(*a, d, std::move(run));
      const bool ok = r.error_code() == 0;
      if (!ok && !ctx->IsCancelled()) {
        spdlog::warn("assignment {} step {}: {}", a->id, r.step_id(), r.error_message());
      }
      send(std::move(r));
      if (!ok) failed.store(true);
      return ok;
    };
    auto finish_all = [&]() -> bool {
      while (launched() > 0) {
        if (!finish()) return false;
      }
      return true;
    };
    // On the way out, steps still launched are finished (their results sent while the stream
    // lasts), so that the runner holds none when the next stream comes.
    absl::Cleanup drop = [&] {
      while (launched() > 0) {
        a->LockForStep();
        (void)a->runner->Finish();
        a->run_mu.Unlock();
      }
    };
    while (true) {
      v1::StepRequest req;
      bool have = false;
      while (true) {
        {
          absl::MutexLock lock(&mu);
          auto ready = [&]() { return !queue.empty() || reading_done; };
          if (launched() == 0) {
            mu.Await(absl::Condition(&ready));
          } else {
            mu.AwaitWithTimeout(absl::Condition(&ready), kLaunchedPoll);
          }
          if (!queue.empty()) {
            req = std::move(queue.front());
            queue.pop_front();
            have = true;
          }
          if (have || reading_done) break;
        }
        if (a->runner->LaunchedDone()) break;
      }
      if (!have) {
        if (launched() == 0) return;
        if (!finish()) return;
        continue;
      }
      if (a == nullptr) {
        absl::MutexLock lock(&mu_);
        a = current_;
      }
      if (a == nullptr || a->id != req.assignment_id()) {
        if (a != nullptr && !finish_all()) return;
        const absl::Status s = absl::FailedPreconditionError(absl::StrFormat(
            "step %d is for assignment %d, but this worker holds %s", req.step_id(),
            req.assignment_id(), a ? absl::StrCat("assignment ", a->id) : "no stage"));
        send(ErrorResult(req.step_id(), s));
        failed.store(true);
        absl::MutexLock lock(&mu);
        result = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, std::string(s.message()));
        return;
      }
      StepDescriptor d = FromStepRequest(req);
      const bool ahead = launch_ahead_ == LaunchAhead::kAlways ||
                         (launch_ahead_ == LaunchAhead::kAuto && a->engine->LaunchOverlaps());
      if (ahead && a->runner->CanLaunch(d)) {
        a->LockForStep();
        absl::Status launch = a->runner->Launch(d);
        a->run_mu.Unlock();
        if (!launch.ok()) {
          if (!finish_all()) return;
          if (!ctx->IsCancelled()) {
            spdlog::warn("assignment {} step {}: {}", a->id, d.id, launch.ToString());
          }
          send(ErrorResult(d.id, launch));
          failed.store(true);
          return;
        }
        // One launched step stays behind: it runs while the next request is read.
        if (launched() > 1 && !finish()) return;
        continue;
      }
      if (!finish_all()) return;
      a->LockForStep();
      v1::StepResult r = RunStep(*a, d, cancelled);
      a->run_mu.Unlock();
      const bool last = a->stage + 1 == a->num_stages;
      if (r.error_code() != 0) {
        if (!ctx->IsCancelled()) {
          spdlog::warn("assignment {} step {}: {}", a->id, r.step_id(), r.error_message());
        }
        send(std::move(r));
        failed.store(true);
        return;
      }
      if (last) send(std::move(r));
    }
  });

  v1::StepRequest req;
  while (!failed.load() && stream->Read(&req)) {
    absl::MutexLock lock(&mu);
    queue.push_back(std::move(req));
  }
  {
    absl::MutexLock lock(&mu);
    reading_done = true;
    queue.clear();
  }
  failed.store(true);  // stops a Recv that waits for an input which will not come
  executor.join();
  kv_.EndSteps();
  {
    absl::MutexLock lock(&mu);
    executing_done = true;  // the writer sends what is left, then ends
  }
  writer.join();
  absl::MutexLock lock(&mu);
  return result;
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

// ---------------------------------------------------------------------------------------------

Registrar::Registrar(std::string coordinator, std::string advertise_address, std::string backend,
                     ClientAuth auth)
    : coordinator_(std::move(coordinator)),
      address_(std::move(advertise_address)),
      backend_(std::move(backend)),
      auth_(std::move(auth)) {
  thread_ = std::thread([this] {
    SetThreadName("registrar");
    Loop();
  });
}

Registrar::~Registrar() {
  stop_.store(true);
  thread_.join();
}

void Registrar::Loop() {
  // A restarted coordinator is found within a second, not after gRPC's reconnect backoff of up
  // to two minutes.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  auto stub = v1::Registry::NewStub(MakeChannel(coordinator_, auth_, args));
  int64_t id = -1;
  absl::Duration interval = absl::Milliseconds(200);
  bool warned = false;
  while (!stop_.load()) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    if (id < 0) {
      v1::RegisterRequest req;
      req.set_address(address_);
      req.set_backend(backend_);
      v1::RegisterResponse resp;
      grpc::Status s = stub->Register(&ctx, req, &resp);
      if (s.ok()) {
        id = resp.worker_id();
        interval = absl::Milliseconds(std::max<uint32_t>(resp.heartbeat_interval_ms(), 10));
        spdlog::info("registered with {} as worker {} ({})", coordinator_, id, address_);
        warned = false;
      } else {
        if (!warned) spdlog::warn("cannot register with {}: {}", coordinator_, s.error_message());
        warned = true;
        interval = absl::Milliseconds(200);
      }
    } else {
      v1::HeartbeatRequest req;
      req.set_worker_id(id);
      v1::HeartbeatResponse resp;
      grpc::Status s = stub->Heartbeat(&ctx, req, &resp);
      if (s.ok() && !resp.known()) {
        spdlog::warn("the coordinator forgot worker {}; registering again", id);
        id = -1;
        continue;
      }
      if (!s.ok() && !warned) {
        spdlog::warn("heartbeat to {} failed: {}", coordinator_, s.error_message());
        warned = true;
      } else if (s.ok()) {
        warned = false;
      }
    }
    const absl::Time until = absl::Now() + interval;
    while (!stop_.load() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
  }
}

}  // namespace tandem
