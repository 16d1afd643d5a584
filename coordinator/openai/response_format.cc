// OpenAI's response JSON, field by field as its API reference gives them.
#include "coordinator/openai/response_format.h"

#include <span>

#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "coordinator/request_stream.h"

namespace tandem::openai {
namespace {

using nlohmann::json;

// A token's text, raw (it may be part of a UTF-8 character).
std::string TokenBytes(const Tokenizer* tokenizer, int32_t id) {
  if (tokenizer == nullptr) return "";
  absl::StatusOr<std::string> text = tokenizer->Decode(std::span<const int32_t>(&id, 1));
  return text.ok() ? *text : "";
}

// How logprobs name a token: its text, or "token_id:N" (vLLM's return_tokens_as_token_ids).
std::string TokenName(const Tokenizer* tokenizer, int32_t id, bool as_id) {
  return as_id ? absl::StrCat("token_id:", id) : TokenBytes(tokenizer, id);
}

json BytesJson(std::string_view bytes) {
  json out = json::array();
  for (char c : bytes) out.push_back(static_cast<unsigned char>(c));
  return out;
}

json Head(const ResponseHead& head, std::string_view object) {
  return {{"id", head.id}, {"object", object}, {"created", head.created}, {"model", head.model}};
}

}  // namespace

json FinishReasonJson(v1::FinishReason finish, bool called) {
  if (called && finish != v1::FINISH_REASON_LENGTH) return "tool_calls";
  switch (finish) {
    case v1::FINISH_REASON_LENGTH: return "length";
    case v1::FINISH_REASON_STOP:
    case v1::FINISH_REASON_EOS: return "stop";
    default: return nullptr;
  }
}

json StopReasonJson(v1::FinishReason finish, std::span<const int32_t> tokens, int text_limit,
                    std::string_view text, const std::vector<std::string>& stops) {
  if (finish != v1::FINISH_REASON_STOP) return nullptr;
  if (text_limit < 0) return tokens.empty() ? json() : json(tokens.back());
  // The match the stop rule cut at; a string that matched earlier, within min_tokens, did not stop.
  if (static_cast<size_t>(text_limit) <= text.size()) {
    for (const std::string& stop : stops) {
      if (text.substr(text_limit).starts_with(stop)) return stop;
    }
  }
  const std::string* earliest = nullptr;
  size_t earliest_at = std::string_view::npos;
  for (const std::string& stop : stops) {
    const size_t at = text.find(stop);
    if (at < earliest_at) {
      earliest = &stop;
      earliest_at = at;
    }
  }
  return earliest == nullptr ? json() : json(*earliest);
}

json UsageJson(const UsageCounts& usage) {
  return {{"prompt_tokens", usage.prompt_tokens},
          {"completion_tokens", usage.completion_tokens},
          {"total_tokens", usage.prompt_tokens + usage.completion_tokens}};
}

json CompletionLogprobs(const Tokenizer* tokenizer, const std::vector<TokenLogprob>& logprobs,
                        size_t offset, bool tokens_as_ids) {
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
       text_offset = json::array();
  for (const TokenLogprob& lp : logprobs) {
    const std::string text = ToValidUtf8(TokenBytes(tokenizer, lp.token));
    tokens.push_back(tokens_as_ids ? TokenName(tokenizer, lp.token, true) : text);
    token_logprobs.push_back(lp.logprob);
    json alternatives = json::object();
    for (const auto& [id, logprob] : lp.top) {
      alternatives[ToValidUtf8(TokenName(tokenizer, id, tokens_as_ids))] = logprob;
    }
    top.push_back(std::move(alternatives));
    text_offset.push_back(offset);
    offset += text.size();
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(top)},
          {"text_offset", std::move(text_offset)}};
}

json EchoedLogprobs(const Tokenizer* tokenizer, std::span<const int32_t> prompt,
                    const std::vector<TokenLogprob>& prompt_logprobs, const json& generated,
                    bool tokens_as_ids) {
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
       text_offset = json::array();
  size_t offset = 0;
  for (size_t i = 0; i < prompt.size(); ++i) {
    const std::string text = ToValidUtf8(TokenBytes(tokenizer, prompt[i]));
    tokens.push_back(tokens_as_ids ? TokenName(tokenizer, prompt[i], true) : text);
    text_offset.push_back(offset);
    offset += text.size();
    // Entry i - 1 scores prompt token i.
    if (i == 0 || i - 1 >= prompt_logprobs.size()) {
      token_logprobs.push_back(nullptr);
      top.push_back(nullptr);
      continue;
    }
    const TokenLogprob& lp = prompt_logprobs[i - 1];
    token_logprobs.push_back(lp.logprob);
    json alternatives = json::object();
    for (const auto& [id, logprob] : lp.top) {
      alternatives[ToValidUtf8(TokenName(tokenizer, id, tokens_as_ids))] = logprob;
    }
    top.push_back(std::move(alternatives));
  }
  auto append = [&generated](json& into, const char* field) {
    if (!generated.is_object() || !generated.contains(field)) return;
    for (const json& v : generated.at(field)) into.push_back(v);
  };
  append(tokens, "tokens");
  append(token_logprobs, "token_logprobs");
  append(top, "top_logprobs");
  append(text_offset, "text_offset");
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(top)},
          {"text_offset", std::move(text_offset)}};
}

json ChatLogprobs(const Tokenizer* tokenizer, const std::vector<TokenLogprob>& logprobs,
                 bool tokens_as_ids) {
  json content = json::array();
  for (const TokenLogprob& lp : logprobs) {
    const std::string bytes = TokenName(tokenizer, lp.token, tokens_as_ids);
    json top = json::array();
    for (const auto& [id, logprob] : lp.top) {
      const std::string alt = TokenName(tokenizer, id, tokens_as_ids);
      top.push_back(
          {{"token", ToValidUtf8(alt)}, {"logprob", logprob}, {"bytes", BytesJson(alt)}});
    }
    content.push_back({{"token", ToValidUtf8(bytes)},
                       {"logprob", lp.logprob},
                       {"bytes", BytesJson(bytes)},
                       {"top_logprobs", std::move(top)}});
  }
  return {{"content", std::move(content)}};
}

json CompletionResponse(const ResponseHead& head, const std::vector<ChoiceResult>& choices,
                        const std::vector<json>& logprobs, const UsageCounts& usage) {
  json out = Head(head, "text_completion");
  json list = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceResult& c = choices[i];
    list.push_back({{"index", c.index},
                    {"text", c.text},
                    {"logprobs", i < logprobs.size() ? logprobs[i] : json()},
                    {"finish_reason", FinishReasonJson(c.finish)},
                    {"stop_reason", c.stop_reason}});
  }
  out["choices"] = std::move(list);
  out["usage"] = UsageJson(usage);
  return out;
}

json ChatResponse(const ResponseHead& head, const std::vector<ChoiceResult>& choices,
                  const std::vector<json>& logprobs, const UsageCounts& usage) {
  json out = Head(head, "chat.completion");
  json list = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceResult& c = choices[i];
    json message = {{"role", "assistant"}, {"content", c.text}};
    if (!c.tool_calls.empty()) {
      if (c.text.empty()) message["content"] = nullptr;
      message["tool_calls"] = ToolCallsJson(c.tool_calls);
    }
    list.push_back({{"index", c.index},
                    {"message", std::move(message)},
                    {"logprobs", i < logprobs.size() ? logprobs[i] : json()},
                    {"finish_reason", FinishReasonJson(c.finish, !c.tool_calls.empty())},
                    {"stop_reason", c.stop_reason}});
  }
  out["choices"] = std::move(list);
  out["usage"] = UsageJson(usage);
  return out;
}

json CompletionChunk(const ResponseHead& head, int index, std::string_view text,
                     const json& logprobs, v1::FinishReason finish, bool with_usage,
                     const json& stop_reason) {
  json out = Head(head, "text_completion");
  out["choices"] = json::array({{{"index", index},
                                 {"text", text},
                                 {"logprobs", logprobs},
                                 {"finish_reason", FinishReasonJson(finish)},
                                 {"stop_reason", stop_reason}}});
  if (with_usage) out["usage"] = nullptr;
  return out;
}

json ChatChunk(const ResponseHead& head, int index, const json& delta, const json& logprobs,
               v1::FinishReason finish, bool with_usage, const json& stop_reason) {
  json out = Head(head, "chat.completion.chunk");
  out["choices"] = json::array({{{"index", index},
                                 {"delta", delta},
                                 {"logprobs", logprobs},
                                 {"finish_reason", FinishReasonJson(finish)},
                                 {"stop_reason", stop_reason}}});
  if (with_usage) out["usage"] = nullptr;
  return out;
}

json UsageChunk(const ResponseHead& head, std::string_view object, const UsageCounts& usage) {
  json out = Head(head, object);
  out["choices"] = json::array();
  out["usage"] = UsageJson(usage);
  return out;
}

std::string JsonText(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string SseEvent(const json& event) {
  return "data: " + JsonText(event) + "\n\n";
}

}  // namespace tandem::openai
