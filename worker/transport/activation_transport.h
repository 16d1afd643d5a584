// How a stage's output reaches the next stage of its pipeline. One implementation per data plane:
// gRPC streams between CPU workers (grpc_transport.h), NCCL between GPU workers. Steps run in the
// same order on every stage, so every Send has exactly one matching Recv.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/stage.h"

namespace tandem {

// A posted receive of one step's sampled tokens (ActivationTransport::PostRecvTokens).
struct PostedTokens {
  // True once the tokens are there; never blocks.
  std::function<bool()> arrived;
  // Waits for the tokens (CANCELLED once `cancelled()` returns true, DEADLINE_EXCEEDED when the
  // last stage stays silent), checks their frame (another step or count is DATA_LOSS) and
  // returns them. Called once.
  std::function<absl::StatusOr<std::vector<int32_t>>(const std::function<bool()>& cancelled)> take;
};

// Posted token receives a transport holds at most before the oldest is taken.
inline constexpr int kMaxPostedTokenReceives = 16;

class ActivationTransport {
 public:
  virtual ~ActivationTransport() = default;
  // Sends step `step_id`'s output ([rows, hidden]) to the next stage.
  virtual absl::Status Send(uint64_t step_id, const Activations& activations) = 0;
  // Receives step `step_id`'s input from the previous stage. Blocks until it arrives; CANCELLED
  // once `cancelled()` returns true, DEADLINE_EXCEEDED when the previous stage stays silent.
  virtual absl::StatusOr<Activations> Recv(uint64_t step_id,
                                           const std::function<bool()>& cancelled) = 0;
  // Posts the receive of step `step_id`'s input of `rows` rows (the step's descriptor has them)
  // and may return before it arrives, as activations with `ready` and `arrival` set (stage.h), so
  // that the stage can queue its step behind the transfer instead of waiting for it on the host.
  // By default the blocking Recv (`rows` unused).
  virtual absl::StatusOr<Activations> PostRecv(uint64_t step_id, int64_t rows,
                                               const std::function<bool()>& cancelled) {
    (void)rows;
    return Recv(step_id, cancelled);
  }

  // A pipeline without a coordinator in between (tandem-pipeline-bench): the last stage returns
  // a step's sampled tokens to the first over the same link. By default UNIMPLEMENTED.
  virtual absl::Status SendTokens(uint64_t step_id, const std::vector<int32_t>& tokens) {
    (void)step_id;
    (void)tokens;
    return absl::UnimplementedError("this transport returns no tokens to the first stage");
  }
  // The same from device memory (`count` tokens), queued behind the work that writes them.
  virtual absl::Status SendDeviceTokens(uint64_t step_id, const int32_t* device_tokens,
                                        int64_t count) {
    (void)step_id;
    (void)device_tokens;
    (void)count;
    return absl::UnimplementedError("this transport sends no tokens from device memory");
  }
  // The first stage: step `step_id`'s tokens from the last stage; CANCELLED once `cancelled()`.
  virtual absl::StatusOr<std::vector<int32_t>> RecvTokens(uint64_t step_id,
                                                          const std::function<bool()>& cancelled) {
    (void)step_id;
    (void)cancelled;
    return absl::UnimplementedError("this transport returns no tokens to the first stage");
  }

  // The first stage of a pipeline whose coordinator sends steps ahead of their input tokens: posts
  // the receive of step `step_id`'s `count` sampled tokens from the last stage before they are
  // sent, and returns at once. Receives are posted, and arrive, in step order; at most
  // kMaxPostedTokenReceives may be posted and not yet taken. By default UNIMPLEMENTED.
  virtual absl::StatusOr<PostedTokens> PostRecvTokens(uint64_t step_id, int64_t count) {
    (void)step_id;
    (void)count;
    return absl::UnimplementedError("this transport returns no tokens to the first stage");
  }
  // The first and the last stage of such a pipeline, before the first frame: token frames move
  // apart from the activations, so that a receive posted ahead never holds them back. By default
  // OK (nothing to separate).
  virtual absl::Status SeparateTokens() { return absl::OkStatus(); }

  // Before the first frame, once the stage this transport serves is made: a transport of device
  // activations queues its work on the stage's stream (Stage::DeviceStream) and has the stage's
  // waits watch its sends (Stage::SetStreamWatch), so that a send the next stage never takes ends
  // in an abort at the timeout instead of a wait without end. Returns whether it did, and so
  // whether decode steps may send their output from the device (StepRunnerOptions::device_sends).
  // By default false (a host transport shares nothing with the stage).
  virtual absl::StatusOr<bool> BindStage(Stage& stage) {
    (void)stage;
    return false;
  }
};

}  // namespace tandem
