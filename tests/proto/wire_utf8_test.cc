// CheckWireUtf8 (proto/wire_utf8.h) over requests written byte by byte: it names the field, its
// index or path, and the offset of the bad byte inside the field, and passes over what the parser
// does not check.
#include "proto/wire_utf8.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/tandem.pb.h"
#include "tests/proto/wire_test_util.h"

namespace tandem::testing {
namespace {

using ::testing::HasSubstr;

const google::protobuf::Descriptor& Request() { return *v1::GenerateRequest::descriptor(); }

TEST(CheckWireUtf8, AcceptsARequestWhoseStringsAreUtf8) {
  const std::string wire = Field(1, "caf\xC3\xA9") + Field(6, "\xE2\x82\xAC") + Field(9, "id-1");
  v1::GenerateRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire));
  EXPECT_TRUE(CheckWireUtf8(Request(), wire).ok());
}

// Numbers before the prompt (a varint, packed token ids, a nested message) are stepped over.
TEST(CheckWireUtf8, NamesThePromptAndTheOffsetInsideIt) {
  const std::string sampling = VarintField(2, 40) + VarintField(9, 2);
  const std::string wire = VarintField(4, 300) + Field(2, Varint(1) + Varint(70000)) +
                           Field(3, sampling) + Field(1, "0123456789abcdef\xC3\xA9\xFF tail");
  v1::GenerateRequest parsed;
  ASSERT_FALSE(parsed.ParseFromString(wire));
  const absl::Status s = CheckWireUtf8(Request(), wire);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "prompt: not valid UTF-8: byte 18 (0xFF) does not begin a well-formed character");
}

TEST(CheckWireUtf8, NamesTheIndexOfARepeatedString) {
  const std::string wire =
      Field(1, "Hello") + Field(6, "ok") + Field(9, "r") + Field(6, "ab\xE2\x82");
  const absl::Status s = CheckWireUtf8(Request(), wire);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("stop[1]: not valid UTF-8: byte 2 (0xE2)"));
  EXPECT_THAT(std::string(CheckWireUtf8(Request(), Field(9, "\x80")).message()),
              HasSubstr("request_id: not valid UTF-8: byte 0 (0x80)"));
}

// Topology -> pipelines (repeated PipelineInfo) -> stages (repeated StagePlacement).
TEST(CheckWireUtf8, NamesTheFieldPathInsideNestedMessages) {
  const std::string good_stage = Field(3, "127.0.0.1:1");
  const std::string bad_stage = VarintField(1, 1) + Field(3, "host\xC0\x80");
  const std::string wire = Field(3, Field(2, good_stage)) + Field(5, "why") +
                           Field(3, Field(2, bad_stage) + Field(2, good_stage));
  const absl::Status s = CheckWireUtf8(*v1::Topology::descriptor(), wire);
  EXPECT_THAT(s.message(),
              HasSubstr("pipelines[1].stages[0].worker_address: not valid UTF-8: byte 4 (0xC0)"));
}

// The parser keeps a field it does not know as bytes, unchecked; and a bytes-typed or
// wrongly-typed field is not a string.
TEST(CheckWireUtf8, PassesOverWhatTheParserDoesNotCheck) {
  EXPECT_TRUE(CheckWireUtf8(Request(), Field(99, "\xFF")).ok());
  EXPECT_TRUE(CheckWireUtf8(Request(), VarintField(1, 0xFF)).ok());
}

TEST(CheckWireUtf8, StopsAtMalformedBytesWithoutAnError) {
  // A length past the end, a truncated varint, a tag of field 0.
  EXPECT_TRUE(CheckWireUtf8(Request(), Varint(1 << 3 | 2) + Varint(50) + "\xFF").ok());
  EXPECT_TRUE(CheckWireUtf8(Request(), std::string("\x20\xFF", 2)).ok());
  EXPECT_TRUE(CheckWireUtf8(Request(), std::string("\x02\x01\xFF", 3)).ok());
}

}  // namespace
}  // namespace tandem::testing
