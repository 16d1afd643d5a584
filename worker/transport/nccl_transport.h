// NCCL between the GPU stage workers of one pipeline: one communicator per pipeline whose ranks are
// the stage indices; stage i sends its hidden states to stage i + 1 (ncclSend/ncclRecv on a stream
// of the transport's own). The ncclUniqueId is made by the first stage's worker and handed to the
// others as bytes (MakeNcclUniqueId / the `unique_id` of NcclTransport::Create).
//
// Every message is a frame: a 64-byte header (step id, rows, cols, dtype) and then the payload, so
// that the receiver learns the size of a step it was not told about. A dead or silent peer never
// hangs a worker: the communicator is non-blocking, every wait polls ncclCommGetAsyncError against
// a deadline, and on an error, a timeout or a cancellation in the middle of a transfer the
// communicator is aborted (ncclCommAbort). Cost: NCCL runs each group of a non-blocking
// communicator on a new host thread, about 0.1 ms per send or receive (docs/performance-pipeline.md). An aborted transport answers every later call with
// FAILED_PRECONDITION; the pipeline is then rebuilt with a new unique id.
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
};

// INVALID_ARGUMENT naming the field when the options cannot describe a pipeline stage.
absl::Status ValidateNcclTransportOptions(const NcclTransportOptions& options);

class NcclTransport : public ActivationTransport {
 public:
  // Joins the pipeline's communicator (every rank calls it with the same id, within `timeout`).
  static absl::StatusOr<std::unique_ptr<NcclTransport>> Create(const NcclTransportOptions& options,
                                                               absl::string_view unique_id);
  ~NcclTransport() override;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  // Every rank but the last. Copies `activations` (host, or device memory whose writes are
  // complete as Stage::Step returns them; the options' dtype and hidden size, at most max_rows
  // rows) into a buffer of its own and returns once the copy is
  // done, so the caller may overwrite its memory (the next Stage::Step) while the transfer waits
  // for the next stage; at most two sends are in flight.
  absl::Status Send(uint64_t step_id, const Activations& activations) override;

  // Every rank but the first. Returns device activations in a buffer of the transport, valid until
  // the second Recv after this one. A header for another step than `step_id` is DATA_LOSS (the
  // pipeline lost a message) and aborts the communicator.
  absl::StatusOr<Activations> Recv(uint64_t step_id,
                                   const std::function<bool()>& cancelled) override;

  // A pipeline without a coordinator in between (benchmarks, tests): the last rank returns the
  // sampled tokens of a step to the first rank. At most max_rows tokens.
  absl::Status SendTokens(uint64_t step_id, const std::vector<int32_t>& tokens);
  absl::StatusOr<std::vector<int32_t>> RecvTokens(uint64_t step_id,
                                                  const std::function<bool()>& cancelled);

  // Aborts the communicator (idempotent); later calls return FAILED_PRECONDITION.
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
