// NCCL between the GPU stage workers of one pipeline: communicators whose ranks are the stage
// indices; stage i sends its hidden states to stage i + 1 (ncclSend/ncclRecv on a stream of the
// transport's own). The ncclUniqueId is made by the first stage's worker and handed to the others
// as bytes (MakeNcclUniqueId / the `unique_id` of NcclTransport::Create).
//
// Three communicators. The root one is non-blocking (ncclConfig_t.blocking = 0), so that joining,
// which waits for every stage, ends at the timeout in ncclCommAbort. Over it rank 0 broadcasts two
// more unique ids: every rank joins a blocking data communicator with the first and connects it
// to its neighbours while all are present (bounded by the timeout), and the first and last rank
// join a blocking token communicator of the two with the second. Frames move on the data
// communicator: each send or receive there just enqueues a kernel, where a non-blocking
// communicator starts a host thread per NCCL group (about 0.1 ms; docs/performance-pipeline.md).
// Token frames (the last stage's sampled tokens, back to the first) move there too, behind the
// activations, or on the token communicator after SeparateTokens, received on a stream of their
// own, so that a receive posted ahead never holds back the activations.
//
// Every message is a frame: a 256-byte header region (step id, rows, cols, dtype in its first 64
// bytes) and the payload right behind it, so that the receiver learns the size of a step it was
// not told about. A frame's first NCCL message has a fixed size (header region + 64 KiB of
// activations or 4 KiB of tokens) and holds all of a decode step's payload; only a larger frame
// (a prefill) sends the rest as a second message, which the receiver posts once it has read the
// header. A stage that knows its step's rows beforehand (from the step's descriptor) posts the
// whole receive at once (PostRecv) and queues its step on the device behind it, so that the step
// starts when its input lands, without a round trip through the host. A dead or silent peer never
// hangs a worker: every wait polls a CUDA event and the
// communicators' async errors against a deadline, and on an error, a timeout or a cancellation in
// the middle of a transfer every communicator is aborted (ncclCommAbort). An aborted transport
// answers every later call with FAILED_PRECONDITION; the pipeline is then rebuilt with a new
// unique id.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "worker/stage.h"
#include "worker/transport/activation_transport.h"

namespace tandem {

// Size of a serialized ncclUniqueId (NCCL_UNIQUE_ID_BYTES).
inline constexpr size_t kNcclUniqueIdBytes = 128;

// A new ncclUniqueId as kNcclUniqueIdBytes raw bytes. The calling process hosts the bootstrap
// root of the communicator, so the first stage's worker calls it and lives as long as the pipeline.
absl::StatusOr<std::string> MakeNcclUniqueId();

// INVALID_ARGUMENT unless `bytes` holds exactly kNcclUniqueIdBytes bytes.
absl::Status ValidateNcclUniqueId(absl::string_view bytes);

struct NcclTransportOptions {
  int device = 0;             // CUDA device of this stage
  int rank = 0;               // this stage's index in the pipeline
  int world = 1;              // stages in the pipeline
  int hidden_size = 0;        // cols of every activation frame
  DType dtype = DType::kF16;  // of every activation frame (the stages' dtype)
  int64_t max_rows = 0;       // rows of the largest step (prefill tokens): receive buffers' size
  absl::Duration timeout = absl::Seconds(60);  // for joining and for each wait on the peer
  // A cudaStream_t of `device` on which every copy and NCCL operation of the transport is queued,
  // in issue order: the stream of the stage it serves (Stage::DeviceStream), so that the process
  // launches no kernel on a stream other than its stage's (docs/performance-pipeline.md: kernels
  // on a second stream slow cuBLAS's GEMMs by ~3% on Hopper). Null: two streams of its own (NCCL
  // operations on one, staging copies on the other).
  void* stream = nullptr;
};

// INVALID_ARGUMENT naming the field when the options cannot describe a pipeline stage.
absl::Status ValidateNcclTransportOptions(const NcclTransportOptions& options);

class NcclTransport : public ActivationTransport {
 public:
  // Joins the pipeline's communicators (every rank calls it with the same id, within `timeout`;
  // joining takes up to two timeouts: the root communicator, then the data communicator).
  static absl::StatusOr<std::unique_ptr<NcclTransport>> Create(const NcclTransportOptions& options,
                                                               absl::string_view unique_id);
  ~NcclTransport() override;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  // Every rank but the last. Copies `activations` (host, or device memory whose writes are
  // complete as Stage::Step returns them, or queued on `stream` when the options give one; the
  // options' dtype and hidden size, at most max_rows rows) into a buffer of its own and returns
  // once the copy is done (device memory on a shared stream: once it is queued, as work queued
  // behind it runs after it), so the caller may overwrite its memory (the next Stage::Step) while
  // the transfer waits for the next stage; at most two sends are in flight.
  absl::Status Send(uint64_t step_id, const Activations& activations) override;

  // Every rank but the first. Returns device activations in a buffer of the transport, valid until
  // the second Recv after this one. A header for another step than `step_id` is DATA_LOSS (the
  // pipeline lost a message) and aborts the communicator.
  absl::StatusOr<Activations> Recv(uint64_t step_id,
                                   const std::function<bool()>& cancelled) override;

  // Every rank but the first: posts the receive of step `step_id`'s activations of `rows` rows
  // and returns at once, with `ready` (completes when they are in the buffer) and `arrival` (waits
  // for them on the host like Recv, then checks the header: another step, shape or row count is
  // DATA_LOSS; a silent peer DEADLINE_EXCEEDED; both abort, after which `ready` completes). The
  // buffer is valid until the second receive after this one; `arrival` as long as the transport.
  absl::StatusOr<Activations> PostRecv(uint64_t step_id, int64_t rows,
                                       const std::function<bool()>& cancelled) override;

  // A pipeline without a coordinator in between (benchmarks, tests): the last rank returns the
  // sampled tokens of a step to the first rank. At most max_rows tokens.
  absl::Status SendTokens(uint64_t step_id, const std::vector<int32_t>& tokens) override;
  // The same from device memory (a stage's sampled tokens), copied on the device: at once
  // usable from a DecodeTail (worker/cuda/cuda_stage.h) when the transport shares the stage's
  // stream; otherwise the tokens' writes must be complete.
  absl::Status SendDeviceTokens(uint64_t step_id, const int32_t* device_tokens,
                                int64_t count) override;
  absl::StatusOr<std::vector<int32_t>> RecvTokens(uint64_t step_id,
                                                  const std::function<bool()>& cancelled) override;
  // The first rank, once token frames move apart: posts the receive of step `step_id`'s `count`
  // tokens on the token communicator, on a stream of its own, and returns at once
  // (ActivationTransport::PostRecvTokens); the frame's header is checked when it is taken.
  absl::StatusOr<PostedTokens> PostRecvTokens(uint64_t step_id, int64_t count) override;
  // Token frames move on the token communicator from now on (before the first frame; on the
  // first and the last rank alike; a no-op on the ranks between), for PostRecvTokens; RecvTokens
  // is then refused. Otherwise they move on the data communicator behind the activations, which
  // suits a first rank that waits for each step's tokens before it runs the next step.
  absl::Status SeparateTokens() override;

  // Moves every later copy and NCCL operation onto `stream` (a cudaStream_t of the options'
  // device, which must outlive the transport), as NcclTransportOptions::stream does for a
  // transport made before its stage. FAILED_PRECONDITION once a frame has moved.
  absl::Status UseStream(void* stream);
  // UseStream on the stage's stream, and the stage's waits watch this transport (Watch). One
  // stream per worker: kernels on a second stream slow cuBLAS's GEMMs by ~3% on Hopper
  // (docs/performance-pipeline.md). Returns true.
  absl::StatusOr<bool> BindStage(Stage& stage) override;

  // For a stage waiting on a stream it shares with this transport: OK while every queued send
  // has completed or is younger than the timeout and the communicators report no error;
  // otherwise aborts every communicator (which ends the transport's kernels, so that the stream
  // drains) and returns why: DEADLINE_EXCEEDED for a send the next stage never took.
  absl::Status Watch();

  // Aborts every communicator (idempotent); later calls return FAILED_PRECONDITION.
  void Abort(const absl::Status& reason);
  bool aborted() const;
  int rank() const;
  int world() const;

  struct State;  // NCCL and CUDA resources, defined in nccl_transport.cc

 private:
  explicit NcclTransport(std::unique_ptr<State> state);
  std::unique_ptr<State> s_;
};

}  // namespace tandem
