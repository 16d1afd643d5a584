// Tool calls of the chat API: a request's `tools` and `tool_choice` checked, the formats in which
// model families write their calls (read from a whole reply or from a stream of text pieces), and
// the JSON schema that forces a call when tool_choice asks for one (constrained decoding, as vLLM
// does it).
//
// Formats, by vLLM's names (--tool_call_parser):
//   llama3_json  Llama-3.1/3.2: {"name": "f", "parameters": {...}}, the reply starting with it or
//                with <|python_tag|>; several calls separated by ';'.
//   hermes       Qwen2.5/Qwen3 (Hermes style): <tool_call>{"name": "f", "arguments": {...}}
//                </tool_call>, one block per call, after the reply's text.
//   mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...] after the reply's text.
// A reply whose calls do not parse (malformed JSON, no name) is kept whole as text, as vLLM does.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::openai {

enum class ToolCallFormat { kNone, kLlama3Json, kHermes, kMistral };

// The format vLLM names `name` (llama3_json, hermes, mistral); INVALID_ARGUMENT listing the
// names for any other.
absl::StatusOr<ToolCallFormat> ToolCallFormatNamed(std::string_view name);
std::string_view ToolCallFormatName(ToolCallFormat format);
// The format a chat template writes calls in, from its markers (<tool_call>, [TOOL_CALLS],
// <|python_tag|> or Llama's "parameters" instruction); kNone when it has none.
ToolCallFormat ToolCallFormatOfTemplate(std::string_view chat_template);

// OpenAI's tool_choice.
struct ToolChoice {
  enum class Kind { kAuto, kNone, kRequired, kNamed };
  Kind kind = Kind::kNone;
  std::string name;  // kNamed: the function
};

// `tools` (an array) checked: each {"type": "function", "function": {"name": ..., "description"?,
// "parameters"?: object, "strict"?: bool}}; errors name the field ("tools[1].function.name").
absl::Status CheckTools(const nlohmann::ordered_json& tools);
// `choice` (null: absent) read against the checked `tools`: "none", "auto", "required" or
// {"type": "function", "function": {"name": ...}} naming one of them. Absent: auto with tools,
// none without.
absl::StatusOr<ToolChoice> ParseToolChoice(const nlohmann::ordered_json* choice,
                                           const nlohmann::ordered_json& tools);

// The messages' tool parts checked and made what chat templates read (as Hugging Face's
// apply_chat_template gets them from vLLM): a `tool` message needs tool_call_id (a string); an
// assistant's tool_calls are [{id, type: "function", function: {name, arguments}}] whose
// arguments, a JSON string as OpenAI sends them, become the object they encode. Errors name the
// field ("messages[2].tool_calls[0].function.arguments"). A null content becomes "", as vLLM
// renders it.
absl::Status NormalizeToolMessages(nlohmann::ordered_json& messages);

// The JSON schema of the output a forcing tool_choice allows: named, the function's parameters
// (the output is its arguments); required, an array (at least one item) of {"name": <a tool>,
// "parameters": <its parameters>}, one anyOf branch per tool. Empty for auto and none.
std::string ForcedCallSchema(const ToolChoice& choice, const nlohmann::ordered_json& tools,
                             bool parallel = true);

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text of the arguments object
};

// A reply split into its text and its calls.
struct ParsedReply {
  std::string content;  // the text before the calls (all of it when there are none)
  std::vector<ToolCall> calls;
};

// A call id: "call_" and 24 letters and digits; Mistral's templates take exactly 9 of them.
std::string NewToolCallId(ToolCallFormat format);

// The calls of a whole reply written in `format` (kNone: no calls).
ParsedReply ParseToolCalls(ToolCallFormat format, std::string_view text);
// The call of a reply that `choice` forced (ForcedCallSchema): named, the whole text is the
// arguments; required, the array's items. A required reply that does not parse is kept as text.
ParsedReply ParseForcedCalls(const ToolChoice& choice, std::string_view text,
                             ToolCallFormat format);

// OpenAI's message.tool_calls: [{id, type: "function", function: {name, arguments}}].
nlohmann::json ToolCallsJson(const std::vector<ToolCall>& calls);

// The same split made on a reply as it streams: text is handed out as soon as it cannot be the
// start of a call marker; calls come as OpenAI streams them, each an entry of delta.tool_calls
// (index, id, type and name first with empty arguments, then the arguments). The text handed out
// and the calls, put together, are what ParseToolCalls/ParseForcedCalls make of the whole reply.
class ToolCallStream {
 public:
  // `choice` auto (parsed by `format`), required or named.
  ToolCallStream(ToolCallFormat format, ToolChoice choice);

  struct Delta {
    std::string content;
    std::vector<nlohmann::json> tool_calls;  // one chunk's delta.tool_calls entry each
  };
  // The next piece of the reply's text.
  Delta Next(std::string_view piece);
  // The reply ended: what was held back.
  Delta Finish();
  // Whether any call was handed out.
  bool called() const { return calls_ > 0; }

 private:
  // Where the calls may start in text_ (npos: nowhere yet), and how much of text_ is surely text.
  size_t MarkerStart(size_t& safe) const;
  void AddCall(const ToolCall& call, Delta& out);

  const ToolCallFormat format_;
  const ToolChoice choice_;
  std::string text_;      // the reply so far
  size_t shown_ = 0;      // bytes of text_ handed out as content
  bool holding_ = false;  // a marker was seen: the rest waits for Finish
  std::string named_id_;  // named choice: its call's id, once announced
  int calls_ = 0;
};

}  // namespace tandem::openai
