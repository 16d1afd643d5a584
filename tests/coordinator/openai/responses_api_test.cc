// The Responses API's request translation and answer shapes (coordinator/openai/responses_api.cc).
#include "coordinator/openai/responses_api.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "coordinator/openai/api_error.h"

namespace tandem::openai {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

TEST(ParseResponsesRequest, TurnsInputItemsIntoChatMessages) {
  absl::StatusOr<ResponsesRequest> r = ParseResponsesRequest(R"({
      "model": "m", "instructions": "be brief", "max_output_tokens": 7, "temperature": 0,
      "input": [
        {"role": "user", "content": "weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\": \"Oslo\"}"},
        {"type": "function_call", "call_id": "call_2", "name": "now", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "and"}, {"type": "input_text", "text": "then?"}]}],
      "tools": [{"type": "function", "name": "get_weather",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
                {"type": "function", "name": "now"}],
      "tool_choice": {"type": "function", "name": "now"}})");
  ASSERT_TRUE(r.ok()) << r.status();
  const ordered_json& m = r->chat.messages;
  ASSERT_EQ(m.size(), 5u);
  EXPECT_EQ(m[0]["role"], "system");
  EXPECT_EQ(m[0]["content"], "be brief");
  EXPECT_EQ(m[2]["role"], "assistant");
  ASSERT_EQ(m[2]["tool_calls"].size(), 2u);  // both calls in one turn
  EXPECT_EQ(m[2]["tool_calls"][0]["id"], "call_1");
  EXPECT_EQ(m[2]["tool_calls"][0]["function"]["arguments"]["city"], "Oslo");
  EXPECT_EQ(m[3]["role"], "tool");
  EXPECT_EQ(m[3]["tool_call_id"], "call_1");
  EXPECT_EQ(m[4]["content"], "and\nthen?");
  EXPECT_EQ(r->chat.tools[0]["function"]["name"], "get_weather");
  EXPECT_EQ(r->chat.tool_choice.kind, ToolChoice::Kind::kNamed);
  EXPECT_EQ(r->chat.tool_choice.name, "now");
  EXPECT_EQ(r->chat.generation.max_new_tokens(), 7);
  EXPECT_EQ(r->chat.generation.sampling().temperature(), 0);
  EXPECT_FALSE(r->chat.stream);
  EXPECT_EQ(r->echo["instructions"], "be brief");
  EXPECT_EQ(r->echo["tools"][1]["name"], "now");  // in the Responses API's shape
}

TEST(ParseResponsesRequest, AStringInputIsOneUserMessageAndAStreamCountsItsUsage) {
  absl::StatusOr<ResponsesRequest> r = ParseResponsesRequest(R"({"input": "hi", "stream": true})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->chat.messages.size(), 1u);
  EXPECT_EQ(r->chat.messages[0]["role"], "user");
  EXPECT_TRUE(r->chat.stream);
  EXPECT_TRUE(r->chat.include_usage);
  EXPECT_EQ(r->chat.tool_choice.kind, ToolChoice::Kind::kNone);
}

// parallel_tool_calls false allows one forced call: the call list's schema says at most one.
TEST(ParseResponsesRequest, ParallelToolCallsFalseForcesOneCall) {
  for (const bool parallel : {true, false}) {
    absl::StatusOr<ResponsesRequest> r = ParseResponsesRequest(absl::StrCat(
        R"({"input": "hi", "tool_choice": "required", "parallel_tool_calls": )",
        parallel ? "true" : "false", R"(, "tools": [{"type": "function", "name": "now"}]})"));
    ASSERT_TRUE(r.ok()) << r.status();
    const json schema = json::parse(r->chat.generation.constraint().json_schema());
    EXPECT_EQ(schema.contains("maxItems"), !parallel) << schema.dump();
    EXPECT_EQ(r->echo["parallel_tool_calls"], parallel);
  }
}

TEST(ParseResponsesRequest, RefusesWhatItCannotServeNamingTheField) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"input": "a", "previous_response_id": "resp_1"})", "previous_response_id"},
      {R"({"input": "a", "background": true})", "background"},
      {R"({"input": "a", "reasoning": {"effort": "low"}})", "reasoning"},
      {R"({"input": "a", "include": ["file_search_call.results"]})", "include"},
      {R"({"input": "a", "tools": [{"type": "web_search"}]})", "tools[0].type"},
      {R"({"input": "a", "tools": [{"type": "function", "name": "bad name"}]})", "tools[0].name"},
      {R"({"input": "a", "tools": [{"type": "function", "name": "f"}],
           "tool_choice": {"type": "function", "name": "g"}})",
       "tool_choice.name"},
      {R"({"input": "a", "max_output_tokens": 0})", "max_output_tokens"},
      {R"({"input": "a", "temperature": 3})", "temperature"},
      {R"({"input": "a", "text": {"format": {"type": "json_object"}}})", "text.format"},
      {R"({})", "input"},
      {R"({"input": "a", "stream": "yes"})", "stream"},  // wrong types are 400s, never throws
      {R"({"input": "a", "text": {"format": {"type": 3}}})", "text.format"},
      {R"({"input": "a", "tool_choice": {"type": 1, "name": "f"}})", "tool_choice.type"},
      {R"({"input": [{"type": "item_reference", "id": "x"}]})", "input[0].type"},
      {R"({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})",
       "input[0].content[0].type"},
      {R"({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]})",
       "input[0].call_id"},
      {R"({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]})",
       "input[0].arguments"},
      {R"({"input": [{"type": "function_call_output", "call_id": "c"}]})", "input[0].output"},
  };
  for (const auto& [body, param] : cases) {
    absl::StatusOr<ResponsesRequest> r = ParseResponsesRequest(body);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(HttpStatusOf(r.status()), 400) << body;
    EXPECT_EQ(ParamOf(r.status()), param) << r.status();
  }
}

TEST(ResponseOfChat, GivesTheMessageAndTheCallsAsOutputItems) {
  const json chat = json::parse(R"({"id": "chatcmpl-1", "created": 5, "model": "m",
      "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Let me see.", "tool_calls": [
          {"id": "call_1", "type": "function",
           "function": {"name": "f", "arguments": "{\"a\":1}"}}]}}],
      "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})");
  const ordered_json r = ResponseOfChat(chat, {{"instructions", nullptr}}, "resp_1");
  EXPECT_EQ(r["object"], "response");
  EXPECT_EQ(r["status"], "completed");
  ASSERT_EQ(r["output"].size(), 2u);
  EXPECT_EQ(r["output"][0]["type"], "message");
  EXPECT_EQ(r["output"][0]["content"][0]["type"], "output_text");
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "Let me see.");
  EXPECT_EQ(r["output"][1]["type"], "function_call");
  EXPECT_EQ(r["output"][1]["call_id"], "call_1");
  EXPECT_EQ(r["output"][1]["arguments"], "{\"a\":1}");
  EXPECT_EQ(r["usage"]["input_tokens"], 3);
  EXPECT_EQ(r["usage"]["output_tokens"], 4);
  EXPECT_EQ(r["usage"]["total_tokens"], 7);
}

TEST(ResponseOfChat, AReplyCutByItsLengthIsIncomplete) {
  const json chat = json::parse(R"({"choices": [{"finish_reason": "length",
      "message": {"role": "assistant", "content": "abc"}}]})");
  const ordered_json r = ResponseOfChat(chat, ordered_json::object(), "resp_1");
  EXPECT_EQ(r["status"], "incomplete");
  EXPECT_EQ(r["incomplete_details"]["reason"], "max_output_tokens");
}

// Collects what an exchange is given.
class Recorder : public HttpExchange {
 public:
  void Respond(HttpResponse response) override { whole = std::move(response); }
  void StartStream(HttpResponse head) override { started = head.content_type; }
  bool Write(std::string_view data) override {
    written += data;
    return true;
  }
  void End() override { ended = true; }
  bool ClientGone() override { return false; }

  HttpResponse whole;
  std::string started;
  std::string written;
  bool ended = false;
};

std::string Data(const json& chunk) { return "data: " + chunk.dump() + "\n\n"; }

json Chunk(const json& delta, const json& finish = nullptr) {
  return {{"object", "chat.completion.chunk"},
          {"choices", {{{"index", 0}, {"delta", delta}, {"finish_reason", finish}}}}};
}

TEST(ResponsesExchange, TurnsChatChunksIntoTheResponsesEventsInOrder) {
  auto recorder = std::make_shared<Recorder>();
  std::shared_ptr<HttpExchange> exchange =
      ResponsesExchange(recorder, {{"model", "m"}, {"tools", ordered_json::array()}});
  HttpResponse head;
  head.content_type = "text/event-stream";
  exchange->StartStream(head);
  exchange->Write(Data(Chunk({{"role", "assistant"}, {"content", ""}})));
  exchange->Write(Data(Chunk({{"content", "Hel"}})));
  exchange->Write(Data(Chunk({{"content", "lo"}})));
  exchange->Write(Data(Chunk({{"tool_calls",
                               {{{"index", 0},
                                 {"id", "call_9"},
                                 {"type", "function"},
                                 {"function", {{"name", "f"}, {"arguments", ""}}}}}}})));
  exchange->Write(
      Data(Chunk({{"tool_calls", {{{"index", 0}, {"function", {{"arguments", "{\"a\":"}}}}}}})));
  exchange->Write(
      Data(Chunk({{"tool_calls", {{{"index", 0}, {"function", {{"arguments", "1}"}}}}}}})));
  exchange->Write(Data(Chunk(json::object(), "tool_calls")));
  exchange->Write(Data(
      {{"choices", json::array()}, {"usage", {{"prompt_tokens", 2}, {"completion_tokens", 5}}}}));
  exchange->Write("data: [DONE]\n\n");
  exchange->End();
  EXPECT_TRUE(recorder->ended);

  std::vector<std::string> types;
  std::vector<json> events;
  for (size_t at = 0; at < recorder->written.size();) {
    const size_t end = recorder->written.find("\n\n", at);
    ASSERT_NE(end, std::string::npos);
    const std::string event = recorder->written.substr(at, end - at);
    at = end + 2;
    // `event: TYPE` then `data: {...}` whose type is the same, numbered from 0.
    ASSERT_TRUE(event.starts_with("event: ")) << event;
    const size_t newline = event.find('\n');
    const std::string type = event.substr(7, newline - 7);
    ASSERT_TRUE(event.substr(newline + 1).starts_with("data: ")) << event;
    const json data = json::parse(event.substr(newline + 7));
    EXPECT_EQ(data["type"], type);
    EXPECT_EQ(data["sequence_number"], events.size());
    types.push_back(type);
    events.push_back(data);
  }
  EXPECT_THAT(
      types,
      testing::ElementsAre(
          "response.created", "response.in_progress", "response.output_item.added",
          "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
          "response.output_text.done", "response.content_part.done", "response.output_item.done",
          "response.output_item.added", "response.function_call_arguments.delta",
          "response.function_call_arguments.delta", "response.function_call_arguments.done",
          "response.output_item.done", "response.completed"));
  EXPECT_EQ(events[6]["text"], "Hello");
  EXPECT_EQ(events[9]["output_index"], 1);
  EXPECT_EQ(events[9]["item"]["call_id"], "call_9");
  EXPECT_EQ(events[12]["arguments"], "{\"a\":1}");
  const json& done = events.back()["response"];
  EXPECT_EQ(done["status"], "completed");
  ASSERT_EQ(done["output"].size(), 2u);
  EXPECT_EQ(done["output"][1]["name"], "f");
  EXPECT_EQ(done["usage"]["output_tokens"], 5);
}

TEST(ResponsesExchange, PassesErrorsAndTurnsAWholeChatAnswerIntoAResponse) {
  auto recorder = std::make_shared<Recorder>();
  std::shared_ptr<HttpExchange> exchange = ResponsesExchange(recorder, ordered_json::object());
  HttpResponse error;
  error.status = 400;
  error.body = R"({"error": {"message": "x", "param": "tools"}})";
  exchange->Respond(error);
  EXPECT_EQ(recorder->whole.status, 400);
  EXPECT_EQ(recorder->whole.body, error.body);

  HttpResponse ok;
  ok.body = R"({"choices": [{"finish_reason": "stop",
                 "message": {"role": "assistant", "content": "hi"}}]})";
  exchange->Respond(ok);
  const json r = json::parse(recorder->whole.body);
  EXPECT_EQ(r["object"], "response");
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "hi");
}

}  // namespace
}  // namespace tandem::openai
