// A chat request's prompt: the template sees the client's objects in the client's key order, and
// continue_final_message leaves the last message open as Hugging Face's apply_chat_template does.
#include "coordinator/openai/chat_prompt.h"

#include <string>

#include "coordinator/openai/api_error.h"
#include "coordinator/openai/request_parsing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::openai {
namespace {

// Llama-3's turn layout, in short.
constexpr char kTurns[] =
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m.role }}\n{{ m.content }}<|eot|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}";

ChatRenderer Renderer(const std::string& chat_template) {
  TextConfig text;
  text.bos_token = "<s>";
  text.chat_template = chat_template;
  absl::Status load;
  ChatRenderer render = MakeChatRenderer(text, &load);
  EXPECT_TRUE(load.ok()) << load;
  return render;
}

absl::StatusOr<std::string> Render(const std::string& chat_template, const std::string& body) {
  absl::StatusOr<ApiRequest> r = ParseChatRequest(body);
  if (!r.ok()) return r.status();
  return Renderer(chat_template)(*r);
}

TEST(ChatRenderer, TemplatePrintingToolsGetsTheirKeysInRequestOrder) {
  absl::StatusOr<std::string> prompt = Render("{{ tools | tojson }}", R"({
      "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "get", "parameters": {
          "type": "object", "required": ["zeta"],
          "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}}}}}]})");
  ASSERT_TRUE(prompt.ok()) << prompt.status();
  EXPECT_EQ(*prompt,
            R"([{"type": "function", "function": {"name": "get", "parameters": {"type": )"
            R"("object", "required": ["zeta"], "properties": {"zeta": {"type": "string"}, )"
            R"("alpha": {"type": "integer"}}}}}])");
}

// Llama-3.1's way of writing a past call, in short.
constexpr char kLlama31Call[] =
    "{% for m in messages %}{% if m.tool_calls %}{% set call = m.tool_calls[0].function %}"
    "{\"name\": \"{{ call.name }}\", \"parameters\": {{ call.arguments | tojson }}}"
    "[{{ m.content }}]{% elif m.role == 'tool' %}<ipython>{{ m.content }}{% endif %}{% endfor %}";

TEST(ChatRenderer, PastCallsReachTheTemplateWithArgumentsAsObjects) {
  absl::StatusOr<std::string> prompt = Render(kLlama31Call, R"({"messages": [
      {"role": "user", "content": "weather?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 2}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})");
  ASSERT_TRUE(prompt.ok()) << prompt.status();
  // Not the arguments' JSON string written as a string again; content null becomes "".
  EXPECT_EQ(*prompt,
            R"({"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}[]<ipython>sunny)");
}

TEST(ChatRenderer, MessageKeysAndKwargsReachTheTemplateInRequestOrder) {
  absl::StatusOr<std::string> prompt =
      Render("{% for k in messages[0] %}{{ k }},{% endfor %}{{ extra | tojson }}", R"({
      "messages": [{"role": "user", "name": "n", "content": "hi"}],
      "chat_template_kwargs": {"extra": {"b": 1, "a": 2}}})");
  ASSERT_TRUE(prompt.ok()) << prompt.status();
  EXPECT_EQ(*prompt, R"(role,name,content,{"b": 1, "a": 2})");
}

TEST(ChatRenderer, ContinueFinalMessageLeavesTheLastTurnOpen) {
  const std::string messages =
      R"("messages": [{"role": "user", "content": "Tell a story."},
                      {"role": "assistant", "content": "Once upon"}])";
  absl::StatusOr<std::string> open =
      Render(kTurns, "{" + messages + R"(, "continue_final_message": true})");
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_EQ(*open, "<s><|start|>user\nTell a story.<|eot|><|start|>assistant\nOnce upon");
  // Without it the turn is closed and (by default) a new one opened.
  absl::StatusOr<std::string> closed = Render(kTurns, "{" + messages + "}");
  ASSERT_TRUE(closed.ok()) << closed.status();
  EXPECT_EQ(*closed,
            "<s><|start|>user\nTell a story.<|eot|><|start|>assistant\nOnce upon<|eot|>"
            "<|start|>assistant\n");
  absl::StatusOr<std::string> both = Render(
      kTurns, "{" + messages + R"(, "continue_final_message": true, "add_generation_prompt": true})");
  EXPECT_EQ(ParamOf(both.status()), "continue_final_message");
}

TEST(OpenFinalMessage, KeepsTrailingSpaceOnlyWhereTheTemplateKeptIt) {
  // The template kept "Once " whole: the space stays (the model continues after it).
  absl::StatusOr<std::string> kept = OpenFinalMessage("[a]Once [/a]", "Once ", 1);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(*kept, "[a]Once ");
  // A template that trims the message: the cut is after the trimmed text.
  absl::StatusOr<std::string> trimmed = OpenFinalMessage("[a]Once[/a]", " Once ", 1);
  ASSERT_TRUE(trimmed.ok());
  EXPECT_EQ(*trimmed, "[a]Once");
  // The last occurrence: an earlier message with the same text is not the one continued.
  absl::StatusOr<std::string> last = OpenFinalMessage("[u]Hi[/u][a]Hi[/a]", "Hi", 1);
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(*last, "[u]Hi[/u][a]Hi");
  absl::StatusOr<std::string> missing = OpenFinalMessage("[a][/a]", "Once", 3);
  EXPECT_EQ(HttpStatusOf(missing.status()), 400);
  EXPECT_EQ(ParamOf(missing.status()), "messages[3].content");
}

}  // namespace
}  // namespace tandem::openai
