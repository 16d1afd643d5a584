// The CPU data plane: stage i streams its activations to stage i+1 over StageLink.Activations.
// The receiving worker serves StageLinkService, which files messages in an ActivationInbox; its
// step loop takes them out by step id.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/security/credentials.h"
#include "grpcpp/grpcpp.h"
#include "proto/tandem.grpc.pb.h"
#include "worker/transport/activation_transport.h"

namespace tandem {

// The largest StageLink message a worker receives or sends: one step's activations, at most
// kMaxStageMessageBytes - kStageMessageHeadroom bytes of rows (AssignStage refuses assignments
// whose largest step would not fit), plus the message's other fields.
inline constexpr int64_t kMaxStageMessageBytes = int64_t{1} << 30;
inline constexpr int64_t kStageMessageHeadroom = int64_t{1} << 16;

// The wire bytes of a step of `rows` x `cols` activations sent as fp32 (the widest), headroom
// included; nullopt when the product overflows.
std::optional<int64_t> StageMessageBytes(int64_t rows, int64_t cols);

// Activations that arrived for the current assignment, by step id, bounded in entries and bytes.
// Steps run in the order of their ids, so Take(step) drops every earlier step still held (those
// steps failed or were cancelled and will not run here) and later messages for them. A Put that
// finds the inbox full waits for the step loop to take something, which holds back the sending
// stage through its stream; when nothing is taken within put_timeout it is refused.
class ActivationInbox {
 public:
  struct Limits {
    int entries = 64;                       // steps held at once
    int64_t bytes = kMaxStageMessageBytes;  // their activations' bytes
    absl::Duration put_timeout = absl::Seconds(60);
  };
  ActivationInbox() : ActivationInbox(Limits{}) {}
  explicit ActivationInbox(Limits limits) : limits_(limits) {}

  // Forgets everything that is not for `assignment` and accepts only that from now on.
  void Reset(uint64_t assignment);
  // Files one step's activations. OK also when they are dropped (another assignment, or a step
  // already passed); RESOURCE_EXHAUSTED naming the limits when no room comes within put_timeout;
  // CANCELLED when `cancelled` turns true while waiting. An empty inbox takes any one message.
  absl::Status Put(
      uint64_t assignment, uint64_t step, Activations activations,
      const std::function<bool()>& cancelled = [] { return false; });
  absl::StatusOr<Activations> Take(uint64_t assignment, uint64_t step, absl::Duration timeout,
                                   const std::function<bool()>& cancelled);
  // What is held now: steps and bytes.
  size_t entries();
  int64_t bytes();

 private:
  bool HasRoomLocked(int64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops held steps before `step`; later messages for them are dropped on arrival.
  void PassLocked(uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Limits limits_;
  absl::Mutex mu_;
  uint64_t assignment_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t first_wanted_ ABSL_GUARDED_BY(mu_) = 0;  // steps before it will not be taken
  std::map<uint64_t, Activations> steps_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

class StageLinkService final : public v1::StageLink::Service {
 public:
  // `callers`: who may send activations (the cluster secret); default: anyone.
  explicit StageLinkService(ActivationInbox& inbox, CallerPolicy callers = {})
      : inbox_(inbox), callers_(std::move(callers)) {}
  grpc::Status Activations(grpc::ServerContext* ctx,
                           grpc::ServerReader<v1::ActivationsMessage>* reader,
                           v1::ActivationsAck* ack) override;

 private:
  ActivationInbox& inbox_;
  const CallerPolicy callers_;
};

class GrpcTransport final : public ActivationTransport {
 public:
  // `inbox` feeds Recv (null on the first stage); `next_address` is the next stage's worker
  // (empty on the last stage). `recv_timeout` bounds how long Recv waits for a silent neighbour.
  // `auth`: TLS and the cluster secret for the next stage's StageLink.
  GrpcTransport(ActivationInbox* inbox, uint64_t assignment, std::string next_address,
                absl::Duration recv_timeout, ClientAuth auth = {});
  ~GrpcTransport() override;

  absl::Status Send(uint64_t step_id, const Activations& activations) override;
  absl::StatusOr<Activations> Recv(uint64_t step_id,
                                   const std::function<bool()>& cancelled) override;

 private:
  ActivationInbox* const inbox_;
  const uint64_t assignment_;
  const std::string next_address_;
  const absl::Duration recv_timeout_;
  const ClientAuth auth_;
  // The stream to the next stage, opened on the first Send. Only the step loop sends.
  std::unique_ptr<v1::StageLink::Stub> stub_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientWriter<v1::ActivationsMessage>> writer_;
  v1::ActivationsAck ack_;
};

}  // namespace tandem
