// A walk over protobuf's wire format guided by the message's descriptor: tags, lengths and the
// proto3 string fields in them.
#include "proto/wire_utf8.h"

#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace tandem {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::FileDescriptor;
using google::protobuf::internal::WireFormatLite;

// protobuf's own bound on nesting; deeper input does not parse anyway.
constexpr int kMaxDepth = 100;

// The strings that protobuf's parser refuses when they are not UTF-8.
bool ParserChecksUtf8(const FieldDescriptor& field) {
  return field.type() == FieldDescriptor::TYPE_STRING &&
         field.file()->syntax() == FileDescriptor::SYNTAX_PROTO3;
}

absl::Status Walk(const Descriptor& type, std::string_view wire, const std::string& prefix,
                  int depth) {
  if (depth > kMaxDepth) return absl::OkStatus();
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(wire.data()),
                                            static_cast<int>(wire.size()));
  std::map<int, int> seen;  // field number -> values of it so far, to index repeated fields
  while (const uint32_t tag = in.ReadTag()) {
    const FieldDescriptor* field = type.FindFieldByNumber(WireFormatLite::GetTagFieldNumber(tag));
    const bool walked =
        field != nullptr &&
        WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED &&
        (ParserChecksUtf8(*field) || field->type() == FieldDescriptor::TYPE_MESSAGE);
    if (!walked) {
      if (!WireFormatLite::SkipField(&in, tag)) return absl::OkStatus();
      continue;
    }
    uint32_t length;
    if (!in.ReadVarint32(&length)) return absl::OkStatus();
    const size_t at = static_cast<size_t>(in.CurrentPosition());
    if (length > wire.size() - at) return absl::OkStatus();
    const std::string_view value = wire.substr(at, length);
    in.Skip(static_cast<int>(length));
    std::string name = prefix + field->name();
    if (field->is_repeated()) absl::StrAppend(&name, "[", seen[field->number()]++, "]");
    if (field->type() == FieldDescriptor::TYPE_MESSAGE) {
      const absl::Status nested = Walk(*field->message_type(), value, name + ".", depth + 1);
      if (!nested.ok()) return nested;
    } else if (absl::Status s = CheckUtf8(name, value); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckWireUtf8(const Descriptor& type, std::string_view wire) {
  return Walk(type, wire, "", 0);
}

}  // namespace tandem
