// Which string field of a protobuf message in wire format is not UTF-8, and where. protobuf's
// parser refuses a proto3 string that is not UTF-8 without saying which or where; this finds it
// for the error a client gets (proto/grpc_request_traits.h).
#pragma once

#include <string_view>

#include "absl/status/status.h"
#include "google/protobuf/descriptor.h"

namespace tandem {

// Walks `wire`, a message of `type` in protobuf's binary format, in order, into its nested
// messages, and checks each proto3 string field the parser checks with CheckUtf8
// (common/utf8.h). Returns the first failure, INVALID_ARGUMENT naming the field by its path
// ("prompt", "stop[1]", "sampling.name") and the offset of the bad byte inside the field's value;
// OK when every such field is UTF-8, including when `wire` is malformed before one is not (the
// walk stops at the first malformed part).
absl::Status CheckWireUtf8(const google::protobuf::Descriptor& type, std::string_view wire);

}  // namespace tandem
