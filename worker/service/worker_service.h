// The tandem-worker daemon's Worker service: it loads the stage the coordinator assigns and runs
// the coordinator's step descriptors, strictly in their order, passing activations on through the
// transport. Also the registrar, which registers with the coordinator and keeps the heartbeat.
//
// Threads (named): gRPC handler threads (AssignStage, Steps readers, StageLink receivers);
// "steps": one executor per open Steps stream, the only thread that runs the stage;
// "registrar": registration and heartbeats.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "proto/tandem.grpc.pb.h"
#include "worker/stage.h"
#include "worker/transport/grpc_transport.h"

namespace tandem {

struct WorkerMetrics;  // common/metrics.h

// Makes the compute backend's stage: "cpu" (and "cuda" where built).
using StageFactory =
    std::function<absl::StatusOr<std::unique_ptr<Stage>>(const StageSpec& spec)>;

class WorkerService final : public v1::Worker::Service {
 public:
  WorkerService(StageFactory factory, ActivationInbox& inbox, absl::Duration recv_timeout);
  // Where to record stage timings (common/metrics.h); null: nowhere. Set before serving.
  void set_metrics(WorkerMetrics* metrics) { metrics_ = metrics; }

  grpc::Status AssignStage(grpc::ServerContext* ctx, const v1::AssignStageRequest* req,
                           v1::AssignStageResponse* resp) override;
  grpc::Status Steps(grpc::ServerContext* ctx,
                     grpc::ServerReaderWriter<v1::StepResult, v1::StepRequest>* stream) override;

 private:
  // One assignment: the loaded stage and its link to the neighbours.
  struct Assignment {
    uint64_t id = 0;
    int stage = 0;
    int num_stages = 1;
    std::unique_ptr<Stage> engine;
    std::unique_ptr<ActivationTransport> transport;
    // Serializes the executors of streams that overlap during a hand-over.
    absl::Mutex run_mu;
  };
  // Executes one step; the result to send back (errors as error_code).
  v1::StepResult RunStep(Assignment& a, const v1::StepRequest& req,
                         const std::function<bool()>& cancelled);

  const StageFactory factory_;
  ActivationInbox& inbox_;
  const absl::Duration recv_timeout_;
  absl::Mutex assign_mu_;  // one AssignStage at a time
  absl::Mutex mu_;
  std::shared_ptr<Assignment> current_ ABSL_GUARDED_BY(mu_);
  WorkerMetrics* metrics_ = nullptr;
};

// Registers `advertise_address` with the coordinator and heartbeats until stopped; registers again
// whenever the coordinator forgets the worker.
class Registrar {
 public:
  Registrar(std::string coordinator, std::string advertise_address, std::string backend);
  ~Registrar();  // stops and joins

 private:
  void Loop();
  const std::string coordinator_, address_, backend_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace tandem
