// The bodies of POST /v1/completions and /v1/chat/completions read into one plain request: every
// field checked for its type and range here, each error an InvalidField naming the field as the
// client wrote it (api_error.h). Fields OpenAI or vLLM define that tandem does not do are refused;
// unknown fields are ignored, as OpenAI does. What the model itself limits (vocabulary, context)
// is checked afterwards by ValidateRequest, whose errors ToApiError renames to these fields.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/openai/tool_calls.h"
#include "nlohmann/json.hpp"
#include "proto/tandem.pb.h"

namespace tandem::openai {

enum class Endpoint { kCompletions, kChat };

// One prompt of a completion request: text, or token ids.
struct PromptInput {
  std::string text;
  std::vector<int32_t> token_ids;
  bool is_tokens = false;
};

struct ApiRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;                // "" when the client named none
  std::vector<PromptInput> prompts;  // completions: one per prompt, each gets n choices
  // Chat: what its template sees, each object with its keys in the client's order (a template's
  // tojson then writes tools and their parameters as Hugging Face's does).
  nlohmann::ordered_json messages;  // [{role, content: string|null, ...}], text parts joined
  nlohmann::ordered_json tools;     // as given (checked: CheckTools); null when absent
  // Chat: kNone without tools. Required and named set generation.constraint (ForcedCallSchema).
  ToolChoice tool_choice;
  nlohmann::ordered_json template_kwargs;  // chat_template_kwargs, an object (may be empty)
  // Default true; false when continue_final_message is set (both true is refused).
  bool add_generation_prompt = true;
  // vLLM's continue_final_message: the prompt ends inside the last message (no end of turn), so
  // that the model continues it (an assistant's prefill).
  bool continue_final_message = false;
  int n = 1;                          // choices per prompt
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool echo = false;           // completions: the prompt's text before each choice's
  // Logprobs of generated tokens: completions' `logprobs: k` or chat's logprobs with top_logprobs
  // k give top = k; no logprobs: nullopt. With echo, the prompt's tokens' logprobs come first.
  std::optional<int> logprobs;
  // vLLM's extensions: `return_token_ids` puts each choice's generated token ids (each stream
  // chunk's) in `token_ids`; `return_tokens_as_token_ids` names the tokens of logprobs
  // "token_id:N", so that tokens without text (or with the same text) stay apart.
  bool return_token_ids = false;
  bool tokens_as_ids = false;
  int min_tokens = 0;  // EOS and stop conditions do not end a choice before this many tokens
  std::optional<uint64_t> seed;  // choice i samples with seed + i; unset: fresh seeds
  // Everything but the prompt: sampling, max_new_tokens, stop, stop_token_ids, ignore_eos.
  v1::GenerateRequest generation;
};

// vLLM's POST /tokenize: a prompt, or a conversation rendered by the chat template.
struct TokenizeRequest {
  bool chat = false;        // messages given (else prompt)
  std::string prompt;       // !chat
  // Chat: messages, tools, template kwargs, the two prompt flags; always: model ("" when none).
  ApiRequest conversation;
  // Whether the tokenizer adds its special tokens (BOS) around the text. vLLM's defaults: true
  // for a prompt, false for messages (the template writes its own BOS).
  bool add_special_tokens = true;
};

// A JSON request body: UTF-8, nested at most kMaxJsonDepth levels (common/bounded_json.h; the
// error's field is the path that goes deeper), and an object whose keys keep the client's order.
// Every JSON endpoint parses its body here, so nothing deeper reaches the recursive walks after
// the parse.
absl::StatusOr<nlohmann::ordered_json> ParseJsonBody(absl::string_view body);

// Defaults as OpenAI documents them: temperature 1, top_p 1, n 1, completions' max_tokens 16
// (chat: up to the end of the context, at most kDefaultMaxNewTokens).
absl::StatusOr<ApiRequest> ParseCompletionRequest(absl::string_view body);
absl::StatusOr<ApiRequest> ParseChatRequest(absl::string_view body);
absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(absl::string_view body);

// The coordinator's request for one prompt (token ids; text prompts are tokenized by the
// caller), with sampling.n = n (the coordinator seeds choice i with seed + i).
v1::GenerateRequest PromptRequest(const ApiRequest& request, const std::vector<int32_t>& prompt);

// ValidateRequest's error (named by the proto's fields) named by the API's fields instead; the
// prompt's errors are named `prompt_param` ("prompt", "prompt[2]", "messages").
absl::Status ToApiError(const absl::Status& status, Endpoint endpoint,
                        absl::string_view prompt_param);

}  // namespace tandem::openai
