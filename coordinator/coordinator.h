// The coordinator's state and decisions: registered workers, the pipelines built from them, the
// waiting queue, continuous batching, KV slots, stop conditions and failure handling. The gRPC
// services (grpc_services.h) are thin translations onto this class.
//
// Threads (all named; see Start()):
//   gRPC handler threads: Submit/Cancel/RequestState waits, Admin calls, Registry calls.
//   "scheduler":   admits waiting requests, forms micro-batch steps and writes them to the
//                  pipelines' streams (the only writer, which keeps every stage's order).
//   "health":      declares workers down when their heartbeats stop.
//   "planner":     closes broken pipelines and re-plans onto the workers that are left.
//   "p<id>a<n>-<s>": one reader per stage stream of a pipeline (PipelineLink).
// All shared state is behind mu_; the planner's slow work (loading stages) runs outside it,
// serialized by plan_mu_.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/model_config.h"
#include "common/security/credentials.h"
#include "common/text_config.h"
#include "common/tokenizer.h"
#include "coordinator/config.h"
#include "coordinator/kv_slots.h"
#include "coordinator/partition_planner.h"
#include "coordinator/pipeline_link.h"
#include "coordinator/request_validation.h"
#include "grpcpp/grpcpp.h"
#include "proto/tandem.pb.h"

namespace tandem {

struct CoordinatorMetrics;  // common/metrics.h

// One request's progress, shared by the handler thread that waits on it and the coordinator that
// fills it.
class RequestState {
 public:
  RequestState(ValidatedRequest request, absl::Time arrival)
      : request_(std::move(request)), arrival_(arrival) {}
  const ValidatedRequest& request() const { return request_; }
  absl::Time arrival() const { return arrival_; }

  struct Snapshot {
    std::vector<int32_t> tokens;  // every generated token so far
    std::vector<TokenLogprob> logprobs;         // with request().logprobs >= 0: one per token
    std::vector<TokenLogprob> prompt_logprobs;  // with request().prompt_logprobs >= 0
    bool done = false;
    absl::Status status;  // when done
    v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
    int text_limit = -1;  // when a stop string ended it: bytes of decoded text to keep
    absl::Time admitted = absl::InfinitePast(), first_token = absl::InfinitePast(),
               finished = absl::InfinitePast();
  };
  // Blocks until more than `seen` tokens exist, the request is done, or `until`.
  Snapshot Wait(size_t seen, absl::Time until);

  // Coordinator side.
  void Admitted(absl::Time t);
  // `logprob`: the token's, when the request asked for logprobs.
  void Append(int32_t token, absl::Time t, TokenLogprob* logprob = nullptr);
  void AppendPromptLogprobs(std::vector<TokenLogprob> logprobs);
  // First call wins; later ones are ignored.
  void Finish(absl::Status status, v1::FinishReason finish, int text_limit, absl::Time t);
  size_t num_tokens();

 private:
  const ValidatedRequest request_;
  const absl::Time arrival_;
  absl::Mutex mu_;
  Snapshot s_ ABSL_GUARDED_BY(mu_);
};

class Coordinator {
 public:
  // Reads the model's config.json (and its tokenizer when present) from config.model_dir.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(const CoordinatorConfig& config);
  ~Coordinator();  // Shutdown()

  // Where to record metrics (common/metrics.h); null: nowhere. Set before Start().
  void set_metrics(CoordinatorMetrics* metrics) { metrics_ = metrics; }
  CoordinatorMetrics* metrics() const { return metrics_; }
  // How to reach the workers: TLS and the cluster secret (default: plain, no key). Set before
  // Start().
  void set_worker_auth(ClientAuth auth) { worker_auth_ = std::move(auth); }

  void Start();
  void Shutdown();  // stops the threads, fails what is left with UNAVAILABLE, closes streams

  const CoordinatorConfig& config() const { return config_; }
  const ModelConfig& model() const { return model_; }
  const ModelLimits& limits() const { return limits_; }
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }
  // BOS/EOS, chat template and length limit from the model folder's JSON files.
  const TextConfig& text_config() const { return text_config_; }

  // Inference. Submit: RESOURCE_EXHAUSTED when the waiting queue is full, UNAVAILABLE when no
  // pipeline serves and none is being built.
  absl::StatusOr<std::shared_ptr<RequestState>> Submit(ValidatedRequest request);
  // Ends a request now (deadline, client cancel) and frees its KV slot at once.
  void Cancel(const std::shared_ptr<RequestState>& request, const absl::Status& why);

  // Registry.
  int64_t RegisterWorker(const std::string& address, const std::string& backend);
  bool Heartbeat(int64_t worker_id);

  // Admin.
  v1::Topology GetTopology();
  absl::StatusOr<v1::Topology> SetTopology(int stages, int replicas);
  std::vector<v1::WorkerInfo> ListWorkers();
  absl::StatusOr<v1::Topology> Drain(int64_t worker_id);

 private:
  struct WorkerEntry {
    int64_t id = 0;
    std::string address;
    std::string backend;
    std::shared_ptr<grpc::Channel> channel;
    absl::Time last_heartbeat;
    v1::WorkerState state = v1::WORKER_STATE_IDLE;
    int pipeline = -1;
    int stage = -1;
    LayerRange layers;
  };
  struct Sequence {
    uint64_t id = 0;
    std::shared_ptr<RequestState> request;
    int pipeline = -1;
    int slot = -1;
    int position = 0;               // tokens already in the KV-cache
    std::vector<int32_t> pending;   // tokens to feed: the prompt (rest), then the newest token
    int generated = 0;
    // With a penalty set: every distinct token of the sequence the penalties look at (the prompt
    // only for repetition_penalty) -> {times generated, in the prompt}.
    absl::flat_hash_map<int32_t, std::pair<int32_t, bool>> seen;
    bool in_flight = false;
    absl::Time last_token = absl::InfinitePast();  // for the inter-token latency
  };
  struct StepEntry {
    uint64_t seq = 0;
    int num_tokens = 0;
    bool sample = false;
  };
  struct Pipeline {
    explicit Pipeline(int slots) : slots(slots) {}
    int id = 0;
    uint64_t assignment = 0;
    std::vector<int64_t> workers;  // per stage
    std::vector<LayerRange> ranges;
    std::shared_ptr<PipelineLink> link;
    KvSlotAllocator slots;
    std::vector<uint64_t> running;  // sequence ids, admission order
    std::map<uint64_t, std::vector<StepEntry>> inflight;
    uint64_t next_step = 1;
    bool draining = false;
  };

  explicit Coordinator(const CoordinatorConfig& config);

  void SchedulerLoop();
  void HealthLoop();
  void PlannerLoop();

  void Admit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FormSteps(Pipeline& p, std::vector<std::pair<std::shared_ptr<PipelineLink>,
                                                    v1::StepRequest>>& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnStepResult(int pipeline, uint64_t assignment, int stage, const v1::StepResult& r);
  void OnLinkBroken(int pipeline, uint64_t assignment, int stage, const absl::Status& s);
  void AppendToken(Sequence& seq, int32_t token, TokenLogprob* logprob)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndSequence(uint64_t seq_id, absl::Status status, v1::FinishReason finish,
                   int text_limit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailPipeline(int pipeline, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkDown(int64_t worker_id, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::Topology TopologyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int LivePipelines() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Copies queue, running, KV-slot and worker states into the metrics' gauges.
  void UpdateGauges() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Brings the pipelines to the wanted topology: closes failed ones, drains and removes those
  // that no longer fit, builds missing ones from idle workers. Serialized by plan_mu_.
  absl::Status RunPlan();
  absl::Status BuildPipeline(int id, uint64_t assignment, const std::vector<int64_t>& workers,
                             const std::vector<LayerRange>& ranges);
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
  int wanted_stages_ ABSL_GUARDED_BY(mu_) = 1;
  int wanted_replicas_ ABSL_GUARDED_BY(mu_) = 1;
  int effective_stages_ ABSL_GUARDED_BY(mu_) = 1;  // < wanted when too few workers are left
  int64_t next_worker_id_ ABSL_GUARDED_BY(mu_) = 1;
  int next_pipeline_id_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_assignment_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_seq_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<int64_t, WorkerEntry> workers_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::unique_ptr<Pipeline>> pipelines_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::unique_ptr<Sequence>> seqs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<const RequestState*, uint64_t> seq_of_request_ ABSL_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<RequestState>> waiting_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<PipelineLink>> links_to_close_ ABSL_GUARDED_BY(mu_);

  std::vector<std::thread> threads_;
  CoordinatorMetrics* metrics_ = nullptr;
  ClientAuth worker_auth_;
};

}  // namespace tandem
