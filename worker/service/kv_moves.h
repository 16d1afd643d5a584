// A worker's KV-cache moves: sequences exported from its stage into the stash, imported into its
// stage from the stash or from other workers' (fetched over NCCL between GPUs, over gRPC
// otherwise), the write-outs a step streams to a decode worker while it runs, and the NCCL links
// kept for later moves. The Worker service (worker_service.h) checks the caller and the
// assignment and hands its KV-cache RPCs here.
//
// Threads: the gRPC handler threads of ExportKv, ImportKv, FetchKv and DropKv, and the steps'
// executor (OpenKvOuts); an import fetches from up to kFetchStreams streams per source on
// threads of its own. Exports and imports touch the stage between steps (Assignment::LockForKv).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/security/credentials.h"
#include "proto/tandem.grpc.pb.h"
#include "worker/backend.h"
#include "worker/kv_out.h"
#include "worker/service/assignment.h"
#include "worker/stage.h"
#include "worker/transport/kv_link.h"
#include "worker/transport/kv_wire.h"

namespace tandem {

// What moves KV-cache off this worker's host.
struct KvMoveOptions {
  // The worker's backend (worker/backend.h), which must outlive the moves; null: a host worker's.
  // With its KV link (Backend::has_kv_link), ExportKv keeps stashes on the GPU when asked, and
  // fetches between two such workers go over NCCL (gRPC when the other worker cannot); without,
  // KV-cache moves through host memory and gRPC. A stashed block in device memory is copied to
  // host memory (Backend::KvToHost) for a fetch over gRPC.
  Backend* backend = nullptr;
  // How fetches reach other workers: TLS and the cluster secret.
  ClientAuth peer_auth;
};

// A step of an assignment that writes sequences out (SequenceStep.kv_out_key; step 0: none).
struct WriteOutRef {
  uint64_t assignment = 0;
  uint64_t step = 0;
};

// Where a FetchKv answer goes: the stream to the fetching worker.
struct KvChunkSink {
  std::function<bool(const v1::KvChunk&)> write;  // false: the fetching worker went away
  std::function<bool()> cancelled;                // the fetch was cancelled
  absl::Time deadline = absl::InfiniteFuture();   // the fetch's
};

class KvMoves {
 public:
  explicit KvMoves(KvMoveOptions options);

  // Whether KV-cache can move between GPUs over NCCL from this worker.
  bool has_nccl() const { return options_.backend != nullptr && options_.backend->has_kv_link(); }

  // ExportKv: `req`'s sequences of `a`'s stage into the stash (replacing what it held of their
  // keys, write-outs included), in device memory where asked and possible; resp.bytes set.
  absl::Status Export(Assignment& a, const v1::ExportKvRequest& req, v1::ExportKvResponse& resp);
  // ImportKv: `req`'s sequences into `a`'s stage, their layers from the sources (this worker's
  // stash or write-outs where a source has no address, the other workers' otherwise); resp's
  // byte counts and fetch time set. INVALID_ARGUMENT where the sources do not cover the stage's
  // layers once each or a slot is given twice; nothing is written into the stage then.
  absl::Status Import(Assignment& a, const v1::ImportKvRequest& req, v1::ImportKvResponse& resp);
  // ImportKv with no assignment and no sequences: the NCCL links to the sources' workers, made
  // ahead of the imports that will use them (nothing where this worker has no NCCL).
  absl::Status MakeLinks(const v1::ImportKvRequest& req);
  // FetchKv: the blocks of `req` into `sink`, from the stash, or from a step's write-outs
  // (req.stream_step) as the step writes them, over gRPC or over the NCCL link of req.nccl_id.
  // NOT_FOUND naming a sequence the stash does not hold.
  absl::Status Send(const v1::FetchKvRequest& req, const KvChunkSink& sink);
  // DropKv: the stash's and the write-outs' sequences of `keys` (empty: all) freed.
  void Drop(std::span<const uint64_t> keys);

  // Copies the stash's blocks in device memory to host memory (a new stage needs the room);
  // returns how many.
  int SpillToHost();
  // Opens the write-outs of `d`'s rows with kv_out_key set (Stage::OpenKvOut) and puts them in
  // the stash as the step's, replacing what the stash held of their keys or slots; one the stage
  // cannot open is put in failed, so that its fetch fails at once and the hand-off falls back.
  // Called by the steps' executor before it runs `d` on `a` (which it holds for the step).
  void OpenKvOuts(Assignment& a, const StepDescriptor& d);
  // A new assignment `id` is the current one: the write-outs of those before are dropped, and a
  // fetch of one of theirs fails at once.
  void BeginAssignment(uint64_t id);
  // A steps' stream ended: fetches of write-outs by steps not run yet fail at once.
  void EndSteps();

  // The stash's block of sequence `key`; NOT_FOUND naming it otherwise (a step's write-out is
  // fetched by its step: WrittenOut).
  absl::StatusOr<std::shared_ptr<const KvBlock>> Stashed(uint64_t key);
  // The write-out of sequence `key` by `ref`'s step, waiting until `deadline` for the step to
  // open it: FAILED_PRECONDITION at once where it cannot (another assignment, a later step run,
  // the steps' stream ended), DEADLINE_EXCEEDED naming the sequence and the step at the deadline.
  absl::StatusOr<std::shared_ptr<KvOut>> WrittenOut(uint64_t key, WriteOutRef ref,
                                                    absl::Time deadline);

 private:
  // An NCCL link for KV-cache, kept for later moves; used by one move at a time.
  struct HeldKvLink {
    absl::Mutex mu;
    std::string unique_id;  // of a fetch link (a send link's is its key)
    std::unique_ptr<KvLink> link ABSL_GUARDED_BY(mu);
    bool unreachable ABSL_GUARDED_BY(mu) = false;  // a join failed: gRPC from then on
  };
  // A sequence written out by a step as it runs.
  struct WrittenOutKv {
    WriteOutRef by;
    std::shared_ptr<KvOut> out;
  };

  // Puts `blocks` in the stash, replacing what it and the write-outs held of their keys.
  void Stash(std::map<uint64_t, std::shared_ptr<const KvBlock>> blocks);
  // The block of `key` over layers [first_layer, first_layer + num_layers) from this worker's
  // stash, or from `stream`'s write-out (step nonzero) once its layers are written.
  absl::StatusOr<KvBlock> OwnBlock(uint64_t key, int first_layer, int num_layers,
                                   WriteOutRef stream);
  // A block in device memory copied to host memory, for a fetch over gRPC.
  absl::StatusOr<std::shared_ptr<const KvBlock>> OnHost(uint64_t key,
                                                        std::shared_ptr<const KvBlock> block);

  // The blocks of `keys` over layers [first_layer, first_layer + num_layers) from the stash of
  // the worker at `address` (over FetchKv), put together for `a`'s stage. With `stream` (step
  // nonzero), the sequences as that step of the other worker writes them out, each layer
  // fetched as soon as it is written.
  absl::StatusOr<std::vector<KvBlock>> FetchBlocks(const Assignment& a, const std::string& address,
                                                   const std::vector<uint64_t>& keys,
                                                   int first_layer, int num_layers,
                                                   WriteOutRef stream);
  // One FetchKv stream of FetchBlocks, over connection number `connection`.
  absl::StatusOr<std::vector<KvBlock>> FetchGroup(const Assignment& a, const std::string& address,
                                                  const std::vector<uint64_t>& keys,
                                                  int first_layer, int num_layers,
                                                  int connection, WriteOutRef stream);
  // A stub of the worker at `address` for KV-cache fetches, on connection number `connection`.
  std::unique_ptr<v1::Worker::Stub> KvStub(const std::string& address, int connection) const;

  // FetchBlocks over NCCL: the blocks in this worker's device memory, or, when the other worker
  // refused before sending anything (it cannot), nullopt. With no keys, only the link (made
  // where there is none); `a` may then be null.
  absl::StatusOr<std::optional<std::vector<KvBlock>>> FetchOverNccl(
      const Assignment* a, const std::string& address, const std::vector<uint64_t>& keys,
      int first_layer, int num_layers, WriteOutRef stream = {});
  // How FetchOverNccl's receive gives up: `fail` cancels and drains the stream and drops the link
  // (an error of this side or a message out of place); `ended` finishes a stream that ended
  // before all came (`where` says where) and drops the link. Each returns the error to give.
  using FailFn = std::function<absl::Status(const absl::Status&)>;
  using EndedFn = std::function<absl::Status(const std::string& where)>;
  // FetchOverNccl's receive into `blocks` in device memory of every sequence's K and V after
  // their headers (`chunk` holds the first): at once, or layer by layer (`streamed`) as the other
  // worker announces each.
  absl::Status ReceiveOverNccl(HeldKvLink& held, grpc::ClientReader<v1::KvChunk>& reader,
                               v1::KvChunk& chunk, const KvShape& shape,
                               const std::vector<uint64_t>& keys, bool streamed,
                               std::vector<KvBlock>& blocks, const FailFn& fail,
                               const EndedFn& ended) ABSL_EXCLUSIVE_LOCKS_REQUIRED(held.mu);

  // Send's side of FetchOverNccl: the blocks of `req` sent over the link of req.nccl_id.
  absl::Status SendOverNccl(const v1::FetchKvRequest& req, const KvChunkSink& sink);
  // The blocks SendOverNccl sends, all on the GPU, with a step's write-outs in `outs`.
  absl::StatusOr<std::vector<KvBlock>> DeviceBlocks(const v1::FetchKvRequest& req,
                                                    absl::Time deadline,
                                                    std::vector<std::shared_ptr<KvOut>>& outs);
  // The send link of req.nccl_id, new (with no link yet) where req asks to join;
  // FAILED_PRECONDITION where it is unknown and req asks for no join.
  absl::StatusOr<std::shared_ptr<HeldKvLink>> SendLink(const v1::FetchKvRequest& req);
  // Joins `held`'s link as rank 0, after telling the fetching worker to join.
  absl::Status JoinSendLink(HeldKvLink& held, const v1::FetchKvRequest& req,
                            const KvChunkSink& sink) ABSL_EXCLUSIVE_LOCKS_REQUIRED(held.mu);
  // Forgets the send link of `unique_id` (a move on it failed).
  void DropSendLink(HeldKvLink& held, const std::string& unique_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(held.mu);
  // A step's write-outs sent layer by layer over `held`'s link as the step writes them.
  absl::Status SendLayers(const v1::FetchKvRequest& req, const KvChunkSink& sink,
                          HeldKvLink& held, const std::vector<KvBlock>& blocks,
                          const std::vector<std::shared_ptr<KvOut>>& outs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(held.mu);
  // Send over gRPC of a step's write-outs (req.stream_step): each layer's chunks as soon as the
  // layer is written.
  absl::Status SendWrittenOut(const v1::FetchKvRequest& req, const KvChunkSink& sink);

  const KvMoveOptions options_;
  absl::Mutex stash_mu_;
  std::map<uint64_t, std::shared_ptr<const KvBlock>> stash_ ABSL_GUARDED_BY(stash_mu_);
  // Sequences written out by a step as it runs (OpenKvOuts), until Drop, another write-out of
  // the key or slot, or an Export of the key: at most one per slot of the stage.
  std::map<uint64_t, WrittenOutKv> written_out_ ABSL_GUARDED_BY(stash_mu_);
  // The newest step run of the current assignment, and a count of the ends of steps' streams and
  // assignments: a fetch of a write-out gives up once its step has passed or can no longer come.
  uint64_t newest_step_ ABSL_GUARDED_BY(stash_mu_) = 0;
  uint64_t out_assignment_ ABSL_GUARDED_BY(stash_mu_) = 0;  // the current assignment
  uint64_t steps_epoch_ ABSL_GUARDED_BY(stash_mu_) = 0;
  // NCCL links for KV-cache: those this worker sends on, by unique id, and those it fetches on,
  // by the other worker's address.
  absl::Mutex kv_links_mu_;
  std::map<std::string, std::shared_ptr<HeldKvLink>> send_links_ ABSL_GUARDED_BY(kv_links_mu_);
  std::map<std::string, std::shared_ptr<HeldKvLink>> fetch_links_ ABSL_GUARDED_BY(kv_links_mu_);
};

}  // namespace tandem
