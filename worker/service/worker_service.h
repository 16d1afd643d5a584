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
#include "worker/kv_out.h"
#include "worker/service/step_runner.h"
#include "worker/stage.h"
#include "worker/transport/grpc_transport.h"
#include "worker/transport/kv_link.h"

namespace tandem {

struct WorkerMetrics;  // common/metrics.h

// Makes the compute backend's stage: "cpu" (and "cuda" where built).
using StageFactory =
    std::function<absl::StatusOr<std::unique_ptr<Stage>>(const StageSpec& spec)>;

// What a stage needs to join its pipeline's NCCL communicator.
struct NcclJoin {
  std::string unique_id;  // kNcclUniqueIdBytes bytes from the first stage's PrepareLink
  int rank = 0;           // the stage index
  int world = 1;          // stages in the pipeline
  int hidden_size = 0;    // cols of every activation
  int64_t max_rows = 0;   // rows of the largest step
};

// How this worker links to its neighbours. The NCCL functions exist only in CUDA builds with the
// cuda backend (main.cc); without them a "nccl" assignment fails with FAILED_PRECONDITION.
struct LinkOptions {
  // What PrepareLink offers when this worker is a pipeline's first stage: "grpc" or "nccl".
  std::string transport = "grpc";
  std::function<absl::StatusOr<std::string>()> make_nccl_id;
  std::function<absl::StatusOr<std::unique_ptr<ActivationTransport>>(const NcclJoin&)> join_nccl;
  // Copies device activations to the host for the gRPC link; empty: stages output host ones.
  std::function<absl::StatusOr<Activations>(const Activations&)> to_host;
  // Called once an assignment has both its stage and its NCCL transport (the transport is made
  // first and destroyed first): main.cc puts the transport's work on the stage's stream and has
  // the stage's waits watch the transport's sends. Empty: nothing.
  std::function<absl::Status(Stage&, ActivationTransport&)> bind_nccl;
  // With an NCCL link bound to the stage's stream: installs the stage's decode tail, so that
  // decode steps send their output from the device (StepRunnerOptions::set_decode_tail). Empty:
  // every send once the host has seen the step finish.
  std::function<absl::Status(Stage&, DecodeSend)> set_decode_tail;
  // How the gRPC link reaches the next stage's StageLink: TLS and the cluster secret.
  ClientAuth peer_auth;
  // KV-cache between GPUs: joins the two-rank NCCL communicator of a unique id (make_nccl_id) as
  // rank 0 (sends) or 1 (receives), giving up once `cancelled` says so. With it, ExportKv keeps
  // stashes on the GPU when asked, and fetches between two such workers go over NCCL (gRPC when
  // the other worker cannot). Empty: KV-cache moves through host memory and gRPC.
  std::function<absl::StatusOr<std::unique_ptr<KvLink>>(const std::string& unique_id, int rank,
                                                        std::function<bool()> cancelled)>
      join_kv_link;
  // A stashed block in device memory copied to host memory, for a fetch over gRPC.
  std::function<absl::StatusOr<KvBlock>(const KvBlock&)> kv_to_host;
  // Places the weights of `spec`'s layers that spec.placed lacks (MakeCudaStage's
  // PlaceCudaWeights), for a prepared assignment; null when nothing lacks. Empty: the backend
  // places none, and a stage loads all it needs when assigned.
  std::function<absl::StatusOr<std::shared_ptr<const PlacedWeights>>(const StageSpec& spec)>
      place_weights;
  // Makes a stage of `spec` (on placed weights, with a small KV-cache) and drops it, so that a
  // worker's first stage does not load its libraries' and kernels' code in a re-partition's pause;
  // asked by a prepare of a worker that has made no stage yet. Empty: nothing to warm.
  std::function<absl::Status(const StageSpec& spec)> warm_up;
};

// A step of an assignment that writes sequences out (SequenceStep.kv_out_key; step 0: none).
struct WriteOutRef {
  uint64_t assignment = 0;
  uint64_t step = 0;
};

class WorkerService final : public v1::Worker::Service {
 public:
  WorkerService(StageFactory factory, ActivationInbox& inbox, absl::Duration recv_timeout,
                LinkOptions link = {});
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
  // Moving sequences with their KV-cache (proto/tandem.proto, service Worker). Export and import
  // run between steps (the stage's run lock); a stashed sequence lives in host memory until DropKv
  // drops it (or an ExportKv of the same key replaces it), across assignments.
  grpc::Status ExportKv(grpc::ServerContext* ctx, const v1::ExportKvRequest* req,
                        v1::ExportKvResponse* resp) override;
  grpc::Status ImportKv(grpc::ServerContext* ctx, const v1::ImportKvRequest* req,
                        v1::ImportKvResponse* resp) override;
  grpc::Status FetchKv(grpc::ServerContext* ctx, const v1::FetchKvRequest* req,
                       grpc::ServerWriter<v1::KvChunk>* writer) override;
  grpc::Status DropKv(grpc::ServerContext* ctx, const v1::DropKvRequest* req,
                      v1::DropKvResponse* resp) override;

 private:
  // One assignment: the loaded stage and its link to the neighbours.
  struct Assignment {
    uint64_t id = 0;
    int stage = 0;
    int num_stages = 1;
    int first_layer = 0;  // the model layers the stage holds, [first_layer, last_layer)
    int last_layer = 0;
    int max_seq_len = 0;
    std::unique_ptr<Stage> engine;
    std::unique_ptr<ActivationTransport> transport;
    std::unique_ptr<StepRunner> runner;  // over engine and transport; destroyed first
    // Serializes the executors of streams that overlap during a hand-over, and the KV-cache
    // exports and imports that run between steps.
    absl::Mutex run_mu;
    // Exports and imports waiting for run_mu: an executor lets them in before its next step
    // (RunLock), so that a busy stage does not keep a hand-off waiting step after step.
    std::atomic<int> kv_waiting{0};
  };
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
  // run_mu for a step (after every waiting export or import) or for one sequence's KV-cache.
  static void LockForStep(Assignment& a);
  static void LockForKv(Assignment& a);
  // Executes one step; the result to send back (errors as error_code).
  v1::StepResult RunStep(Assignment& a, const StepDescriptor& d,
                         const std::function<bool()>& cancelled);
  // The result of step `d` that ran as `run` (errors as error_code), its times recorded.
  v1::StepResult ResultOf(Assignment& a, const StepDescriptor& d, absl::StatusOr<StepRun> run);
  // Copies the stash's blocks in device memory to host memory (a new stage needs the room);
  // returns how many.
  int SpillStashToHost();
  // The stash's block of sequence `key`; NOT_FOUND naming it otherwise (a step's write-out is
  // fetched by its step: WrittenOut).
  absl::StatusOr<std::shared_ptr<const KvBlock>> Stashed(uint64_t key);
  // Opens the write-outs of `d`'s rows with kv_out_key set (Stage::OpenKvOut) and puts them in
  // the stash as the step's, replacing what the stash held of their keys or slots; one the stage
  // cannot open is put in failed, so that its fetch fails at once and the hand-off falls back.
  void OpenKvOuts(Assignment& a, const StepDescriptor& d);
  // The write-out of sequence `key` by `ref`'s step, waiting until `deadline` for the step to
  // open it: FAILED_PRECONDITION at once where it cannot (another assignment, a later step run,
  // the steps' stream ended), DEADLINE_EXCEEDED naming the sequence and the step at the deadline.
  absl::StatusOr<std::shared_ptr<KvOut>> WrittenOut(uint64_t key, WriteOutRef ref,
                                                    absl::Time deadline);
  // The block of `key` over layers [first_layer, first_layer + num_layers) from this worker's
  // stash, or from `stream`'s write-out (step nonzero) once its layers are written.
  absl::StatusOr<KvBlock> OwnBlock(uint64_t key, int first_layer, int num_layers,
                                   WriteOutRef stream);
  // The current assignment when it is `id`; FAILED_PRECONDITION otherwise.
  absl::StatusOr<std::shared_ptr<Assignment>> AssignmentFor(uint64_t id);
  // The blocks of `keys` over layers [first_layer, first_layer + num_layers) from the stash of
  // the worker at `address` (over FetchKv), put together for `a`'s stage.
  // With `stream` (step nonzero), the sequences as that step of the other worker writes them
  // out, each layer fetched as soon as it is written.
  absl::StatusOr<std::vector<KvBlock>> FetchBlocks(const Assignment& a, const std::string& address,
                                                   const std::vector<uint64_t>& keys,
                                                   int first_layer, int num_layers,
                                                   WriteOutRef stream = {});
  // FetchBlocks over NCCL (LinkOptions::join_kv_link): the blocks in this worker's device memory,
  // or, when the other worker refused before sending anything (it cannot), nullopt.
  // With no keys, only the link (made where there is none); `a` may then be null.
  absl::StatusOr<std::optional<std::vector<KvBlock>>> FetchOverNccl(
      const Assignment* a, const std::string& address, const std::vector<uint64_t>& keys,
      int first_layer, int num_layers, WriteOutRef stream = {});
  // FetchKv's side of FetchOverNccl: the blocks of `req` sent over the link of req.nccl_id.
  grpc::Status SendOverNccl(grpc::ServerContext* ctx, const v1::FetchKvRequest& req,
                            grpc::ServerWriter<v1::KvChunk>* writer);
  // FetchKv of a step's write-outs (req.stream_step) over gRPC: each layer's chunks as soon as
  // the layer is written.
  grpc::Status SendWrittenOut(grpc::ServerContext* ctx, const v1::FetchKvRequest& req,
                              grpc::ServerWriter<v1::KvChunk>* writer);
  // A stub of the worker at `address` for KV-cache fetches, on connection number `connection`.
  std::unique_ptr<v1::Worker::Stub> KvStub(const std::string& address, int connection) const;
  // One FetchKv stream of FetchBlocks, over connection number `connection`.
  absl::StatusOr<std::vector<KvBlock>> FetchGroup(const Assignment& a, const std::string& address,
                                                  const std::vector<uint64_t>& keys,
                                                  int first_layer, int num_layers,
                                                  int connection, WriteOutRef stream = {});

  const StageFactory factory_;
  ActivationInbox& inbox_;
  const absl::Duration recv_timeout_;
  const LinkOptions link_;
  absl::Mutex assign_mu_;  // one AssignStage at a time
  std::unique_ptr<Prepared> prepared_ ABSL_GUARDED_BY(assign_mu_);
  bool made_a_stage_ ABSL_GUARDED_BY(assign_mu_) = false;  // or warmed up for one (warm_up)
  struct Closing {  // a link closing on a thread of its own
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  absl::Mutex closing_mu_;
  std::vector<Closing> closing_ ABSL_GUARDED_BY(closing_mu_);
  absl::Mutex mu_;
  std::shared_ptr<Assignment> current_ ABSL_GUARDED_BY(mu_);
  absl::Mutex stash_mu_;
  std::map<uint64_t, std::shared_ptr<const KvBlock>> stash_ ABSL_GUARDED_BY(stash_mu_);
  // Sequences written out by a step as it runs (OpenKvOuts), until DropKv, another write-out of
  // the key or slot, or an ExportKv of the key: at most one per slot of the stage.
  struct WrittenOutKv {
    WriteOutRef by;
    std::shared_ptr<KvOut> out;
  };
  std::map<uint64_t, WrittenOutKv> written_out_ ABSL_GUARDED_BY(stash_mu_);
  // The newest step run of the current assignment, and a count of the ends of steps' streams and
  // assignments: a fetch of a write-out gives up once its step has passed or can no longer come.
  uint64_t newest_step_ ABSL_GUARDED_BY(stash_mu_) = 0;
  uint64_t out_assignment_ ABSL_GUARDED_BY(stash_mu_) = 0;  // the current assignment
  uint64_t steps_epoch_ ABSL_GUARDED_BY(stash_mu_) = 0;
  // NCCL links for KV-cache, kept for later moves: those this worker sends on, by unique id, and
  // those it fetches on, by the other worker's address. A link is used by one move at a time.
  struct HeldKvLink {
    absl::Mutex mu;
    std::string unique_id;  // of a fetch link (a send link's is its key)
    std::unique_ptr<KvLink> link ABSL_GUARDED_BY(mu);
    bool unreachable ABSL_GUARDED_BY(mu) = false;  // a join failed: gRPC from then on
  };
  absl::Mutex kv_links_mu_;
  std::map<std::string, std::shared_ptr<HeldKvLink>> send_links_ ABSL_GUARDED_BY(kv_links_mu_);
  std::map<std::string, std::shared_ptr<HeldKvLink>> fetch_links_ ABSL_GUARDED_BY(kv_links_mu_);
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
  // `auth`: TLS and the cluster secret for the coordinator's Registry.
  Registrar(std::string coordinator, std::string advertise_address, std::string backend,
            ClientAuth auth = {});
  ~Registrar();  // stops and joins

 private:
  void Loop();
  const std::string coordinator_, address_, backend_;
  const ClientAuth auth_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace tandem
