// Activations over gRPC streams: raw host rows (fp32, fp16 or bf16) in a bytes field.
#include "worker/transport/grpc_transport.h"

#include <cstring>

#include "absl/strings/str_format.h"
#include "common/checked_math.h"
#include "common/dtype.h"
#include "proto/grpc_status.h"
#include "worker/transport/activation_frame.h"

namespace tandem {

std::optional<int64_t> StageMessageBytes(int64_t rows, int64_t cols) {
  const std::optional<int64_t> data = CheckedProduct({rows, cols, sizeof(float)});
  if (!data) return std::nullopt;
  return CheckedSum({*data, kStageMessageHeadroom});
}

void ActivationInbox::Reset(uint64_t assignment) {
  absl::MutexLock lock(&mu_);
  assignment_ = assignment;
  first_wanted_ = 0;
  steps_.clear();
  bytes_ = 0;
}

bool ActivationInbox::HasRoomLocked(int64_t bytes) const {
  if (steps_.empty()) return true;
  return static_cast<int>(steps_.size()) < limits_.entries && bytes_ + bytes <= limits_.bytes;
}

void ActivationInbox::PassLocked(uint64_t step) {
  first_wanted_ = std::max(first_wanted_, step);
  for (auto it = steps_.begin(); it != steps_.end() && it->first < first_wanted_;) {
    bytes_ -= static_cast<int64_t>(it->second.nbytes());
    it = steps_.erase(it);
  }
}

absl::Status ActivationInbox::Put(uint64_t assignment, uint64_t step, Activations activations,
                                  const std::function<bool()>& cancelled) {
  const int64_t bytes = static_cast<int64_t>(activations.nbytes());
  const absl::Time deadline = absl::Now() + limits_.put_timeout;
  absl::MutexLock lock(&mu_);
  while (true) {
    if (assignment != assignment_ || step < first_wanted_) return absl::OkStatus();  // dropped
    if (HasRoomLocked(bytes)) break;
    if (cancelled()) return absl::CancelledError(absl::StrFormat("step %d: cancelled", step));
    if (absl::Now() >= deadline) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "step %d: the StageLink inbox stayed full for %s (%d steps, %d bytes held; limits %d "
          "steps, %d bytes): the stage takes no input",
          step, absl::FormatDuration(limits_.put_timeout), steps_.size(), bytes_, limits_.entries,
          limits_.bytes));
    }
    auto room = [this, assignment, bytes]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return assignment != assignment_ || HasRoomLocked(bytes);
    };
    mu_.AwaitWithTimeout(absl::Condition(&room), absl::Milliseconds(20));
  }
  auto [it, added] = steps_.try_emplace(step);
  if (!added) bytes_ -= static_cast<int64_t>(it->second.nbytes());
  it->second = std::move(activations);
  bytes_ += bytes;
  return absl::OkStatus();
}

size_t ActivationInbox::entries() {
  absl::MutexLock lock(&mu_);
  return steps_.size();
}

int64_t ActivationInbox::bytes() {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

absl::StatusOr<Activations> ActivationInbox::Take(uint64_t assignment, uint64_t step,
                                                  absl::Duration timeout,
                                                  const std::function<bool()>& cancelled) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  if (assignment == assignment_) PassLocked(step);
  while (true) {
    if (assignment != assignment_) {
      return absl::AbortedError(absl::StrFormat(
          "assignment %d was replaced while step %d waited for its input", assignment, step));
    }
    auto it = steps_.find(step);
    if (it != steps_.end()) {
      Activations a = std::move(it->second);
      bytes_ -= static_cast<int64_t>(a.nbytes());
      steps_.erase(it);
      PassLocked(step + 1);
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
    const absl::Status put = inbox_.Put(msg.assignment_id(), msg.step_id(), std::move(*a),
                                        [ctx] { return ctx->IsCancelled(); });
    if (!put.ok()) {
      return ToGrpcStatus(put);
    }
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
    args.SetMaxSendMessageSize(static_cast<int>(kMaxStageMessageBytes));
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
