// The traits through which generated gRPC code reads a GenerateRequest (proto/grpc_request_traits.h):
// seen through tandem.grpc.pb.h alone, they parse what gRPC's own traits parse and refuse the rest
// with INVALID_ARGUMENT and a message that says why.
#include <type_traits>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/tandem.grpc.pb.h"
#include "tests/proto/wire_test_util.h"

namespace tandem::testing {
namespace {

using ::testing::HasSubstr;
using Traits = grpc::SerializationTraits<v1::GenerateRequest>;

// The generated code gets these traits, not gRPC's generic ones (whose Deserialize takes a
// MessageLite*).
static_assert(std::is_same_v<decltype(&Traits::Deserialize),
                             grpc::Status (*)(grpc::ByteBuffer*, v1::GenerateRequest*)>);

// Generate's handler, as the generated code names it (with MessageLite as the request's base),
// reads through those traits too.
static_assert(std::is_base_of_v<
              grpc::internal::RpcMethodHandler<v1::Inference::Service, v1::GenerateRequest,
                                               v1::GenerateResponse, v1::GenerateRequest,
                                               v1::GenerateResponse>,
              grpc::internal::RpcMethodHandler<v1::Inference::Service, v1::GenerateRequest,
                                               v1::GenerateResponse, grpc::protobuf::MessageLite,
                                               grpc::protobuf::MessageLite>>);

grpc::Status Deserialize(const std::string& wire, v1::GenerateRequest& out) {
  grpc::Slice slice(wire);
  grpc::ByteBuffer buffer(&slice, 1);
  return Traits::Deserialize(&buffer, &out);
}

class GrpcRequestTraitsTest : public ::testing::Test {
  // Sets up gRPC's library for ByteBuffer.
  grpc::internal::GrpcLibraryInitializer init_;
};

TEST_F(GrpcRequestTraitsTest, RoundTripsAWellFormedRequest) {
  v1::GenerateRequest req;
  req.set_prompt("caf\xC3\xA9");
  req.add_stop("\xE2\x82\xAC");
  req.set_max_new_tokens(3);
  grpc::ByteBuffer buffer;
  bool own = false;
  ASSERT_TRUE(Traits::Serialize(req, &buffer, &own).ok());
  v1::GenerateRequest back;
  const grpc::Status s = Traits::Deserialize(&buffer, &back);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(back.SerializeAsString(), req.SerializeAsString());
}

TEST_F(GrpcRequestTraitsTest, InvalidUtf8IsInvalidArgumentNamingFieldAndOffset) {
  v1::GenerateRequest out;
  grpc::Status s = Deserialize(Field(1, "Hello") + Field(6, "a\xFF"), out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(),
            "stop[0]: not valid UTF-8: byte 1 (0xFF) does not begin a well-formed character");
  s = Deserialize(Field(1, "0123456789abcdefg\xED\xA0\x80"), out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("prompt: not valid UTF-8: byte 17 (0xED)"));
}

TEST_F(GrpcRequestTraitsTest, MalformedBytesAreInvalidArgumentNamingTheMessage) {
  v1::GenerateRequest out;
  const grpc::Status s = Deserialize(Varint(1 << 3 | 2) + Varint(50) + "short", out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "the request is not a well-formed tandem.v1.GenerateRequest message");
}

}  // namespace
}  // namespace tandem::testing
