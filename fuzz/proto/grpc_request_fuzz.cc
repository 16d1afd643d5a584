// The traits through which gRPC reads a GenerateRequest (proto/grpc_request_traits.h) on any bytes:
// they accept exactly what protobuf's parser accepts, into the same message, and refuse the rest
// with INVALID_ARGUMENT and a message; the UTF-8 walk agrees with an accepted request and never
// fails otherwise than with INVALID_ARGUMENT.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/utf8.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/grpcpp.h"
#include "proto/tandem.grpc.pb.h"
#include "proto/wire_utf8.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static grpc::internal::GrpcLibraryInitializer init;
  google::protobuf::LogSilencer silence;  // the parser logs strings that are not UTF-8
  const std::string wire(reinterpret_cast<const char*>(data), size);
  grpc::Slice slice(wire);
  grpc::ByteBuffer buffer(&slice, 1);
  tandem::v1::GenerateRequest request;
  const grpc::Status s =
      grpc::SerializationTraits<tandem::v1::GenerateRequest>::Deserialize(&buffer, &request);
  tandem::v1::GenerateRequest reference;
  if (s.ok() != reference.ParseFromString(wire)) std::abort();
  if (s.ok()) {
    if (request.SerializeAsString() != reference.SerializeAsString()) std::abort();
    if (!tandem::CheckWireUtf8(*tandem::v1::GenerateRequest::descriptor(), wire).ok()) {
      std::abort();  // protobuf took a string that is not UTF-8, or the walk misread the bytes
    }
    return 0;
  }
  if (s.error_code() != grpc::StatusCode::INVALID_ARGUMENT || s.error_message().empty()) {
    std::abort();
  }
  // Nested paths, on a message that has them.
  const absl::Status nested = tandem::CheckWireUtf8(*tandem::v1::Topology::descriptor(), wire);
  if (!nested.ok() && nested.code() != absl::StatusCode::kInvalidArgument) std::abort();
  return 0;
}
