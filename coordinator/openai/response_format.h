// OpenAI's response shapes, as JSON: whole completions and chat completions, their streaming
// chunks, and the framing of server-sent events (`data: {...}\n\n`, ending with `data: [DONE]`).
// Text is UTF-8 already (request_stream.h's TextStream); token strings of logprobs may be
// partial characters and are sanitized here (chat's `bytes` keeps their raw bytes).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/step.h"
#include "common/tokenizer.h"
#include "coordinator/openai/tool_calls.h"
#include "nlohmann/json.hpp"
#include "proto/tandem.pb.h"

namespace tandem::openai {

// What every response and chunk of one request shares.
struct ResponseHead {
  std::string id;       // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0;  // Unix seconds
  std::string model;
};

// One finished choice.
struct ChoiceResult {
  int index = 0;
  std::string text;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  nlohmann::json stop_reason;          // StopReasonJson's
  std::vector<TokenLogprob> logprobs;  // with logprobs asked for: one per generated token
  // Chat: the calls read from the reply (`text` is then what came before them; null when empty)
  // and finish_reason "tool_calls".
  std::vector<ToolCall> tool_calls;
};

struct UsageCounts {
  int prompt_tokens = 0;
  int completion_tokens = 0;
};

// "stop" (EOS, a stop token or a stop string), "length", or null while generating; a reply that
// ended with tool calls (`called`) and not by its length: "tool_calls".
nlohmann::json FinishReasonJson(v1::FinishReason finish, bool called = false);
nlohmann::json UsageJson(const UsageCounts& usage);

// vLLM's stop_reason for a choice that ended with `finish`: the stop string that ended it (of
// `stops`, the one at byte `text_limit` of `text`, the decoded text of all its tokens; else the
// one found earliest), or the stop token id that ended it (the last of `tokens`, when
// `text_limit` < 0); null when it ended otherwise (EOS, length) or goes on.
nlohmann::json StopReasonJson(v1::FinishReason finish, std::span<const int32_t> tokens,
                              int text_limit, std::string_view text,
                              const std::vector<std::string>& stops);

// Logprobs in completions' shape: {tokens, token_logprobs, top_logprobs: [{token: logprob}],
// text_offset}; `offset` is where the first token's text starts in the choice's text.
// `tokens_as_ids`: tokens are named "token_id:N" instead of by their text (text_offset still
// counts text).
nlohmann::json CompletionLogprobs(const Tokenizer* tokenizer,
                                  const std::vector<TokenLogprob>& logprobs, size_t offset,
                                  bool tokens_as_ids = false);
// echo with logprobs: the prompt's tokens first, the first with null logprob and alternatives
// (nothing comes before it to predict it) and the rest with `prompt_logprobs` (one per prompt
// token after the first), from text_offset 0; then `generated` (CompletionLogprobs' JSON of the
// generated tokens, which start at the end of the echoed text).
nlohmann::json EchoedLogprobs(const Tokenizer* tokenizer, std::span<const int32_t> prompt,
                              const std::vector<TokenLogprob>& prompt_logprobs,
                              const nlohmann::json& generated, bool tokens_as_ids = false);
// Logprobs in chat's shape: {content: [{token, logprob, bytes, top_logprobs: [...]}]}.
nlohmann::json ChatLogprobs(const Tokenizer* tokenizer, const std::vector<TokenLogprob>& logprobs,
                            bool tokens_as_ids = false);

// `logprobs`: with logprobs asked for, the JSON of each choice's (CompletionLogprobs or
// ChatLogprobs, by choice); else null.
nlohmann::json CompletionResponse(const ResponseHead& head, const std::vector<ChoiceResult>& choices,
                                  const std::vector<nlohmann::json>& logprobs,
                                  const UsageCounts& usage);
nlohmann::json ChatResponse(const ResponseHead& head, const std::vector<ChoiceResult>& choices,
                            const std::vector<nlohmann::json>& logprobs, const UsageCounts& usage);

// One streamed piece of choice `index`. `finish` and `stop_reason`: set on its last piece.
// `with_usage`: the stream asked for usage, so every chunk carries "usage": null until the last.
nlohmann::json CompletionChunk(const ResponseHead& head, int index, std::string_view text,
                               const nlohmann::json& logprobs, v1::FinishReason finish,
                               bool with_usage, const nlohmann::json& stop_reason = nullptr);
// `delta`: {"role": "assistant", "content": ""} first, then {"content": "..."}, {} at the end.
nlohmann::json ChatChunk(const ResponseHead& head, int index, const nlohmann::json& delta,
                         const nlohmann::json& logprobs, v1::FinishReason finish, bool with_usage,
                         const nlohmann::json& stop_reason = nullptr);
// The stream's last chunk when it asked for usage: no choices, the usage.
nlohmann::json UsageChunk(const ResponseHead& head, std::string_view object,
                          const UsageCounts& usage);

// `data: <json>\n\n`; JSON text is written with invalid UTF-8 replaced, never thrown on.
std::string SseEvent(const nlohmann::json& event);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";
// A JSON body, with invalid UTF-8 replaced.
std::string JsonText(const nlohmann::json& value);

}  // namespace tandem::openai
