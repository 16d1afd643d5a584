// absl::Status <-> grpc::Status: the codes are the same numbers (google.rpc.Code), the message
// goes across as it is.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"

namespace tandem {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace tandem
