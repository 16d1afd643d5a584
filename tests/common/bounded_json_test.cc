// Tests for common/bounded_json.cc: JSON nested up to the limit parses, one level more is refused
// with the path and the limit named, and text nested 100,000 deep is refused without a crash.
#include "common/bounded_json.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// `levels` arrays inside each other around 1: "[[1]]" for 2.
std::string NestedArrays(int levels) {
  return std::string(levels, '[') + "1" + std::string(levels, ']');
}

TEST(BoundedJsonTest, ParsesTextNestedExactlyAtTheLimit) {
  absl::StatusOr<nlohmann::json> j = ParseBoundedJson(NestedArrays(kMaxJsonDepth), "test.json");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_TRUE(j->is_array());
}

TEST(BoundedJsonTest, RefusesOneLevelPastTheLimitNamingItAndTheLimit) {
  absl::StatusOr<nlohmann::json> j = ParseBoundedJson(NestedArrays(kMaxJsonDepth + 1), "test.json");
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(j.status().message(),
              AllOf(HasSubstr("test.json"), HasSubstr(std::to_string(kMaxJsonDepth))));
}

TEST(BoundedJsonTest, RefusesTextNestedAHundredThousandDeepWithoutCrashing) {
  const std::string deep = "{\"a\":" + NestedArrays(100000) + "}";
  EXPECT_FALSE(ParseBoundedJson(deep, "body").ok());
  EXPECT_FALSE(ParseBoundedOrderedJson(deep, "body").ok());
  std::string nested;
  for (int i = 0; i < 100000; ++i) nested += "{\"k\":";
  nested += "1" + std::string(100000, '}');
  EXPECT_FALSE(CheckJsonDepth(nested, "body").ok());
}

TEST(BoundedJsonTest, PathNamesTheKeysAndIndicesWhereTheTextGoesTooDeep) {
  const std::string text = R"({"model": "m", "tools": [{"a": 1}, {"function": {"parameters": )" +
                           NestedArrays(10) + "}}]}";
  EXPECT_EQ(FirstTooDeepPath(text, 5), "tools[1].function.parameters[0]");
  EXPECT_EQ(FirstTooDeepPath(text, 16), "");
  EXPECT_EQ(FirstTooDeepPath(NestedArrays(3), 1), "[0]");
}

TEST(BoundedJsonTest, LongPathsAreCutAfterTheirFirstComponents) {
  EXPECT_EQ(FirstTooDeepPath(R"({"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": 1}}}}}}}})", 7),
            "a.b.c.d.e.f...");
}

TEST(BoundedJsonTest, MalformedTextIsRefusedAsNotJson) {
  absl::StatusOr<nlohmann::json> j = ParseBoundedJson("{\"a\": [1, 2", "config.json");
  ASSERT_FALSE(j.ok());
  EXPECT_THAT(j.status().message(), HasSubstr("config.json: not valid JSON"));
}

TEST(BoundedJsonTest, OrderedParseKeepsTheKeysInTheirOrder) {
  absl::StatusOr<nlohmann::ordered_json> j = ParseBoundedOrderedJson(R"({"b": 1, "a": 2})", "t");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->begin().key(), "b");
}

}  // namespace
}  // namespace tandem
