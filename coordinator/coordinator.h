// The coordinator's state and wiring: registered workers, the pipelines built from them, health
// and failure handling, and the scheduler (scheduler.h: waiting queue, continuous batching, KV
// slots, stop rules) wired to the workers' streams. The gRPC services (grpc_services.h) are thin
// translations onto this class. Its code lives in coordinator.cc (threads, requests, failures,
// registry, admin), replan.cc (the re-plan: topology_policy.h decides, topology_executor.h
// performs) and prefill_handoff.cc (KV-cache from prefill to decode pipelines).
//
// Threads, and what each may touch. All shared state (every field below marked GUARDED_BY, the
// scheduler's included) is behind mu_; RPCs to workers are made outside it.
//   gRPC handler threads: Submit/Cancel/RequestState waits, Admin calls, Registry calls; under
//                  mu_. SetTopology, Drain and Undrain run a re-plan themselves (RunPlan).
//   "scheduler":   admits waiting requests, forms micro-batch steps and writes them to the
//                  pipelines' streams. A pipeline's reader of its last stage forms and writes
//                  the steps a result allows itself; steps leave in the order they were formed
//                  under mu_ whichever thread writes them (PipelineLink::Queue, Flush).
//   "health":      declares workers down when their heartbeats stop, and reports readiness
//                  (whether a pipeline serves) to the readiness observer, without locks held.
//   "planner":     closes broken pipelines, re-plans onto the workers that are left, and goes
//                  back to the topology asked for once enough workers are up again (RunPlan).
//                  A re-plan, whichever thread runs it, holds plan_mu_ throughout (one at a
//                  time), takes mu_ only to read the cluster's state and to record what it did,
//                  and loads stages, moves KV-cache and releases stages outside mu_; the
//                  releases run on short-lived threads of their own (StageReleaser), joined
//                  before the re-plan ends, that touch no coordinator state.
//   "handoff":     moves the KV-cache of sequences whose prompt a prefill pipeline finished to
//                  their decode pipeline (Worker.ExportKv, ImportKv, DropKv), outside mu_.
//   "kv-stream":   has decode pipelines import the KV-cache of prompts still running in a
//                  prefill pipeline, layer by layer as the prefill step writes it out
//                  (Scheduler::KvStream; Worker.ImportKv with stream_step), outside mu_.
//   "p<id>a<n>-<s>": one reader per stage stream of a pipeline (PipelineLink); takes mu_ to hand
//                  a result or a broken stream to the scheduler.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/model_config.h"
#include "common/security/credentials.h"
#include "common/text_config.h"
#include "common/tokenizer.h"
#include "coordinator/config.h"
#include "coordinator/kv_move.h"
#include "coordinator/kv_slots.h"
#include "coordinator/partition_planner.h"
#include "coordinator/pipeline_link.h"
#include "coordinator/request_state.h"
#include "coordinator/request_validation.h"
#include "coordinator/scheduler.h"
#include "coordinator/topology_executor.h"
#include "coordinator/topology_policy.h"
#include "grpcpp/grpcpp.h"
#include "proto/tandem.pb.h"

namespace tandem {

struct CoordinatorMetrics;  // common/metrics.h

class Coordinator {
 public:
  // Reads the model's config.json (and its tokenizer when present) from config.model_dir.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(const CoordinatorConfig& config);
  ~Coordinator();  // Shutdown()

  // Where to record metrics (common/metrics.h); null: nowhere. Set before Start().
  void set_metrics(CoordinatorMetrics* metrics);
  CoordinatorMetrics* metrics() const { return metrics_; }
  // How to reach the workers: TLS and the cluster secret (default: plain, no key). Set before
  // Start().
  void set_worker_auth(ClientAuth auth) { worker_auth_ = std::move(auth); }
  // Told whether a pipeline serves: once when the health thread starts, then at every change
  // (from the health thread, without locks held). Set before Start().
  void set_readiness_observer(std::function<void(bool serving)> observer) {
    readiness_observer_ = std::move(observer);
  }

  void Start();
  void Shutdown();  // stops the threads, fails what is left with UNAVAILABLE, closes streams

  const CoordinatorConfig& config() const { return config_; }
  const ModelConfig& model() const { return model_; }
  const ModelLimits& limits() const { return limits_; }
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }
  // BOS/EOS, chat template and length limit from the model folder's JSON files.
  const TextConfig& text_config() const { return text_config_; }

  // Inference. Submit queues the sequences of one request (its prompts x n) all or none; those
  // without a request id share the first's. RESOURCE_EXHAUSTED when the service holds as many
  // requests as it may (Scheduler::CheckRoom), INVALID_ARGUMENT when the request has more
  // sequences than it can ever hold, UNAVAILABLE when no pipeline serves and none is being built.
  absl::StatusOr<std::vector<std::shared_ptr<RequestState>>> Submit(
      std::vector<ValidatedRequest> sequences);
  // Ends a request now (deadline, client cancel) and frees its KV slot at once.
  void Cancel(const std::shared_ptr<RequestState>& request, const absl::Status& why);

  // Registry. Worker ids are random 64-bit numbers (positive), so that an id handed out before a
  // restart of the coordinator is unknown after it. Heartbeat: false when the id is unknown or
  // the worker was declared down; the worker then registers again.
  int64_t RegisterWorker(const std::string& address, const std::string& backend,
                         int tensor_parallel = 1);
  bool Heartbeat(int64_t worker_id);

  // Admin. The topology asked for (flags, config or SetTopology) is kept: when a loss leaves too
  // few workers, pipelines serve with fewer stages until enough are up again. Workers declared
  // down are forgotten after the next re-plan.
  v1::Topology GetTopology();
  // `prefill_replicas`: of the replicas, those that run prompts only; `tensor_parallel`: ranks
  // per stage, 0 for each worker's own (SetTopologyRequest; unset: as before).
  absl::StatusOr<v1::Topology> SetTopology(int stages, int replicas,
                                           std::optional<int> prefill_replicas = std::nullopt,
                                           std::optional<int> tensor_parallel = std::nullopt);
  std::vector<v1::WorkerInfo> ListWorkers();
  absl::StatusOr<v1::Topology> Drain(int64_t worker_id);
  // Undoes Drain: FAILED_PRECONDITION when the worker is not drained.
  absl::StatusOr<v1::Topology> Undrain(int64_t worker_id);

 private:
  struct WorkerEntry {
    int64_t id = 0;
    std::string address;
    std::string backend;
    int tensor_parallel = 1;  // ranks the worker splits its stage over
    std::shared_ptr<grpc::Channel> channel;
    absl::Time last_heartbeat;
    v1::WorkerState state = v1::WORKER_STATE_IDLE;
    int pipeline = -1;
    int stage = -1;
    LayerRange layers;
  };
  // Who serves a pipeline and the link to them; its sequences and slots are the scheduler's
  // (under the same id).
  struct Pipeline {
    int id = 0;
    uint64_t assignment = 0;
    std::vector<int64_t> workers;  // per stage
    std::vector<LayerRange> ranges;
    int tensor_parallel = 0;  // ranks per stage as assigned (0: each worker's own)
    std::shared_ptr<PipelineLink> link;
  };

  explicit Coordinator(const CoordinatorConfig& config);

  void SchedulerLoop();
  void HealthLoop();
  void PlannerLoop();
  void HandoffLoop();
  void KvStreamLoop();
  // Gives the serving pipelines their roles: with more of them than wanted_prefill_replicas_ (> 0),
  // that many run prompts and the others decode, a pipeline keeping its role where it can;
  // otherwise all do both.
  void AssignRoles() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void OnStepResult(int pipeline, uint64_t assignment, int stage, const v1::StepResult& r);
  // The scheduler's part of a result; the link whose queued steps the caller flushes, if any.
  std::shared_ptr<PipelineLink> OnStepResultLocked(int pipeline, uint64_t assignment, int stage,
                                                   const v1::StepResult& r)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues the steps the scheduler forms for `p` on its link; whether there were any.
  bool QueueSteps(Pipeline& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnLinkBroken(int pipeline, uint64_t assignment, int stage, const absl::Status& s);
  // With `resume`, its running requests go back to the queue to continue elsewhere (see
  // Scheduler::RemovePipeline) instead of failing with `why`.
  void FailPipeline(int pipeline, const absl::Status& why, bool resume = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkDown(int64_t worker_id, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkSilentWorkersDown() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the entries of workers declared down (a worker that comes back registers anew).
  void ForgetDownWorkers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<WorkerEntry*> FindWorker(int64_t worker_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t NewWorkerId() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Workers that can take a stage (idle or serving) of `tensor_parallel` ranks (at least so many).
  int UsableWorkers(int tensor_parallel = 0) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Back to the stages asked for once enough workers are usable again.
  void RestoreWantedStages() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::Topology TopologyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int LivePipelines() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Copies queue, running, KV-slot and worker states into the metrics' gauges.
  void UpdateGauges() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Brings the pipelines to the wanted topology (replan.cc): closes failed ones, moves the
  // sequences of those that no longer fit (or drains them without move_kv) and removes them,
  // builds missing ones from idle workers. What to do is the policy's (topology_policy.h), the
  // RPCs the executor's (topology_executor.h). Serialized by plan_mu_.
  absl::Status RunPlan();
  // Pipeline `p`'s stages as a move sees them.
  std::vector<KvStage> StagesOf(const Pipeline& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sequences leaving a retired pipeline with their KV-cache, and the stages that hold it.
  struct Departure {
    int pipeline = 0;
    std::vector<KvStage> holders;
    std::vector<KvSeq> seqs;  // keys are the scheduler's sequence ids
    absl::Status status;      // not OK: they are recomputed instead
  };
  // Pauses the `retiring` pipelines and takes the sequences out of each one whose steps end within
  // the drain limit (the others' resume elsewhere, recomputed).
  std::vector<Departure> DetachForMove(const std::vector<int>& retiring)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Places every departed sequence in a pipeline and has its stages import the KV-cache; the
  // sequences continue (or, where any of it failed, are recomputed). Outside mu_.
  void ArriveMoved(std::vector<Departure>& departures, absl::Time paused);
  // UNAVAILABLE for a request that no pipeline can serve, saying why (plan_error_).
  absl::Status NoPipelineErrorLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The cluster as the topology policy sees it (topology_policy.h).
  ClusterState ClusterStateLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What every stage is told besides its place in its pipeline.
  StageSettings StageSettingsOf() const;
  // Stops the `retiring` pipelines: with move_kv, detaches the sequences that move with their
  // KV-cache (DetachForMove); otherwise waits up to the drain limit for them to finish. The
  // sequences left resume elsewhere, recomputed.
  std::vector<Departure> RetireLocked(const std::vector<int>& retiring)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A pipeline planned before the pipelines it replaces stop: its stages' requests (the link
  // chosen), sent with `prepare` while those still serve.
  struct Planned {
    int id = 0;
    uint64_t assignment = 0;
    std::vector<int64_t> workers;
    std::vector<LayerRange> ranges;
    std::vector<v1::AssignStageRequest> requests;
  };
  // Where pipelines retire, has the policy plan their replacements on the workers that will be
  // idle (PlanTopology: the choice RunPlan then makes) and gets those ready while the old ones
  // serve: each stage prepared (AssignStageRequest.prepare: link joined, weights placed) and,
  // with move_kv, the KV links made between the new stages and the old holders of their layers.
  // Returns the plans whose stages all got ready. Outside mu_.
  std::vector<Planned> PrepareReplacements();
  // Builds the pipelines the policy asks for (PlanBuilds) one by one, each from a prepared plan
  // of `planned` where one fits (taken out of it) or else loaded on assignment, until the replicas
  // asked for serve or too few workers are idle. The error that leaves fewer (a bad checkpoint);
  // a worker that fails to load is marked down and the others are tried.
  absl::Status BuildPipelines(std::vector<Planned>& planned);
  // Assigns the stages (`requests`: those of a prepare, or none to make them) and adds the
  // pipeline to the scheduler.
  absl::Status BuildPipeline(int id, uint64_t assignment, const std::vector<int64_t>& workers,
                             const std::vector<LayerRange>& ranges,
                             std::vector<v1::AssignStageRequest> requests = {});
  void CloseLinks();

  const CoordinatorConfig config_;
  ModelConfig model_;
  ModelLimits limits_;
  std::unique_ptr<Tokenizer> tokenizer_;
  TextConfig text_config_;

  absl::Mutex plan_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_scheduler_ ABSL_GUARDED_BY(mu_) = false;
  bool replan_needed_ ABSL_GUARDED_BY(mu_) = false;
  bool planning_ ABSL_GUARDED_BY(mu_) = false;
  bool planned_once_ ABSL_GUARDED_BY(mu_) = false;
  // Why the last plan left fewer pipelines than wanted (a worker's load error, a bad
  // checkpoint); OK once the wanted pipelines serve. Clients and GetTopology are told.
  absl::Status plan_error_ ABSL_GUARDED_BY(mu_);
  int wanted_stages_ ABSL_GUARDED_BY(mu_) = 1;
  int wanted_replicas_ ABSL_GUARDED_BY(mu_) = 1;
  int wanted_prefill_replicas_ ABSL_GUARDED_BY(mu_) = 0;
  // Ranks per stage asked for (0: each worker's own). Atomic: StageSettingsOf reads it outside
  // mu_ too.
  std::atomic<int> wanted_tensor_parallel_ = 0;
  // (prefill pipeline, decode pipeline) pairs whose workers are to make their KV links before the
  // first hand-off between them (the "handoff" thread does, with an import of no sequence), and
  // every pair ever queued.
  std::vector<std::pair<int, int>> link_warmups_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<int, int>> warmed_pairs_ ABSL_GUARDED_BY(mu_);
  int effective_stages_ ABSL_GUARDED_BY(mu_) = 1;  // < wanted when too few workers are left
  absl::BitGen random_ ABSL_GUARDED_BY(mu_);  // worker ids and the first assignment id
  int next_pipeline_id_ ABSL_GUARDED_BY(mu_) = 0;
  // Starts at a random number: a worker must not take steps or activations of an assignment
  // made before a restart for those of a new one.
  uint64_t next_assignment_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<int64_t, WorkerEntry> workers_ ABSL_GUARDED_BY(mu_);
  // Every worker address seen and whether a live worker holds it, for the metrics' gauges (an
  // address whose worker went away reads 0).
  std::map<std::string, bool> addresses_up_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::unique_ptr<Pipeline>> pipelines_ ABSL_GUARDED_BY(mu_);
  // Waiting queue, sequences, slots and steps in flight of every pipeline in pipelines_.
  std::unique_ptr<Scheduler> scheduler_ ABSL_PT_GUARDED_BY(mu_);  // made by Create()
  std::vector<std::shared_ptr<PipelineLink>> links_to_close_ ABSL_GUARDED_BY(mu_);

  std::vector<std::thread> threads_;
  CoordinatorMetrics* metrics_ = nullptr;
  ClientAuth worker_auth_;
  std::function<void(bool serving)> readiness_observer_;
};

}  // namespace tandem
