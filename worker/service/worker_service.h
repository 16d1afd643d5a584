// The tandem-worker daemon's Worker service: it loads the stage the coordinator assigns and runs
// the coordinator's step descriptors, strictly in their order, through the stage's StepRunner
// (step_runner.h), which passes activations on through the transport. Also the registrar, which
// registers with the coordinator and keeps the heartbeat.
//
// Threads (named): gRPC handler threads (AssignStage, Steps readers, StageLink receivers);
// "steps": one executor per open Steps stream, the only thread that runs steps on the stage;
// "results": one writer per open Steps stream, which sends the executor's results;
// "registrar": registration and heartbeats.
#pragma once

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/security/credentials.h"
#include "grpcpp/grpcpp.h"
#include "proto/tandem.grpc.pb.h"
#include "worker/backend.h"
#include "worker/service/assignment.h"
#include "worker/service/kv_moves.h"
#include "worker/service/step_runner.h"
#include "worker/stage.h"
#include "worker/transport/grpc_transport.h"
#include "worker/transport/kv_link.h"

namespace tandem {

struct WorkerMetrics;  // common/metrics.h

// How this worker links to its neighbours.
struct LinkOptions {
  // What PrepareLink offers when this worker is a pipeline's first stage: "grpc" or "nccl" (which
  // needs a backend with NCCL; without it a "nccl" assignment fails with FAILED_PRECONDITION).
  std::string transport = "grpc";
  // How the gRPC link reaches the next stage's StageLink: TLS and the cluster secret.
  ClientAuth peer_auth;
};

class WorkerService final : public v1::Worker::Service {
 public:
  // `backend` makes the stages and links over its device (worker/backend.h).
  WorkerService(std::unique_ptr<Backend> backend, ActivationInbox& inbox,
                absl::Duration recv_timeout, LinkOptions link = {});
  ~WorkerService() override;
  // Where to record stage timings (common/metrics.h); null: nowhere. Set before serving.
  void set_metrics(WorkerMetrics* metrics) { metrics_ = metrics; }
  // Where to write one line per step (tab-separated: end time in microseconds since the epoch,
  // step id, sequences, tokens, sequences feeding more than one token, then receive, compute and
  // send milliseconds); null: nowhere. Set before serving; the caller keeps it open.
  void set_step_trace(std::FILE* trace) { step_trace_ = trace; }
  // Which single stages launch decode steps ahead (StepRunner::Launch): those whose launched
  // steps run while the host goes on (kAuto, the default: CUDA stages), every one that can
  // (kAlways: a CPU stage runs a launched step at once, so each result leaves once the step
  // after it has run), or none (kOff: every step runs to its end before the next).
  enum class LaunchAhead { kOff, kAuto, kAlways };
  void set_launch_ahead(LaunchAhead mode) { launch_ahead_ = mode; }
  // Who may call this worker (the cluster secret) and the folder that every assigned checkpoint
  // must lie in (empty: anywhere; worker/model_root.h). Set before serving.
  void set_access(CallerPolicy callers, std::filesystem::path model_root) {
    callers_ = std::move(callers);
    model_root_ = std::move(model_root);
  }

  grpc::Status AssignStage(grpc::ServerContext* ctx, const v1::AssignStageRequest* req,
                           v1::AssignStageResponse* resp) override;
  grpc::Status ReleaseStage(grpc::ServerContext* ctx, const v1::ReleaseStageRequest* req,
                            v1::ReleaseStageResponse* resp) override;
  grpc::Status Steps(grpc::ServerContext* ctx,
                     grpc::ServerReaderWriter<v1::StepResult, v1::StepRequest>* stream) override;
  grpc::Status PrepareLink(grpc::ServerContext* ctx, const v1::PrepareLinkRequest* req,
                           v1::PrepareLinkResponse* resp) override;
  // Moving sequences with their KV-cache (proto/tandem.proto, service Worker), done by kv_moves.h:
  // export and import run between steps (the stage's run lock); a stashed sequence lives until
  // DropKv drops it (or an ExportKv of the same key replaces it), across assignments.
  grpc::Status ExportKv(grpc::ServerContext* ctx, const v1::ExportKvRequest* req,
                        v1::ExportKvResponse* resp) override;
  grpc::Status ImportKv(grpc::ServerContext* ctx, const v1::ImportKvRequest* req,
                        v1::ImportKvResponse* resp) override;
  grpc::Status FetchKv(grpc::ServerContext* ctx, const v1::FetchKvRequest* req,
                       grpc::ServerWriter<v1::KvChunk>* writer) override;
  grpc::Status DropKv(grpc::ServerContext* ctx, const v1::DropKvRequest* req,
                      v1::DropKvResponse* resp) override;

 private:
  // An assignment got ready for (AssignStageRequest.prepare): the request (prepare cleared), its
  // NCCL link and the weights placed for it.
  struct Prepared {
    v1::AssignStageRequest request;
    std::unique_ptr<ActivationTransport> nccl;
    std::shared_ptr<const PlacedWeights> weights;
  };
  // AssignStage's checks of `req` and the stage it asks for; the link's transport in `transport`.
  grpc::Status CheckAssignment(const v1::AssignStageRequest& req, StageSpec* spec,
                               std::string* transport);
  // Joins the pipeline's NCCL communicator as `req`'s stage.
  absl::StatusOr<std::unique_ptr<ActivationTransport>> JoinPipelineLink(
      const v1::AssignStageRequest& req, const StageSpec& spec);
  // AssignStage with `prepare`: the link joined and the weights placed, kept in prepared_.
  grpc::Status Prepare(const v1::AssignStageRequest& req, const StageSpec& spec,
                       const std::string& transport, v1::AssignStageResponse* resp)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(assign_mu_);
  // Pieces of AssignStage. Drops the current assignment (CloseInBackground), first putting the
  // weights of it that hold layers of `spec` in spec.placed for the new stage to take.
  void DropCurrentFor(StageSpec& spec, bool drained) ABSL_EXCLUSIVE_LOCKS_REQUIRED(assign_mu_);
  // The stage of `spec`; where memory runs short, again after spilling the KV stash to the host,
  // then again without the placed weights (which `spec` then lacks).
  absl::StatusOr<std::unique_ptr<Stage>> MakeStage(StageSpec& spec);
  // What AssignStage answers when the stage of `req` cannot be made with `s`.
  static grpc::Status StageError(const v1::AssignStageRequest& req, const absl::Status& s);
  // The assignment of `req` over `stage` and its link (`nccl`, or null: gRPC), with its runner.
  absl::StatusOr<std::shared_ptr<Assignment>> NewAssignment(
      const v1::AssignStageRequest& req, const StageSpec& spec, std::unique_ptr<Stage> stage,
      std::unique_ptr<ActivationTransport> nccl);
  // Drops an assignment that is over. `drained`: its pipeline ran its last steps to the end (a
  // layout change), so nothing of the link's is left on the stage's stream: the stage goes at
  // once (its memory is the next one's) and the link on a thread of its own, as closing an NCCL
  // link waits for the peers to close theirs (about a second). Otherwise, or where another holder
  // still has the assignment, the link closes first (ending what it left queued) and the stage
  // after it, with the last holder.
  void CloseInBackground(std::shared_ptr<Assignment> a, bool drained);
  // Closes `link` (null: nothing) on a thread of its own: an NCCL link's close waits for the
  // peers to close theirs, bounded by the transport.
  void CloseLinkInBackground(std::unique_ptr<ActivationTransport> link);
  // One Steps stream's shared state, and its executor (worker_service.cc).
  struct StepStream;
  class StepExecutor;
  // Executes one step; the result to send back (errors as error_code).
  v1::StepResult RunStep(Assignment& a, const StepDescriptor& d,
                         const std::function<bool()>& cancelled);
  // The result of step `d` that ran as `run` (errors as error_code), its times recorded.
  v1::StepResult ResultOf(Assignment& a, const StepDescriptor& d, absl::StatusOr<StepRun> run);
  // The current assignment when it is `id`; FAILED_PRECONDITION otherwise.
  absl::StatusOr<std::shared_ptr<Assignment>> AssignmentFor(uint64_t id);
  const std::unique_ptr<Backend> backend_;
  ActivationInbox& inbox_;
  const absl::Duration recv_timeout_;
  const LinkOptions link_;
  absl::Mutex assign_mu_;  // one AssignStage at a time
  std::unique_ptr<Prepared> prepared_ ABSL_GUARDED_BY(assign_mu_);
  bool made_a_stage_ ABSL_GUARDED_BY(assign_mu_) = false;  // or warmed up for one (WarmUp)
  struct Closing {  // a link closing on a thread of its own
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  absl::Mutex closing_mu_;
  std::vector<Closing> closing_ ABSL_GUARDED_BY(closing_mu_);
  absl::Mutex mu_;
  std::shared_ptr<Assignment> current_ ABSL_GUARDED_BY(mu_);
  KvMoves kv_;  // the stash, the write-outs and the KV-cache links
  WorkerMetrics* metrics_ = nullptr;
  std::FILE* step_trace_ = nullptr;
  LaunchAhead launch_ahead_ = LaunchAhead::kAuto;
  CallerPolicy callers_;
  std::filesystem::path model_root_;
};

// Registers `advertise_address` with the coordinator and heartbeats until stopped; registers again
// whenever the coordinator forgets the worker.
class Registrar {
 public:
  // `auth`: TLS and the cluster secret for the coordinator's Registry. `tensor_parallel`: the
  // ranks each of the worker's stages runs on, reported to the coordinator.
  Registrar(std::string coordinator, std::string advertise_address, std::string backend,
            ClientAuth auth = {}, int tensor_parallel = 1);
  ~Registrar();  // stops and joins

 private:
  void Loop();
  const std::string coordinator_, address_, backend_;
  const ClientAuth auth_;
  const int tensor_parallel_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace tandem
