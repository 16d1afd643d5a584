// Worker service: assignment, the ordered step loop, registration and heartbeats.
#include "worker/service/worker_service.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <optional>
#include <set>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
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
#include "worker/transport/kv_wire.h"

namespace tandem {
namespace {

// How often an executor holding a launched step looks whether it ended while it waits for the
// next request.
constexpr absl::Duration kLaunchedPoll = absl::Microseconds(50);
// Positions of the KV-cache of the stage a prepare warms up (LinkOptions::warm_up).
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

WorkerService::WorkerService(StageFactory factory, ActivationInbox& inbox,
                             absl::Duration recv_timeout, LinkOptions link)
    : factory_(std::move(factory)),
      inbox_(inbox),
      recv_timeout_(recv_timeout),
      link_(std::move(link)) {}

grpc::Status WorkerService::PrepareLink(grpc::ServerContext* ctx,
                                        const v1::PrepareLinkRequest* req,
                                        v1::PrepareLinkResponse* resp) {
  if (grpc::Status a = CheckCaller(*ctx, callers_); !a.ok()) return a;
  if (link_.transport != "nccl" || req->num_stages() < 2) {
    resp->set_transport("grpc");
    return grpc::Status::OK;
  }
  if (!link_.make_nccl_id) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "transport nccl: this worker has no NCCL (a CUDA build with --backend=cuda)");
  }
  absl::StatusOr<std::string> id = link_.make_nccl_id();
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
  if (*transport == "nccl" && !link_.join_nccl) {
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
  absl::StatusOr<std::unique_ptr<ActivationTransport>> t = link_.join_nccl(join);
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
  if (link_.place_weights) {
    StageSpec want = spec;
    {
      absl::MutexLock lock(&mu_);
      if (current_ != nullptr) want.placed = current_->engine->placed_weights();
    }
    absl::StatusOr<std::shared_ptr<const PlacedWeights>> w = link_.place_weights(want);
    if (w.ok()) {
      p->weights = *std::move(w);
    } else {
      // Not fatal: the assignment loads them itself.
      spdlog::warn("assignment {}: weights not placed ahead: {}", req.assignment_id(),
                   w.status().ToString());
    }
    // A worker's first stage: a throwaway one on the weights just placed, with a KV-cache of a
    // few positions, so that the libraries' and kernels' code is loaded now, not in the pause.
    if (link_.warm_up && !made_a_stage_ && p->weights != nullptr) {
      const absl::Time w0 = absl::Now();
      StageSpec small = want;
      small.placed.push_back(p->weights);
      small.max_seq_len = std::min(spec.max_seq_len > 0 ? spec.max_seq_len : kWarmUpPositions,
                                   kWarmUpPositions);
      if (absl::Status st = link_.warm_up(small); st.ok()) {
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
  absl::StatusOr<std::unique_ptr<Stage>> stage = factory_(spec);
  if (absl::IsResourceExhausted(stage.status()) && SpillStashToHost() > 0) {
    stage = factory_(spec);  // with the GPU memory the stash held
  }
  if (absl::IsResourceExhausted(stage.status()) && !spec.placed.empty()) {
    spec.placed.clear();  // arenas held whole for some of their layers: load just what it needs
    stage = factory_(spec);
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
  if (nccl != nullptr && link_.bind_nccl) {
    if (absl::Status st = link_.bind_nccl(**stage, *nccl); !st.ok()) {
      spdlog::error("assignment {}: NCCL: {}", req->assignment_id(), st.ToString());
      return grpc::Status(
          grpc::StatusCode::FAILED_PRECONDITION,
          absl::StrCat("NCCL link of stage ", req->stage(), ": ", std::string(st.message())));
    }
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
    if (link_.bind_nccl) run.set_decode_tail = link_.set_decode_tail;
  } else {
    a->transport = std::make_unique<GrpcTransport>(a->stage > 0 ? &inbox_ : nullptr, a->id,
                                                   req->next_address(), recv_timeout_,
                                                   link_.peer_auth);
    run.to_host = link_.to_host;
  }
  absl::StatusOr<std::unique_ptr<StepRunner>> runner =
      StepRunner::Create(*a->engine, a->transport.get(), std::move(run));
  if (!runner.ok()) {
    spdlog::error("assignment {}: {}", req->assignment_id(), runner.status().ToString());
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        std::string(runner.status().message()));
  }
  a->runner = *std::move(runner);
  {
    std::map<uint64_t, WrittenOutKv> before;  // of an assignment before: freed after the locks
    absl::MutexLock lock(&mu_);
    current_ = a;
    absl::MutexLock stash(&stash_mu_);
    std::swap(before, written_out_);
    newest_step_ = 0;
    out_assignment_ = a->id;
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
  OpenKvOuts(a, d);
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
      LockForStep(*a);
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
        LockForStep(*a);
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
        LockForStep(*a);
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
      LockForStep(*a);
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
  {
    absl::MutexLock stash(&stash_mu_);
    ++steps_epoch_;  // the steps not run will not open their write-outs
  }
  {
    absl::MutexLock lock(&mu);
    executing_done = true;  // the writer sends what is left, then ends
  }
  writer.join();
  absl::MutexLock lock(&mu);
  return result;
}

// ---------------------------------------------------------------------------------------------
// Moving sequences with their KV-cache

namespace {

// K and V bytes of one stash chunk at most: some MB, so that a fetch streams rather than
// building one message per sequence.
constexpr int64_t kKvChunkBytes = int64_t{16} << 20;
// Streams (and connections) one import fetches a worker's sequences over.
constexpr size_t kFetchStreams = 4;
// How long a fetch of a step's write-out waits for the step to open it, and then for each of its
// layers (the step may be queued behind others, each up to a long prompt).
constexpr absl::Duration kWrittenOutWait = absl::Seconds(60);

// Moves of a layout change are logged; the many small prefill hand-offs only at debug level.
spdlog::level::level_enum KvLogLevel(int64_t bytes, absl::Duration took) {
  return bytes >= (int64_t{64} << 20) || took >= absl::Milliseconds(100) ? spdlog::level::info
                                                                          : spdlog::level::debug;
}

// `s` with "sequence <key>: " before its message.
absl::Status OfSequence(uint64_t key, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat("sequence ", key, ": ", s.message()));
}

// A FetchKv request of the layers [first_layer, first_layer + num_layers) of `keys`.
v1::FetchKvRequest FetchRequest(const std::vector<uint64_t>& keys, int first_layer,
                                int num_layers, WriteOutRef stream) {
  v1::FetchKvRequest req;
  req.mutable_keys()->Assign(keys.begin(), keys.end());
  req.set_first_layer(first_layer);
  req.set_num_layers(num_layers);
  req.set_stream_step(stream.step);
  req.set_stream_assignment(stream.assignment);
  return req;
}

// The earlier of the call's deadline and kWrittenOutWait from now.
absl::Time WrittenOutDeadline(const grpc::ServerContext& ctx) {
  return std::min(absl::FromChrono(ctx.deadline()), absl::Now() + kWrittenOutWait);
}

}  // namespace

std::unique_ptr<v1::Worker::Stub> WorkerService::KvStub(const std::string& address,
                                                        int connection) const {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(kMaxStageMessageBytes));
  // A connection of its own per number (channels with other arguments share no subchannel).
  args.SetInt("tandem.kv_fetch_connection", connection);
  return v1::Worker::NewStub(MakeChannel(address, link_.peer_auth, args));
}

void WorkerService::LockForStep(Assignment& a) {
  a.run_mu.LockWhen(absl::Condition(
      +[](std::atomic<int>* waiting) { return waiting->load() == 0; }, &a.kv_waiting));
}

void WorkerService::LockForKv(Assignment& a) {
  a.kv_waiting.fetch_add(1);
  a.run_mu.Lock();
  a.kv_waiting.fetch_sub(1);
}

int WorkerService::SpillStashToHost() {
  if (!link_.kv_to_host) return 0;
  absl::MutexLock lock(&stash_mu_);
  int moved = 0;
  for (auto& [key, block] : stash_) {
    if (!block->on_device()) continue;
    absl::StatusOr<KvBlock> host = link_.kv_to_host(*block);
    if (!host.ok()) {
      spdlog::warn("sequence {}: KV stash kept in device memory: {}", key,
                   host.status().ToString());
      continue;
    }
    block = std::make_shared<const KvBlock>(*std::move(host));
    ++moved;
  }
  spdlog::info("moved {} stashed sequence(s) from device to host memory for a new stage", moved);
  return moved;
}

absl::StatusOr<std::shared_ptr<const KvBlock>> WorkerService::Stashed(uint64_t key) {
  absl::MutexLock lock(&stash_mu_);
  auto it = stash_.find(key);
  if (it == stash_.end()) {
    return absl::NotFoundError(absl::StrCat("sequence ", key, ": not in this worker's KV stash"));
  }
  return it->second;
}

void WorkerService::OpenKvOuts(Assignment& a, const StepDescriptor& d) {
  std::vector<std::pair<const SequenceStep*, std::shared_ptr<KvOut>>> opened;
  for (const SequenceStep& s : d.seqs) {
    if (s.kv_out_key == 0) continue;
    absl::StatusOr<std::shared_ptr<KvOut>> out =
        a.engine->OpenKvOut(s.slot, s.position + s.num_tokens);
    if (!out.ok()) {
      spdlog::debug("assignment {} step {}: sequence {} not written out: {}", a.id, d.id,
                    s.kv_out_key, out.status().ToString());
      auto failed = std::make_shared<KvOut>(KvBlock{}, s.slot);
      failed->Fail(OfSequence(s.kv_out_key, out.status()));
      out = std::move(failed);
    }
    opened.emplace_back(&s, *std::move(out));
  }
  // What the write-outs replace is freed after the lock (freeing device memory waits for the
  // GPU's queue).
  std::vector<std::shared_ptr<const void>> replaced;
  absl::MutexLock lock(&stash_mu_);
  for (auto& [row, out] : opened) {
    for (auto it = written_out_.begin(); it != written_out_.end();) {
      const bool same = it->first == row->kv_out_key || it->second.out->slot() == row->slot;
      if (same) replaced.push_back(std::move(it->second.out));
      it = same ? written_out_.erase(it) : std::next(it);
    }
    if (auto it = stash_.find(row->kv_out_key); it != stash_.end()) {
      replaced.push_back(std::move(it->second));
      stash_.erase(it);
    }
    written_out_[row->kv_out_key] = {.by = {a.id, d.id}, .out = std::move(out)};
  }
  // After its write-outs are there: a fetch of one that is not gives up once this is past it.
  if (a.id == out_assignment_) newest_step_ = std::max(newest_step_, d.id);
}

absl::StatusOr<std::shared_ptr<KvOut>> WorkerService::WrittenOut(uint64_t key, WriteOutRef ref,
                                                                 absl::Time deadline) {
  absl::MutexLock lock(&stash_mu_);
  const uint64_t epoch = steps_epoch_;
  auto opened = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(stash_mu_) {
    auto it = written_out_.find(key);
    return it != written_out_.end() && it->second.by.assignment == ref.assignment &&
           it->second.by.step == ref.step;
  };
  // Opened by the step, or the step cannot come any more.
  auto settled = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(stash_mu_) {
    return opened() || out_assignment_ != ref.assignment || newest_step_ >= ref.step ||
           steps_epoch_ != epoch;
  };
  if (!stash_mu_.AwaitWithDeadline(absl::Condition(&settled), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("sequence ", key, ": step ", ref.step,
                                                    " did not begin to write it out in time"));
  }
  if (!opened()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", key, ": not written out by step ", ref.step, " of assignment ",
        ref.assignment,
        out_assignment_ != ref.assignment ? " (this worker holds another assignment)"
        : steps_epoch_ != epoch          ? " (the steps' stream ended)"
                                         : ""));
  }
  return written_out_.at(key).out;
}

absl::StatusOr<KvBlock> WorkerService::OwnBlock(uint64_t key, int first_layer, int num_layers,
                                               WriteOutRef stream) {
  std::shared_ptr<const KvBlock> held;
  if (stream.step != 0) {
    absl::StatusOr<std::shared_ptr<KvOut>> out =
        WrittenOut(key, stream, absl::Now() + kWrittenOutWait);
    if (!out.ok()) return out.status();
    if (absl::Status st = (*out)->AwaitAll(absl::Now() + kWrittenOutWait); !st.ok()) {
      return OfSequence(key, st);
    }
    held = std::shared_ptr<const KvBlock>(*out, &(*out)->block());
  } else {
    absl::StatusOr<std::shared_ptr<const KvBlock>> stashed = Stashed(key);
    if (!stashed.ok()) return stashed.status();
    held = *std::move(stashed);
  }
  absl::StatusOr<KvBlock> b = SliceKvLayers(*held, first_layer, num_layers);
  if (!b.ok()) return OfSequence(key, b.status());
  return b;
}

absl::StatusOr<std::shared_ptr<WorkerService::Assignment>> WorkerService::AssignmentFor(
    uint64_t id) {
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
  std::map<uint64_t, std::shared_ptr<const KvBlock>> blocks;
  int64_t bytes = 0;
  const absl::Time t0 = absl::Now();
  // One sequence at a time between steps, so that a stage that keeps running steps (a prefill
  // worker handing off) waits for one sequence's copies at most.
  const int layers = (*a)->last_layer - (*a)->first_layer;
  // On the GPU only where it can leave over NCCL.
  const bool on_device = req->device() && link_.join_kv_link && link_.make_nccl_id;
  for (const v1::KvSequence& s : req->seqs()) {
    LockForKv(**a);
    absl::StatusOr<KvBlock> b =
        on_device
            ? (*a)->engine->ExportKvToDevice(s.slot(), s.positions(), (*a)->first_layer, layers)
            : (*a)->engine->ExportKv(s.slot(), s.positions(), (*a)->first_layer, layers);
    // No device after all, or no room there: host memory.
    if (on_device && (absl::IsUnimplemented(b.status()) || absl::IsResourceExhausted(b.status()))) {
      b = (*a)->engine->ExportKv(s.slot(), s.positions(), (*a)->first_layer, layers);
    }
    (*a)->run_mu.Unlock();
    if (!b.ok()) return ToGrpcStatus(OfSequence(s.key(), b.status()));
    bytes += static_cast<int64_t>(b->bytes());
    blocks[s.key()] = std::make_shared<const KvBlock>(*std::move(b));
  }
  // What the stash replaces is freed after the lock (`blocks` and `replaced` outlive it).
  std::vector<std::shared_ptr<const void>> replaced;
  absl::MutexLock lock(&stash_mu_);
  for (auto& [key, block] : blocks) {
    if (auto it = written_out_.find(key); it != written_out_.end()) {
      replaced.push_back(std::move(it->second.out));
      written_out_.erase(it);
    }
    std::swap(stash_[key], block);
  }
  resp->set_bytes(bytes);
  const absl::Duration took = absl::Now() - t0;
  spdlog::log(KvLogLevel(bytes, took),
              "assignment {}: stashed the KV-cache of {} sequence(s), {} bytes, in {} memory, "
              "in {:.3f} s",
              req->assignment_id(), req->seqs_size(), bytes, on_device ? "device" : "host",
              absl::ToDoubleSeconds(took));
  return grpc::Status::OK;
}

absl::StatusOr<std::vector<KvBlock>> WorkerService::FetchBlocks(
    const Assignment& a, const std::string& address, const std::vector<uint64_t>& keys,
    int first_layer, int num_layers, WriteOutRef stream) {
  // The sequences in up to kFetchStreams groups, each over a connection of its own, at once: one
  if (link_.join_kv_link && link_.make_nccl_id) {
    absl::StatusOr<std::optional<std::vector<KvBlock>>> over =
        FetchOverNccl(&a, address, keys, first_layer, num_layers, stream);
    if (!over.ok()) return over.status();
    if (over->has_value()) return **std::move(over);
  }
  // gRPC stream moves a few hundred MB/s, bound by its copies on one core.
  const size_t groups = std::min(keys.size(), kFetchStreams);
  std::vector<absl::StatusOr<std::vector<KvBlock>>> parts(groups);
  std::vector<std::thread> threads;
  for (size_t g = 0; g < groups; ++g) {
    threads.emplace_back([&, g] {
      const std::vector<uint64_t> group(keys.begin() + keys.size() * g / groups,
                                        keys.begin() + keys.size() * (g + 1) / groups);
      parts[g] = FetchGroup(a, address, group, first_layer, num_layers, static_cast<int>(g),
                            stream);
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<KvBlock> blocks;
  for (absl::StatusOr<std::vector<KvBlock>>& part : parts) {
    if (!part.ok()) return part.status();
    for (KvBlock& b : *part) blocks.push_back(std::move(b));
  }
  return blocks;
}

absl::StatusOr<std::vector<KvBlock>> WorkerService::FetchGroup(
    const Assignment& a, const std::string& address, const std::vector<uint64_t>& keys,
    int first_layer, int num_layers, int connection, WriteOutRef stream) {
  auto stub = KvStub(address, connection);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(5)));
  const v1::FetchKvRequest req = FetchRequest(keys, first_layer, num_layers, stream);
  const ModelConfig& c = a.engine->config();
  KvAssembler assembler({.first_layer = first_layer,
                         .num_layers = num_layers,
                         .num_kv_heads = c.num_kv_heads,
                         .head_dim = c.head_dim,
                         .max_positions = a.max_seq_len});
  std::unique_ptr<grpc::ClientReader<v1::KvChunk>> reader = stub->FetchKv(&ctx, req);
  v1::KvChunk chunk;
  absl::Status bad;
  while (reader->Read(&chunk)) {
    bad = assembler.Add(chunk);
    if (!bad.ok()) {
      ctx.TryCancel();
      break;
    }
  }
  const grpc::Status done = reader->Finish();
  auto from = [&address](absl::Status s) {
    return absl::Status(s.code(), absl::StrCat("KV from ", address, ": ", s.message()));
  };
  if (!bad.ok()) return from(bad);
  if (!done.ok()) return from(FromGrpcStatus(done));
  std::vector<KvBlock> blocks;
  for (uint64_t key : keys) {
    absl::StatusOr<KvBlock> b = assembler.Take(key);
    if (!b.ok()) return from(b.status());
    blocks.push_back(*std::move(b));
  }
  return blocks;
}

grpc::Status WorkerService::ImportKv(grpc::ServerContext* ctx, const v1::ImportKvRequest* req,
                                     v1::ImportKvResponse* resp) {
  if (grpc::Status a = CheckCaller(*ctx, callers_); !a.ok()) return a;
  if (req->assignment_id() == 0 && req->seqs().empty()) {
    // Links only, made ahead of the imports that will use them.
    for (const v1::KvSource& src : req->sources()) {
      if (src.address().empty() || !link_.join_kv_link || !link_.make_nccl_id) continue;
      absl::StatusOr<std::optional<std::vector<KvBlock>>> made =
          FetchOverNccl(nullptr, src.address(), {}, 0, 0);
      if (!made.ok()) return ToGrpcStatus(made.status());
    }
    return grpc::Status::OK;
  }
  absl::StatusOr<std::shared_ptr<Assignment>> a = AssignmentFor(req->assignment_id());
  if (!a.ok()) return ToGrpcStatus(a.status());
  // The sources must cover the stage's layers once each, so that no slot is left half filled.
  std::vector<const v1::KvSource*> sources;
  for (const v1::KvSource& src : req->sources()) sources.push_back(&src);
  std::sort(sources.begin(), sources.end(), [](const v1::KvSource* x, const v1::KvSource* y) {
    return x->first_layer() < y->first_layer();
  });
  int next = (*a)->first_layer;
  for (const v1::KvSource* src : sources) {
    if (src->first_layer() != next || src->num_layers() < 1 ||
        src->num_layers() > (*a)->last_layer - next) {
      return grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrFormat("sources: layers [%d, %d) do not continue this stage's [%d, %d) at %d",
                          src->first_layer(),
                          static_cast<int64_t>(src->first_layer()) + src->num_layers(),
                          (*a)->first_layer, (*a)->last_layer, next));
    }
    next += src->num_layers();
  }
  if (next != (*a)->last_layer) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrFormat("sources: layers [%d, %d) of this stage's [%d, %d) have "
                                        "no source",
                                        next, (*a)->last_layer, (*a)->first_layer,
                                        (*a)->last_layer));
  }
  std::vector<uint64_t> keys;
  std::set<int> slots;
  for (const v1::KvSequence& s : req->seqs()) {
    keys.push_back(s.key());
    if (!slots.insert(s.slot()).second) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("seqs: slot ", s.slot(), " is given twice"));
    }
  }
  // Every block first (fetches take long and need no lock; the remote ones all at once), then
  // the writes between steps.
  const absl::Time t0 = absl::Now();
  std::vector<absl::StatusOr<std::vector<KvBlock>>> blocks(sources.size());
  std::vector<std::thread> fetches;
  for (size_t i = 0; i < sources.size(); ++i) {
    const v1::KvSource* src = sources[i];
    if (src->address().empty()) continue;
    fetches.emplace_back([&, i, src] {
      blocks[i] = FetchBlocks(**a, src->address(), keys, src->first_layer(), src->num_layers(),
                              WriteOutRef{src->assignment_id(), req->stream_step()});
    });
  }
  // This worker's own stash meanwhile.
  auto own = [&](const v1::KvSource& src) -> absl::StatusOr<std::vector<KvBlock>> {
    std::vector<KvBlock> part;
    for (uint64_t key : keys) {
      absl::StatusOr<KvBlock> b =
          OwnBlock(key, src.first_layer(), src.num_layers(),
                   WriteOutRef{src.assignment_id(), req->stream_step()});
      if (!b.ok()) return b.status();
      part.push_back(*std::move(b));
    }
    return part;
  };
  for (size_t i = 0; i < sources.size(); ++i) {
    if (sources[i]->address().empty()) blocks[i] = own(*sources[i]);
  }
  for (std::thread& t : fetches) t.join();
  int64_t fetched = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    if (!blocks[i].ok()) return ToGrpcStatus(blocks[i].status());
    if (sources[i]->address().empty()) continue;
    for (const KvBlock& b : *blocks[i]) fetched += static_cast<int64_t>(b.bytes());
  }
  resp->set_fetch_seconds(absl::ToDoubleSeconds(absl::Now() - t0));
  // One sequence at a time between steps (all its layers at once), so that the stage's running
  // sequences wait for one sequence's copies at most.
  int64_t bytes = 0;
  for (int i = 0; i < req->seqs_size(); ++i) {
    const v1::KvSequence& s = req->seqs(i);
    LockForKv(**a);
    absl::Status st;
    for (const absl::StatusOr<std::vector<KvBlock>>& part : blocks) {
      const KvBlock& b = (*part)[i];
      if (st = (*a)->engine->ImportKv(s.slot(), b); !st.ok()) break;
      bytes += static_cast<int64_t>(b.bytes());
    }
    (*a)->run_mu.Unlock();
    if (!st.ok()) return ToGrpcStatus(OfSequence(s.key(), st));
  }
  resp->set_bytes(bytes);
  resp->set_fetched_bytes(fetched);
  const absl::Duration took = absl::Now() - t0;
  spdlog::log(KvLogLevel(bytes, took),
              "assignment {}: imported the KV-cache of {} sequence(s), {} bytes ({} fetched in "
              "{:.3f} s), in {:.3f} s",
              req->assignment_id(), req->seqs_size(), bytes, fetched, resp->fetch_seconds(),
              absl::ToDoubleSeconds(took));
  return grpc::Status::OK;
}

grpc::Status WorkerService::FetchKv(grpc::ServerContext* ctx, const v1::FetchKvRequest* req,
                                    grpc::ServerWriter<v1::KvChunk>* writer) {
  if (grpc::Status a = CheckCaller(*ctx, callers_); !a.ok()) return a;
  if (!req->nccl_id().empty()) return SendOverNccl(ctx, *req, writer);
  if (req->stream_step() != 0) return SendWrittenOut(ctx, *req, writer);
  for (uint64_t key : req->keys()) {
    absl::StatusOr<std::shared_ptr<const KvBlock>> held = Stashed(key);
    if (!held.ok()) return ToGrpcStatus(held.status());
    std::shared_ptr<const KvBlock> block = *held;
    if (block->on_device()) {  // kept on the GPU for NCCL; the host copy for this fetch only
      absl::StatusOr<KvBlock> host =
          link_.kv_to_host ? link_.kv_to_host(*block)
                           : absl::InternalError("no copy from device memory in this worker");
      if (!host.ok()) return ToGrpcStatus(OfSequence(key, host.status()));
      block = std::make_shared<const KvBlock>(*std::move(host));
    }
    absl::StatusOr<bool> sent = ForEachKvChunk(
        key, *block, kKvChunkBytes, [&](const v1::KvChunk& c) { return writer->Write(c); },
        req->first_layer(), req->num_layers());
    if (!sent.ok()) return ToGrpcStatus(OfSequence(key, sent.status()));
    if (!*sent) return grpc::Status(grpc::StatusCode::CANCELLED, "the fetching worker went away");
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::SendWrittenOut(grpc::ServerContext* ctx,
                                           const v1::FetchKvRequest& req,
                                           grpc::ServerWriter<v1::KvChunk>* writer) {
  const absl::Time deadline = WrittenOutDeadline(*ctx);
  for (uint64_t key : req.keys()) {
    absl::StatusOr<std::shared_ptr<KvOut>> out = WrittenOut(key, {req.stream_assignment(), req.stream_step()}, deadline);
    if (!out.ok()) return ToGrpcStatus(out.status());
    std::shared_ptr<const KvBlock> block(*out, &(*out)->block());
    if (block->on_device()) {
      // Over gRPC from device memory (no NCCL between the two): all layers, then one host copy.
      if (absl::Status st = (*out)->AwaitAll(deadline); !st.ok()) {
        return ToGrpcStatus(OfSequence(key, st));
      }
      absl::StatusOr<KvBlock> host =
          link_.kv_to_host ? link_.kv_to_host(*block)
                           : absl::InternalError("no copy from device memory in this worker");
      if (!host.ok()) return ToGrpcStatus(OfSequence(key, host.status()));
      block = std::make_shared<const KvBlock>(*std::move(host));
    }
    const int last = req.first_layer() + std::max(req.num_layers(), 0);
    for (int layer = req.first_layer(); layer < last; ++layer) {
      const int l = layer - block->first_layer;
      if (l >= 0 && l < block->num_layers) {
        if (absl::Status st = (*out)->Await(l, deadline); !st.ok()) {
          return ToGrpcStatus(OfSequence(key, st));
        }
      }
      absl::StatusOr<bool> sent = ForEachKvChunk(
          key, *block, kKvChunkBytes, [&](const v1::KvChunk& c) { return writer->Write(c); },
          layer, 1);
      if (!sent.ok()) return ToGrpcStatus(OfSequence(key, sent.status()));
      if (!*sent) return grpc::Status(grpc::StatusCode::CANCELLED, "the fetching worker went away");
    }
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::SendOverNccl(grpc::ServerContext* ctx, const v1::FetchKvRequest& req,
                                         grpc::ServerWriter<v1::KvChunk>* writer) {
  auto refuse = [](auto&&... parts) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("KV over NCCL: ", parts...));
  };
  if (!link_.join_kv_link) return refuse("this worker has no NCCL");
  // Every sequence first, on the GPU, so that a refusal comes before anything moves. A step's
  // write-outs (stream_step) once the step has opened them: their layers are sent as it writes
  // them.
  std::vector<KvBlock> blocks;
  std::vector<std::shared_ptr<KvOut>> outs;
  const bool streamed = req.stream_step() != 0;
  const absl::Time deadline = WrittenOutDeadline(*ctx);
  for (uint64_t key : req.keys()) {
    absl::StatusOr<std::shared_ptr<const KvBlock>> held;
    if (streamed) {
      absl::StatusOr<std::shared_ptr<KvOut>> out =
          WrittenOut(key, {req.stream_assignment(), req.stream_step()}, deadline);
      if (!out.ok()) return ToGrpcStatus(out.status());
      if (absl::Status failed = (*out)->Await(0, absl::InfinitePast());
          !failed.ok() && !absl::IsDeadlineExceeded(failed)) {
        return ToGrpcStatus(OfSequence(key, failed));  // not written out at all
      }
      outs.push_back(*out);
      held = std::shared_ptr<const KvBlock>(*out, &(*out)->block());
    } else {
      held = Stashed(key);
    }
    if (!held.ok()) return ToGrpcStatus(held.status());
    if (!(*held)->on_device()) return refuse("sequence ", key, " is stashed in host memory");
    absl::StatusOr<KvBlock> b = SliceKvLayers(**held, req.first_layer(), req.num_layers());
    if (!b.ok()) return ToGrpcStatus(OfSequence(key, b.status()));
    blocks.push_back(*std::move(b));
  }
  std::shared_ptr<HeldKvLink> held;
  {
    absl::MutexLock lock(&kv_links_mu_);
    auto it = send_links_.find(req.nccl_id());
    if (it == send_links_.end()) {
      if (!req.nccl_join()) return refuse("no link of that id here (joined anew)");
      it = send_links_.emplace(req.nccl_id(), std::make_shared<HeldKvLink>()).first;
    }
    held = it->second;
  }
  absl::MutexLock lock(&held->mu);
  auto drop = [&] {
    held->link.reset();
    absl::MutexLock links(&kv_links_mu_);
    send_links_.erase(req.nccl_id());
  };
  if (held->link == nullptr) {
    // Ready to send: the other worker joins on reading this.
    v1::KvChunk ready;
    ready.set_version(KvBlock::kVersion);
    ready.set_nccl(true);
    if (!writer->Write(ready)) {
      drop();
      return grpc::Status(grpc::StatusCode::CANCELLED, "the fetching worker went away");
    }
    absl::StatusOr<std::unique_ptr<KvLink>> joined =
        link_.join_kv_link(req.nccl_id(), /*rank=*/0, [ctx] { return ctx->IsCancelled(); });
    if (!joined.ok()) {
      drop();
      return ToGrpcStatus(joined.status());
    }
    held->link = *std::move(joined);
  }
  if (streamed) {
    // Every header, then layer by layer one transfer of every sequence's K and V of that layer,
    // once the step has written it for all of them. A layer that is not written (the step
    // failed) is sent all the same, so that the link stays in step with the other worker, which
    // the error then reaches.
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (!writer->Write(NcclKvHeader(req.keys(i), blocks[i]))) {
        drop();
        return grpc::Status(grpc::StatusCode::CANCELLED, "the fetching worker went away");
      }
    }
    absl::Status unwritten;
    const int layers = blocks.empty() ? 0 : blocks[0].num_layers;
    std::vector<std::pair<const void*, size_t>> layer;
    const absl::Time t0 = absl::Now();
    absl::Time first_sent;
    int64_t bytes = 0;
    for (int l = 0; l < layers; ++l) {
      layer.clear();
      for (size_t i = 0; i < blocks.size(); ++i) {
        const KvBlock& b = blocks[i];
        if (unwritten.ok()) {
          unwritten = outs[i]->Await(b.first_layer - outs[i]->block().first_layer + l, deadline);
          if (!unwritten.ok()) unwritten = OfSequence(req.keys(i), unwritten);
        }
        const size_t layer_bytes = b.expected_bytes() / b.num_layers;
        layer.emplace_back(b.device_k.get() + l * layer_bytes, layer_bytes);
        layer.emplace_back(b.device_v.get() + l * layer_bytes, layer_bytes);
      }
      // The layer is there: the other worker posts its receive on this message, so that no
      // NCCL kernel waits on its GPU while the step computes.
      v1::KvChunk ready;
      ready.set_version(KvBlock::kVersion);
      ready.set_nccl(true);
      ready.set_layer(blocks[0].first_layer + l);
      ready.set_num_layers(1);
      if (!writer->Write(ready)) {
        drop();
        return grpc::Status(grpc::StatusCode::CANCELLED, "the fetching worker went away");
      }
      if (absl::Status st = held->link->Send(layer); !st.ok()) {
        drop();
        return ToGrpcStatus(st);
      }
      if (l == 0) first_sent = absl::Now();
      for (const auto& [p, n] : layer) bytes += static_cast<int64_t>(n);
    }
    const absl::Duration took = absl::Now() - t0;
    spdlog::log(KvLogLevel(bytes, took),
                "step {}: sent the write-out of {} sequence(s), {} bytes, layer by layer over NCCL "
                "in {:.3f} s (the first layer after {:.3f} s)",
                req.stream_step(), blocks.size(), bytes, absl::ToDoubleSeconds(took),
                absl::ToDoubleSeconds(first_sent - t0));
    return ToGrpcStatus(unwritten);
  }
  // Every header, then every sequence's K and V as one NCCL transfer.
  std::vector<std::pair<const void*, size_t>> buffers;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const KvBlock& b = blocks[i];
    if (!writer->Write(NcclKvHeader(req.keys(i), b))) {
      drop();
      return grpc::Status(grpc::StatusCode::CANCELLED, "the fetching worker went away");
    }
    buffers.emplace_back(b.device_k.get(), b.expected_bytes());
    buffers.emplace_back(b.device_v.get(), b.expected_bytes());
  }
  if (absl::Status st = held->link->Send(buffers); !st.ok()) {
    drop();
    return ToGrpcStatus(st);
  }
  return grpc::Status::OK;
}

absl::StatusOr<std::optional<std::vector<KvBlock>>> WorkerService::FetchOverNccl(
    const Assignment* a, const std::string& address, const std::vector<uint64_t>& keys,
    int first_layer, int num_layers, WriteOutRef stream) {
  std::shared_ptr<HeldKvLink> held;
  {
    absl::MutexLock lock(&kv_links_mu_);
    std::shared_ptr<HeldKvLink>& slot = fetch_links_[address];
    if (slot == nullptr) slot = std::make_shared<HeldKvLink>();
    held = slot;
  }
  absl::MutexLock lock(&held->mu);
  if (held->unreachable) return std::nullopt;
  auto from = [&address](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("KV over NCCL from ", address, ": ", s.message()));
  };
  const bool join = held->link == nullptr;
  // Nothing asked but the link, which is there.
  if (!join && keys.empty()) return std::optional<std::vector<KvBlock>>(std::in_place);
  if (join) {
    absl::StatusOr<std::string> id = link_.make_nccl_id();
    if (!id.ok()) return from(id.status());
    held->unique_id = *id;
  }
  auto stub = KvStub(address, /*connection=*/0);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(5)));
  v1::FetchKvRequest req = FetchRequest(keys, first_layer, num_layers, stream);
  req.set_nccl_id(held->unique_id);
  req.set_nccl_join(join);
  // A new link: the other worker first checks that it can send everything and says so (a message
  // with no sequence), then both join; a refusal ends the stream before any message.
  std::unique_ptr<grpc::ClientReader<v1::KvChunk>> reader = stub->FetchKv(&ctx, req);
  v1::KvChunk chunk;
  const bool first = reader->Read(&chunk);
  auto fail = [&](const absl::Status& s) {
    held->link.reset();
    ctx.TryCancel();
    while (reader->Read(&chunk)) {
    }
    reader->Finish();
    return from(s);
  };
  if (!first) {
    // Nothing moved: over gRPC instead (which also names a sequence that is not stashed). A
    // worker that has no NCCL is not asked again.
    const grpc::Status done = reader->Finish();
    held->link.reset();
    if (absl::StrContains(done.error_message(), "has no NCCL")) held->unreachable = true;
    spdlog::debug("KV from {}: over gRPC ({})", address, done.error_message());
    return std::nullopt;
  }
  if (join) {
    if (!chunk.nccl() || chunk.num_layers() != 0) {
      return fail(absl::DataLossError("a sequence came before the link was joined"));
    }
    absl::StatusOr<std::unique_ptr<KvLink>> joined =
        link_.join_kv_link(held->unique_id, /*rank=*/1, nullptr);
    if (!joined.ok()) {
      held->unreachable = true;  // NCCL does not connect the two: gRPC from now on
      spdlog::warn("KV from {}: NCCL link not joined, over gRPC from now on: {}", address,
                   joined.status().ToString());
      return fail(joined.status());
    }
    held->link = *std::move(joined);
    if (!reader->Read(&chunk)) {
      const grpc::Status done = reader->Finish();
      // No sequence asked: the link was all (made ahead of the moves that will use it).
      if (done.ok() && keys.empty()) return std::optional<std::vector<KvBlock>>(std::in_place);
      held->link.reset();
      return from(done.ok() ? absl::DataLossError("the stream ended after the link was joined")
                            : FromGrpcStatus(done));
    }
  }
  if (keys.empty()) return std::optional<std::vector<KvBlock>>(std::in_place);
  const ModelConfig& c = a->engine->config();
  const KvShape shape{.first_layer = first_layer,
                      .num_layers = num_layers,
                      .num_kv_heads = c.num_kv_heads,
                      .head_dim = c.head_dim,
                      .max_positions = a->max_seq_len};
  // Every header, then every sequence's K and V as one NCCL transfer into memory of this GPU.
  std::vector<KvBlock> blocks;
  std::vector<std::pair<void*, size_t>> buffers;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i > 0 && !reader->Read(&chunk)) {
      const grpc::Status done = reader->Finish();
      held->link.reset();
      return from(done.ok() ? absl::DataLossError(absl::StrCat("the stream ended after ", i, " of ",
                                                               keys.size(), " sequences"))
                            : FromGrpcStatus(done));
    }
    if (chunk.key() != keys[i]) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("sequence ", chunk.key(), " came where ", keys[i], " was expected")));
    }
    absl::StatusOr<KvBlock> b = KvBlockOfNcclHeader(chunk, shape);
    if (!b.ok()) return fail(b.status());
    const size_t bytes = b->expected_bytes();
    absl::StatusOr<std::shared_ptr<uint8_t>> mem = held->link->Allocate(2 * bytes);
    if (!mem.ok()) return fail(mem.status());
    b->device_k = *mem;
    b->device_v = std::shared_ptr<uint8_t>(*mem, mem->get() + bytes);
    buffers.emplace_back(b->device_k.get(), bytes);
    buffers.emplace_back(b->device_v.get(), bytes);
    blocks.push_back(*std::move(b));
  }
  if (stream.step == 0) {
    if (absl::Status st = held->link->Recv(buffers); !st.ok()) return fail(st);
  } else {
    // Layer by layer, every sequence's K and V of the layer at once, as the other worker's step
    // writes them (SendOverNccl).
    std::vector<std::pair<void*, size_t>> layer;
    for (int l = 0; l < num_layers; ++l) {
      // Posted once the other worker says the layer is written.
      if (!reader->Read(&chunk)) {
        const grpc::Status done = reader->Finish();
        held->link.reset();
        return from(done.ok() ? absl::DataLossError(absl::StrCat("the stream ended before layer ",
                                                                 first_layer + l))
                              : FromGrpcStatus(done));
      }
      if (!chunk.nccl() || chunk.layer() != first_layer + l || chunk.num_layers() != 1) {
        return fail(absl::InvalidArgumentError(absl::StrCat(
            "layer ", chunk.layer(), " (", chunk.num_layers(), ") announced where layer ",
            first_layer + l, " was expected")));
      }
      layer.clear();
      for (const KvBlock& b : blocks) {
        const size_t layer_bytes = b.expected_bytes() / b.num_layers;
        layer.emplace_back(b.device_k.get() + l * layer_bytes, layer_bytes);
        layer.emplace_back(b.device_v.get() + l * layer_bytes, layer_bytes);
      }
      if (absl::Status st = held->link->Recv(layer); !st.ok()) return fail(st);
    }
  }
  if (reader->Read(&chunk)) {
    return fail(absl::InvalidArgumentError("more sequences came than were asked for"));
  }
  const grpc::Status done = reader->Finish();
  if (!done.ok()) {
    held->link.reset();
    return from(FromGrpcStatus(done));
  }
  return std::optional<std::vector<KvBlock>>(std::move(blocks));
}

grpc::Status WorkerService::DropKv(grpc::ServerContext* ctx, const v1::DropKvRequest* req,
                                   v1::DropKvResponse*) {
  if (grpc::Status a = CheckCaller(*ctx, callers_); !a.ok()) return a;
  // Freed after the lock: freeing device memory waits for the GPU's queue, and the executor takes
  // the lock before each step that writes sequences out.
  std::map<uint64_t, std::shared_ptr<const KvBlock>> stashed;
  std::map<uint64_t, WrittenOutKv> written;
  absl::MutexLock lock(&stash_mu_);
  if (req->keys().empty()) {
    std::swap(stashed, stash_);
    std::swap(written, written_out_);
  } else {
    for (uint64_t key : req->keys()) {
      if (auto node = stash_.extract(key)) stashed.insert(std::move(node));
      if (auto node = written_out_.extract(key)) written.insert(std::move(node));
    }
  }
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
