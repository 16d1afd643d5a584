// The CPU data plane: stage i streams its activations to stage i+1 over StageLink.Activations.
// The receiving worker serves StageLinkService, which files messages in an ActivationInbox; its
// step loop takes them out by step id.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/security/credentials.h"
#include "grpcpp/grpcpp.h"
#include "proto/tandem.grpc.pb.h"
#include "worker/transport/activation_transport.h"

namespace tandem {

// Activations that arrived for the current assignment, by step id.
class ActivationInbox {
 public:
  // Forgets everything that is not for `assignment` and accepts only that from now on.
  void Reset(uint64_t assignment);
  // Files one step's activations; false (dropped) when they belong to another assignment.
  bool Put(uint64_t assignment, uint64_t step, Activations activations);
  absl::StatusOr<Activations> Take(uint64_t assignment, uint64_t step, absl::Duration timeout,
                                   const std::function<bool()>& cancelled);

 private:
  absl::Mutex mu_;
  uint64_t assignment_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, Activations> steps_ ABSL_GUARDED_BY(mu_);
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
