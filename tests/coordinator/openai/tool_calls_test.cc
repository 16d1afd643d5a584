// The tool-call formats, tool definitions and tool_choice (coordinator/openai/tool_calls.cc).
#include "coordinator/openai/tool_calls.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "coordinator/openai/api_error.h"

namespace tandem::openai {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

struct Call {
  std::string name;
  json arguments;
  bool operator==(const Call&) const = default;
};

std::vector<Call> CallsOf(const std::vector<ToolCall>& calls) {
  std::vector<Call> out;
  for (const ToolCall& c : calls) out.push_back({c.name, json::parse(c.arguments)});
  return out;
}

TEST(ParseToolCalls, ReadsSeveralHermesBlocksAfterText) {
  const ParsedReply r = ParseToolCalls(
      ToolCallFormat::kHermes,
      "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"
      "\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>");
  EXPECT_EQ(r.content, "Let me look.\n");
  EXPECT_THAT(CallsOf(r.calls), testing::ElementsAre(Call{"get_weather", {{"city", "Oslo"}}},
                                                     Call{"get_time", json::object()}));
  EXPECT_NE(r.calls[0].id, r.calls[1].id);
  EXPECT_TRUE(r.calls[0].id.starts_with("call_"));
}

TEST(ParseToolCalls, ReadsLlamaCallsWithOrWithoutTheTagSeparatedBySemicolons) {
  ParsedReply r = ParseToolCalls(ToolCallFormat::kLlama3Json,
                                 "{\"name\": \"f\", \"parameters\": {\"x\": \"a;b}\"}}; "
                                 "{\"name\": \"g\", \"parameters\": {\"y\": [1, 2]}}");
  EXPECT_EQ(r.content, "");
  EXPECT_THAT(CallsOf(r.calls),
              testing::ElementsAre(Call{"f", {{"x", "a;b}"}}}, Call{"g", {{"y", {1, 2}}}}));
  r = ParseToolCalls(ToolCallFormat::kLlama3Json,
                     "Sure. <|python_tag|>{\"name\": \"f\", \"parameters\": {}}");
  EXPECT_EQ(r.content, "Sure. ");
  EXPECT_THAT(CallsOf(r.calls), testing::ElementsAre(Call{"f", json::object()}));
}

TEST(ParseToolCalls, ReadsAMistralArray) {
  const ParsedReply r =
      ParseToolCalls(ToolCallFormat::kMistral,
                     "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}}, {\"name\": \"g\", "
                     "\"arguments\": {\"b\": \"x\"}}]");
  EXPECT_EQ(r.content, "");
  EXPECT_THAT(CallsOf(r.calls),
              testing::ElementsAre(Call{"f", {{"a", 1}}}, Call{"g", {{"b", "x"}}}));
  EXPECT_EQ(r.calls[0].id.size(), 9u);  // what Mistral's templates take
}

TEST(ParseToolCalls, KeepsMalformedCallsAsText) {
  const std::pair<ToolCallFormat, std::string> replies[] = {
      {ToolCallFormat::kHermes, "a <tool_call>{\"name\": \"f\", \"arguments\": {</tool_call>"},
      {ToolCallFormat::kHermes, "<tool_call>{\"arguments\": {}}</tool_call>"},  // no name
      {ToolCallFormat::kHermes,
       "<tool_call>{\"name\": \"f\"}</tool_call><tool_call>[1]</tool_call>"},  // one bad
      {ToolCallFormat::kLlama3Json, "{\"name\": \"f\", \"parameters\": {} "},
      {ToolCallFormat::kLlama3Json, "{\"answer\": 42}"},  // JSON, but not a call
      {ToolCallFormat::kLlama3Json, "{\"name\": \"f\", \"parameters\": 3}"},
      {ToolCallFormat::kMistral, "x [TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}},]"},
      {ToolCallFormat::kMistral, "[TOOL_CALLS] nothing"},
  };
  for (const auto& [format, text] : replies) {
    const ParsedReply r = ParseToolCalls(format, text);
    EXPECT_EQ(r.content, text);
    EXPECT_TRUE(r.calls.empty()) << text;
  }
  EXPECT_EQ(ParseToolCalls(ToolCallFormat::kNone, "<tool_call>{\"name\": \"f\"}</tool_call>")
                .calls.size(),
            0u);
}

TEST(ParseToolCalls, TakesALastBlockLeftOpen) {
  const ParsedReply r =
      ParseToolCalls(ToolCallFormat::kHermes, "<tool_call>{\"name\": \"f\", \"arguments\": {}}");
  EXPECT_THAT(CallsOf(r.calls), testing::ElementsAre(Call{"f", json::object()}));
}

// What a stream hands out, put together, for `text` split into the given pieces.
ParsedReply StreamOf(ToolCallFormat format, const ToolChoice& choice,
                     const std::vector<std::string_view>& pieces, std::string& framing_error) {
  ToolCallStream stream(format, choice);
  ParsedReply out;
  std::map<int, ToolCall> calls;
  auto take = [&](const ToolCallStream::Delta& d) {
    out.content += d.content;
    for (const json& entry : d.tool_calls) {
      const int index = entry.at("index");
      if (!calls.contains(index)) {
        // The first entry of a call names it; later ones carry only arguments.
        if (!entry.contains("id") || entry.value("type", "") != "function" ||
            entry["function"]["arguments"] != "") {
          framing_error = entry.dump();
        }
        calls[index] = {entry["id"], entry["function"]["name"], ""};
      } else if (entry.contains("id")) {
        framing_error = entry.dump();
      }
      calls[index].arguments += entry["function"]["arguments"].get<std::string>();
    }
  };
  for (std::string_view piece : pieces) take(stream.Next(piece));
  take(stream.Finish());
  for (auto& [index, call] : calls) out.calls.push_back(call);
  return out;
}

TEST(ToolCallStream, AnySplitGivesTheWholeReplysTextAndCalls) {
  const ToolChoice auto_choice{ToolChoice::Kind::kAuto, ""};
  const std::pair<ToolCallFormat, std::string> replies[] = {
      {ToolCallFormat::kHermes,
       "I'll check <tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"<tool_call>\"}}\n"
       "</tool_call>\n<tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>"},
      {ToolCallFormat::kHermes, "no call < tool here <tool_cal"},
      {ToolCallFormat::kHermes, "bad <tool_call>{\"name\": </tool_call>"},
      {ToolCallFormat::kLlama3Json,
       "  {\"name\": \"f\", \"parameters\": {\"a\": 1}};{\"name\": \"g\", \"parameters\": {}}"},
      {ToolCallFormat::kLlama3Json, "Hi <|python_tag|>{\"name\": \"f\", \"parameters\": {}}"},
      {ToolCallFormat::kLlama3Json, "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}"},
      {ToolCallFormat::kLlama3Json, "<|pyth plain text"},
      {ToolCallFormat::kLlama3Json, "{\"not\": \"a call\"}"},
      {ToolCallFormat::kMistral,
       "ok [TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"s\": \"]\"}}]"},
  };
  for (const auto& [format, text] : replies) {
    const ParsedReply whole = ParseToolCalls(format, text);
    for (size_t cut = 0; cut <= text.size(); ++cut) {
      for (size_t cut2 = cut; cut2 <= text.size(); cut2 += 7) {
        const std::string_view t = text;
        std::string framing_error;
        const ParsedReply streamed =
            StreamOf(format, auto_choice,
                     {t.substr(0, cut), t.substr(cut, cut2 - cut), t.substr(cut2)}, framing_error);
        ASSERT_EQ(streamed.content, whole.content) << text << " cut at " << cut << ", " << cut2;
        ASSERT_EQ(CallsOf(streamed.calls), CallsOf(whole.calls)) << text << " cut at " << cut;
        ASSERT_EQ(framing_error, "");
      }
    }
  }
}

TEST(ToolCallStream, NeverShowsMarkerTextBeforeTheCallsParse) {
  ToolCallStream stream(ToolCallFormat::kHermes, {ToolChoice::Kind::kAuto, ""});
  EXPECT_EQ(stream.Next("Hello <tool").content, "Hello ");
  EXPECT_EQ(stream.Next("_call>{\"name\": \"f\", ").content, "");
  EXPECT_EQ(stream.Next("\"arguments\": {}}</tool_call>").content, "");
  const ToolCallStream::Delta last = stream.Finish();
  EXPECT_EQ(last.content, "");
  ASSERT_EQ(last.tool_calls.size(), 2u);
  EXPECT_EQ(last.tool_calls[0]["function"]["name"], "f");
  EXPECT_EQ(last.tool_calls[1]["function"]["arguments"], "{}");
  EXPECT_TRUE(stream.called());
}

TEST(ToolCallStream, StreamsANamedCallsArgumentsAsTheyCome) {
  ToolCallStream stream(ToolCallFormat::kNone, {ToolChoice::Kind::kNamed, "f"});
  ToolCallStream::Delta d = stream.Next("{\"a\"");
  ASSERT_EQ(d.tool_calls.size(), 2u);
  EXPECT_EQ(d.tool_calls[0]["function"]["name"], "f");
  EXPECT_EQ(d.tool_calls[1]["function"]["arguments"], "{\"a\"");
  d = stream.Next(": 1}");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_FALSE(d.tool_calls[0].contains("id"));
  EXPECT_TRUE(stream.Finish().tool_calls.empty());
}

TEST(ParseForcedCalls, ReadsRequiredArraysAndNamedArguments) {
  const ToolChoice required{ToolChoice::Kind::kRequired, ""};
  ParsedReply r = ParseForcedCalls(
      required, R"([{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}])",
      ToolCallFormat::kNone);
  EXPECT_THAT(CallsOf(r.calls),
              testing::ElementsAre(Call{"f", {{"a", 1}}}, Call{"g", json::object()}));
  r = ParseForcedCalls(required, "not json", ToolCallFormat::kNone);
  EXPECT_TRUE(r.calls.empty());
  EXPECT_EQ(r.content, "not json");
  r = ParseForcedCalls({ToolChoice::Kind::kNamed, "f"}, R"({"a": 2})", ToolCallFormat::kNone);
  EXPECT_THAT(CallsOf(r.calls), testing::ElementsAre(Call{"f", {{"a", 2}}}));
}

const char* kTools = R"([
  {"type": "function", "function": {"name": "get_weather", "description": "d",
   "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"enum": ["c", "f"]}},
                  "required": ["city"]}}},
  {"type": "function", "function": {"name": "now"}}])";

TEST(ForcedCallSchema, NamedIsTheParametersAndRequiredAnArrayOfCalls) {
  const ordered_json tools = ordered_json::parse(kTools);
  EXPECT_EQ(ForcedCallSchema({ToolChoice::Kind::kNamed, "get_weather"}, tools),
            tools[0]["function"]["parameters"].dump());  // keys in the client's order
  const json required = json::parse(ForcedCallSchema({ToolChoice::Kind::kRequired, ""}, tools));
  EXPECT_EQ(required["type"], "array");
  EXPECT_EQ(required["minItems"], 1);
  const json& any_of = required["items"]["anyOf"];
  ASSERT_EQ(any_of.size(), 2u);
  EXPECT_EQ(any_of[0]["properties"]["name"]["enum"], json::array({"get_weather"}));
  EXPECT_EQ(any_of[0]["properties"]["parameters"]["required"], json::array({"city"}));
  EXPECT_EQ(any_of[1]["properties"]["parameters"]["type"], "object");
  EXPECT_EQ(any_of[1]["required"], json::array({"name", "parameters"}));
  EXPECT_EQ(ForcedCallSchema({ToolChoice::Kind::kAuto, ""}, tools), "");
  // parallel_tool_calls: false, one call at most.
  EXPECT_FALSE(required.contains("maxItems"));
  EXPECT_EQ(json::parse(ForcedCallSchema({ToolChoice::Kind::kRequired, ""}, tools, false))["maxItems"],
            1);
}

TEST(CheckTools, NamesTheMalformedField) {
  const std::pair<const char*, const char*> cases[] = {
      {R"([1])", "tools[0]"},
      {R"([{"type": "code_interpreter"}])", "tools[0].type"},
      {R"([{"type": "function"}])", "tools[0].function"},
      {R"([{"type": "function", "function": {"name": "ok"}},
           {"type": "function", "function": {"name": "bad name"}}])",
       "tools[1].function.name"},
      {R"([{"type": "function", "function": {"name": "f", "parameters": []}}])",
       "tools[0].function.parameters"},
      {R"([{"type": "function", "function": {"name": "f", "description": 3}}])",
       "tools[0].function.description"},
  };
  for (const auto& [tools, param] : cases) {
    const absl::Status s = CheckTools(ordered_json::parse(tools));
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << tools;
    EXPECT_EQ(ParamOf(s), param) << s;
  }
  EXPECT_TRUE(CheckTools(ordered_json::parse(kTools)).ok());
}

TEST(ParseToolChoice, ReadsEachFormAndRefusesAnUnknownName) {
  const ordered_json tools = ordered_json::parse(kTools);
  auto parse = [&](const char* text, const ordered_json& t) {
    const ordered_json choice = ordered_json::parse(text);
    return ParseToolChoice(&choice, t);
  };
  EXPECT_EQ(ParseToolChoice(nullptr, tools)->kind, ToolChoice::Kind::kAuto);
  EXPECT_EQ(ParseToolChoice(nullptr, ordered_json())->kind, ToolChoice::Kind::kNone);
  EXPECT_EQ(parse(R"("none")", tools)->kind, ToolChoice::Kind::kNone);
  EXPECT_EQ(parse(R"("required")", tools)->kind, ToolChoice::Kind::kRequired);
  absl::StatusOr<ToolChoice> named =
      parse(R"({"type": "function", "function": {"name": "now"}})", tools);
  ASSERT_TRUE(named.ok());
  EXPECT_EQ(named->kind, ToolChoice::Kind::kNamed);
  EXPECT_EQ(named->name, "now");
  EXPECT_EQ(parse(R"({"type": "function", "name": "now"})", tools)->name, "now");
  EXPECT_EQ(
      ParamOf(parse(R"({"type": "function", "function": {"name": "later"}})", tools).status()),
      "tool_choice.function.name");
  EXPECT_EQ(ParamOf(parse(R"("sometimes")", tools).status()), "tool_choice");
  EXPECT_EQ(ParamOf(parse(R"("required")", ordered_json()).status()), "tool_choice");
}

TEST(NormalizeToolMessages, TurnsArgumentStringsIntoObjectsAndNamesBadFields) {
  ordered_json messages = ordered_json::parse(R"([
      {"role": "user", "content": "weather?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"a\": 1}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])");
  ASSERT_TRUE(NormalizeToolMessages(messages).ok());
  const ordered_json& args = messages[1]["tool_calls"][0]["function"]["arguments"];
  ASSERT_TRUE(args.is_object());
  EXPECT_EQ(args.dump(), R"({"city":"Oslo","a":1})");  // the client's key order kept

  const std::pair<const char*, const char*> cases[] = {
      {R"([{"role": "tool", "content": "x"}])", "messages[0].tool_call_id"},
      {R"([{"role": "assistant", "tool_calls": [{"function": {"name": "f",
           "arguments": "{oops"}}]}])",
       "messages[0].tool_calls[0].function.arguments"},
      {R"([{"role": "assistant", "tool_calls": [{"type": "function"}]}])",
       "messages[0].tool_calls[0].function"},
      {R"([{"role": "user", "content": "a", "tool_calls": []}])", "messages[0].tool_calls"},
  };
  for (const auto& [text, param] : cases) {
    ordered_json m = ordered_json::parse(text);
    EXPECT_EQ(ParamOf(NormalizeToolMessages(m)), param) << text;
  }
}

TEST(ToolCallFormat, ComesFromTheTemplatesMarkersOrVllmsNames) {
  EXPECT_EQ(ToolCallFormatOfTemplate("{{- '<tool_call>\\n' }}"), ToolCallFormat::kHermes);
  EXPECT_EQ(ToolCallFormatOfTemplate("{{ '[TOOL_CALLS]' }}"), ToolCallFormat::kMistral);
  EXPECT_EQ(ToolCallFormatOfTemplate("{{- '<|python_tag|>' }}"), ToolCallFormat::kLlama3Json);
  EXPECT_EQ(ToolCallFormatOfTemplate("{{ messages }}"), ToolCallFormat::kNone);
  EXPECT_EQ(*ToolCallFormatNamed("hermes"), ToolCallFormat::kHermes);
  EXPECT_EQ(*ToolCallFormatNamed("llama3_json"), ToolCallFormat::kLlama3Json);
  EXPECT_EQ(*ToolCallFormatNamed("mistral"), ToolCallFormat::kMistral);
  EXPECT_FALSE(ToolCallFormatNamed("pythonic").ok());
}

}  // namespace
}  // namespace tandem::openai
