// Activations over gRPC streams: raw host rows (fp32, fp16 or bf16) in a bytes field.
#include "worker/transport/grpc_transport.h"

#include <cstring>

#include "absl/strings/str_format.h"
#include "common/dtype.h"
#include "worker/transport/activation_frame.h"

namespace tandem {

void ActivationInbox::Reset(uint64_t assignment) {
  absl::MutexLock lock(&mu_);
  assignment_ = assignment;
  steps_.clear();
}

bool ActivationInbox::Put(uint64_t assignment, uint64_t step, Activations activations) {
  absl::MutexLock lock(&mu_);
  if (assignment != assignment_) return false;
  steps_[step] = std::move(activations);
  return true;
}

absl::StatusOr<Activations> ActivationInbox::Take(uint64_t assignment, uint64_t step,
                                                  absl::Duration timeout,
                                                  const std::function<bool()>& cancelled) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  while (true) {
    if (assignment != assignment_) {
      return absl::AbortedError(absl::StrFormat(
          "assignment %d was replaced while step %d waited for its input", assignment, step));
    }
    auto it = steps_.find(step);
    if (it != steps_.end()) {
      Activations a = std::move(it->second);
      steps_.erase(it);
      return a;
    }
    if (cancelled()) {
      return absl::CancelledError(absl::StrFormat("step %d: cancelled", step));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrFormat(
          "step %d: no activations from the previous stage within %s", step,
          absl::FormatDuration(timeout)));
    }
    // Short waits so that cancellation (a predicate outside this mutex) is seen quickly.
    auto arrived = [this, assignment, step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return assignment != assignment_ || steps_.count(step) > 0;
    };
    mu_.AwaitWithTimeout(absl::Condition(&arrived), absl::Milliseconds(20));
  }
}

grpc::Status StageLinkService::Activations(grpc::ServerContext* ctx,
                                           grpc::ServerReader<v1::ActivationsMessage>* reader,
                                           v1::ActivationsAck*) {
  if (grpc::Status a = CheckCaller(*ctx, callers_); !a.ok()) return a;
  v1::ActivationsMessage msg;
  while (reader->Read(&msg)) {
    absl::StatusOr<tandem::Activations> a = DecodeActivations(msg);
    if (!a.ok()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(a.status().message()));
    }
    inbox_.Put(msg.assignment_id(), msg.step_id(), std::move(*a));
  }
  return grpc::Status::OK;
}

GrpcTransport::GrpcTransport(ActivationInbox* inbox, uint64_t assignment,
                             std::string next_address, absl::Duration recv_timeout,
                             ClientAuth auth)
    : inbox_(inbox),
      assignment_(assignment),
      next_address_(std::move(next_address)),
      recv_timeout_(recv_timeout),
      auth_(std::move(auth)) {}

GrpcTransport::~GrpcTransport() {
  if (writer_) {
    // Cancel rather than WritesDone + Finish: the next stage may be gone or stopped.
    context_->TryCancel();
    writer_->Finish();
  }
}

absl::Status GrpcTransport::Send(uint64_t step_id, const Activations& a) {
  if (next_address_.empty()) {
    return absl::FailedPreconditionError("the last stage has no next stage to send to");
  }
  if (a.where != Where::kHost) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "step %d: the gRPC transport carries host activations only; copy device ones to the "
        "host first", step_id));
  }
  if (!writer_) {
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);
    args.SetMaxReceiveMessageSize(-1);
    stub_ = v1::StageLink::NewStub(MakeChannel(next_address_, auth_, args));
    context_ = std::make_unique<grpc::ClientContext>();
    writer_ = stub_->Activations(context_.get(), &ack_);
  }
  if (!writer_->Write(EncodeActivations(assignment_, step_id, a))) {
    return absl::UnavailableError(absl::StrFormat(
        "step %d: cannot send activations to the next stage at %s", step_id, next_address_));
  }
  return absl::OkStatus();
}

absl::StatusOr<Activations> GrpcTransport::Recv(uint64_t step_id,
                                                const std::function<bool()>& cancelled) {
  if (inbox_ == nullptr) {
    return absl::FailedPreconditionError("the first stage has no previous stage to receive from");
  }
  return inbox_->Take(assignment_, step_id, recv_timeout_, cancelled);
}

}  // namespace tandem
