// How gRPC reads a GenerateRequest (Inference's Generate and GenerateStream) off the wire.
// Included by the generated tandem.grpc.pb.h (proto/CMakeLists.txt: grpc_cpp_plugin's
// additional_header_includes), so that the generated service and stub code sees these
// specializations before it uses gRPC's generic protobuf ones. The other requests keep gRPC's;
// Admin's have no strings, and the internal services' come from the cluster's own processes.
//
// gRPC's own traits answer a request that does not parse with INTERNAL and an empty message; the
// usual cause is a client's text field that is not UTF-8, which protobuf refuses for proto3
// strings. These answer INVALID_ARGUMENT naming the field and the offset of the first bad byte
// ("prompt: not valid UTF-8: byte 17 (0xFF) ..."), or saying that the message is malformed.
#pragma once

#include <grpcpp/impl/codegen/serialization_traits.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/method_handler.h>
#include <grpcpp/support/status.h>

#include "proto/tandem.pb.h"

namespace tandem {

// Parses `buffer` into `message` as gRPC's generic traits do; a failure is INVALID_ARGUMENT with
// CheckWireUtf8's error (proto/wire_utf8.h), or naming the message type when every string is
// UTF-8 and the bytes are malformed otherwise.
grpc::Status DeserializeRequest(grpc::ByteBuffer* buffer, google::protobuf::Message* message);

// gRPC's generic serialization (requests sent by tandem's own clients).
grpc::Status SerializeRequest(const google::protobuf::Message& message, grpc::ByteBuffer* buffer,
                              bool* own_buffer);

}  // namespace tandem

namespace grpc {

// GenerateStream, and Generate through the handler below.
template <>
class SerializationTraits<tandem::v1::GenerateRequest, void> {
 public:
  static Status Serialize(const tandem::v1::GenerateRequest& message, ByteBuffer* buffer,
                          bool* own_buffer) {
    return tandem::SerializeRequest(message, buffer, own_buffer);
  }
  static Status Deserialize(ByteBuffer* buffer, tandem::v1::GenerateRequest* message) {
    return tandem::DeserializeRequest(buffer, message);
  }
};

namespace internal {

// Generate. The generated code reads a unary request through the traits of MessageLite, its
// base, which are gRPC's generic ones whatever the request; this handler is the one the generated
// code names for Generate, and reads through GenerateRequest's own traits above instead.
template <class ServiceType>
class RpcMethodHandler<ServiceType, tandem::v1::GenerateRequest, tandem::v1::GenerateResponse,
                       google::protobuf::MessageLite, google::protobuf::MessageLite>
    : public RpcMethodHandler<ServiceType, tandem::v1::GenerateRequest,
                              tandem::v1::GenerateResponse> {
 public:
  using RpcMethodHandler<ServiceType, tandem::v1::GenerateRequest,
                         tandem::v1::GenerateResponse>::RpcMethodHandler;
};

}  // namespace internal
}  // namespace grpc
