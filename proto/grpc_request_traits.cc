// gRPC's generic protobuf (de)serialization with an error that names what a request got wrong.
#include "proto/grpc_request_traits.h"

#include <string>

#include <grpcpp/impl/codegen/proto_utils.h>

#include "proto/wire_utf8.h"

namespace tandem {

grpc::Status DeserializeRequest(grpc::ByteBuffer* buffer, google::protobuf::Message* message) {
  if (buffer == nullptr) return grpc::Status(grpc::StatusCode::INTERNAL, "No payload");
  grpc::Status result;
  bool parsed;
  {
    grpc::ProtoBufferReader reader(buffer);
    if (!reader.status().ok()) return reader.status();
    parsed = message->ParseFromZeroCopyStream(&reader);
  }
  if (!parsed) {
    // Only a refused request pays for the copy and the second walk over its bytes.
    std::string wire;
    {
      grpc::ProtoBufferReader reader(buffer);
      const void* data;
      int size;
      while (reader.Next(&data, &size)) wire.append(static_cast<const char*>(data), size);
    }
    const absl::Status utf8 = CheckWireUtf8(*message->GetDescriptor(), wire);
    result = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          utf8.ok() ? "the request is not a well-formed " +
                                          message->GetDescriptor()->full_name() + " message"
                                    : std::string(utf8.message()));
  }
  buffer->Clear();
  return result;
}

grpc::Status SerializeRequest(const google::protobuf::Message& message, grpc::ByteBuffer* buffer,
                              bool* own_buffer) {
  return grpc::GenericSerialize<grpc::ProtoBufferWriter, google::protobuf::Message>(
      message, buffer, own_buffer);
}

}  // namespace tandem
