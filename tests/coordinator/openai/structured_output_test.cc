// The fields that constrain the output: what each becomes and each refusal's field.
#include "coordinator/openai/structured_output.h"

#include <string>

#include "coordinator/openai/api_error.h"
#include "coordinator/openai/request_parsing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::openai {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::ordered_json;

v1::OutputConstraint Parse(const std::string& body) {
  v1::OutputConstraint c;
  absl::Status s = ParseOutputConstraint(json::parse(body), c);
  EXPECT_TRUE(s.ok()) << s;
  return c;
}

TEST(ParseOutputConstraint, ResponseFormatJsonObjectAndSchema) {
  EXPECT_TRUE(Parse(R"({"response_format": {"type": "json_object"}})").json_object());
  const v1::OutputConstraint c = Parse(
      R"({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": true,
          "schema": {"type": "object", "properties": {"b": {"type": "string"}, "a": {}}}}}})");
  // The schema's text keeps the client's property order (it is the output's order).
  EXPECT_EQ(c.json_schema(),
            R"({"type":"object","properties":{"b":{"type":"string"},"a":{}}})");
  EXPECT_EQ(Parse(R"({"response_format": {"type": "text"}})").kind_case(),
            v1::OutputConstraint::KIND_NOT_SET);
  EXPECT_EQ(Parse(R"({})").kind_case(), v1::OutputConstraint::KIND_NOT_SET);
}

TEST(ParseOutputConstraint, VllmGuidedFieldsAndStructuredOutputs) {
  EXPECT_EQ(Parse(R"({"guided_json": {"type": "integer"}})").json_schema(), R"({"type":"integer"})");
  EXPECT_EQ(Parse(R"({"guided_regex": "[a-z]+"})").regex(), "[a-z]+");
  EXPECT_EQ(Parse(R"({"guided_choice": ["x", "y"]})").choice().options_size(), 2);
  EXPECT_EQ(Parse(R"({"structured_outputs": {"regex": "a|b"}})").regex(), "a|b");
  EXPECT_EQ(Parse(R"({"structured_outputs": {"choice": ["x"]}})").choice().options(0), "x");
  EXPECT_EQ(Parse(R"({"structured_outputs": {"json": "{\"type\": \"null\"}"}})").json_schema(),
            R"({"type": "null"})");
}

struct Refusal {
  std::string body;
  std::string param;
  std::string words;  // the message names this
};

const Refusal kRefusals[] = {
    {R"({"response_format": "json"})", "response_format", "object"},
    {R"({"response_format": {"type": "yaml"}})", "response_format.type", "yaml"},
    {R"({"response_format": {"type": "json_schema"}})", "response_format.json_schema", "schema"},
    {R"({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
        "schema": {"type": "object", "properties": {"n": {"type": "number", "minimum": 0}}}}}})",
     "response_format.json_schema.schema", "'minimum'"},
    {R"({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "tuple"}}}})",
     "response_format.json_schema.schema", "tuple"},
    {R"({"guided_json": 3})", "guided_json", "JSON Schema"},
    {R"({"guided_json": "{not json"})", "guided_json", "not valid JSON"},
    {R"({"guided_regex": "(a"})", "guided_regex", "')'"},
    {R"({"guided_regex": 5})", "guided_regex", "string"},
    {R"({"guided_choice": []})", "guided_choice", "non-empty"},
    {R"({"guided_choice": ["a", 1]})", "guided_choice[1]", "string"},
    {R"({"structured_outputs": {"grammar": "root ::= x"}})", "structured_outputs.grammar",
     "not supported"},
    {R"({"guided_regex": "a", "guided_choice": ["a"]})", "response_format", "at most one"},
};

TEST(ParseOutputConstraint, RefusesEachInvalidFieldNamingIt) {
  for (const Refusal& r : kRefusals) {
    SCOPED_TRACE(r.body);
    v1::OutputConstraint c;
    absl::Status s = ParseOutputConstraint(json::parse(r.body), c);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(HttpStatusOf(s), 400);
    EXPECT_EQ(ParamOf(s), r.param);
    EXPECT_THAT(std::string(s.message()), HasSubstr(r.words));
  }
}

TEST(ParseOutputConstraint, ChatAndCompletionRequestsCarryTheConstraint) {
  auto chat = ParseChatRequest(
      R"({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}})");
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_TRUE(chat->generation.constraint().json_object());
  auto completion = ParseCompletionRequest(R"({"prompt": "a", "guided_choice": ["y", "n"]})");
  ASSERT_TRUE(completion.ok()) << completion.status();
  EXPECT_EQ(completion->generation.constraint().choice().options_size(), 2);
}

}  // namespace
}  // namespace tandem::openai
