// The Responses API over the chat path: requests translated in, answers translated out.
#include "coordinator/openai/responses_api.h"

#include <atomic>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "coordinator/openai/api_error.h"
#include "coordinator/request_group.h"

namespace tandem::openai {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

std::string NewResponsesId(std::string_view prefix) {
  static std::atomic<uint64_t> counter{0};
  return absl::StrFormat("%s_%016x%06x", prefix, FreshSeed(), counter.fetch_add(1) + 1);
}

std::string Text(const ordered_json& v) {
  return v.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

const ordered_json* Field(const ordered_json& object, std::string_view name) {
  auto it = object.find(name);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::StatusOr<std::string> StringField(const ordered_json& object, std::string_view name,
                                        const std::string& param) {
  const ordered_json* v = Field(object, name);
  if (v == nullptr || !v->is_string()) return InvalidField(param, "must be a string");
  return v->get<std::string>();
}

// A message's or a call output's content: a string, or parts of text (input_text, output_text)
// joined by newlines.
absl::StatusOr<std::string> ContentText(const ordered_json& content, const std::string& param) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) return InvalidField(param, "must be a string or a list of text parts");
  std::vector<std::string> texts;
  for (size_t j = 0; j < content.size(); ++j) {
    const ordered_json& part = content[j];
    const std::string part_param = absl::StrCat(param, "[", j, "]");
    const ordered_json* type = part.is_object() ? Field(part, "type") : nullptr;
    if (type == nullptr || !type->is_string() ||
        (*type != "input_text" && *type != "output_text")) {
      return InvalidField(absl::StrCat(part_param, ".type"),
                          "only input_text and output_text parts are supported");
    }
    absl::StatusOr<std::string> text = StringField(part, "text", absl::StrCat(part_param, ".text"));
    if (!text.ok()) return text.status();
    texts.push_back(*std::move(text));
  }
  return absl::StrJoin(texts, "\n");
}

// `input` as chat messages, after `instructions` as a system message.
absl::StatusOr<ordered_json> Messages(const ordered_json& body) {
  ordered_json messages = ordered_json::array();
  if (const ordered_json* instructions = Field(body, "instructions")) {
    if (!instructions->is_string()) return InvalidField("instructions", "must be a string");
    messages.push_back({{"role", "system"}, {"content", *instructions}});
  }
  const ordered_json* input = Field(body, "input");
  if (input == nullptr) return InvalidField("input", "is required");
  if (input->is_string()) {
    messages.push_back({{"role", "user"}, {"content", *input}});
    return messages;
  }
  if (!input->is_array() || input->empty()) {
    return InvalidField("input", "must be a string or a non-empty list of items");
  }
  for (size_t i = 0; i < input->size(); ++i) {
    const ordered_json& item = (*input)[i];
    const std::string param = absl::StrCat("input[", i, "]");
    if (!item.is_object()) return InvalidField(param, "must be an item (an object)");
    const ordered_json* type = Field(item, "type");
    if (type != nullptr && !type->is_string()) {
      return InvalidField(absl::StrCat(param, ".type"), "must be a string");
    }
    const std::string kind = type != nullptr ? type->get<std::string>() : "message";
    if (kind == "message") {
      absl::StatusOr<std::string> role = StringField(item, "role", absl::StrCat(param, ".role"));
      if (!role.ok()) return role.status();
      if (*role != "user" && *role != "system" && *role != "developer" && *role != "assistant") {
        return InvalidField(absl::StrCat(param, ".role"),
                            "must be one of user, system, developer, assistant");
      }
      const ordered_json* content = Field(item, "content");
      if (content == nullptr) return InvalidField(absl::StrCat(param, ".content"), "is required");
      absl::StatusOr<std::string> text = ContentText(*content, absl::StrCat(param, ".content"));
      if (!text.ok()) return text.status();
      messages.push_back({{"role", *role}, {"content", *text}});
    } else if (kind == "function_call") {
      absl::StatusOr<std::string> call_id =
          StringField(item, "call_id", absl::StrCat(param, ".call_id"));
      if (!call_id.ok()) return call_id.status();
      absl::StatusOr<std::string> name = StringField(item, "name", absl::StrCat(param, ".name"));
      if (!name.ok()) return name.status();
      absl::StatusOr<std::string> arguments =
          StringField(item, "arguments", absl::StrCat(param, ".arguments"));
      if (!arguments.ok()) return arguments.status();
      if (!ordered_json::accept(*arguments)) {
        return InvalidField(absl::StrCat(param, ".arguments"), "must be a JSON object's text");
      }
      ordered_json call = {{"id", *call_id},
                           {"type", "function"},
                           {"function", {{"name", *name}, {"arguments", *arguments}}}};
      // Calls of one turn follow the assistant's text (or each other): one assistant message.
      if (messages.empty() || messages.back()["role"] != "assistant") {
        messages.push_back({{"role", "assistant"}, {"content", nullptr}});
      }
      messages.back()["tool_calls"].push_back(std::move(call));
    } else if (kind == "function_call_output") {
      absl::StatusOr<std::string> call_id =
          StringField(item, "call_id", absl::StrCat(param, ".call_id"));
      if (!call_id.ok()) return call_id.status();
      const ordered_json* output = Field(item, "output");
      if (output == nullptr) return InvalidField(absl::StrCat(param, ".output"), "is required");
      absl::StatusOr<std::string> text = ContentText(*output, absl::StrCat(param, ".output"));
      if (!text.ok()) return text.status();
      messages.push_back({{"role", "tool"}, {"tool_call_id", *call_id}, {"content", *text}});
    } else {
      return InvalidField(absl::StrCat(param, ".type"),
                          absl::StrCat("'", kind,
                                       "' items are not supported; message, function_call and "
                                       "function_call_output are"));
    }
  }
  return messages;
}

// Function tools in chat's shape ({type, function: {name, description, parameters, strict}}).
absl::StatusOr<ordered_json> Tools(const ordered_json& tools) {
  if (!tools.is_array()) return InvalidField("tools", "must be a list of tools");
  ordered_json out = ordered_json::array();
  for (size_t i = 0; i < tools.size(); ++i) {
    const ordered_json& tool = tools[i];
    const std::string param = absl::StrCat("tools[", i, "]");
    const ordered_json* type = tool.is_object() ? Field(tool, "type") : nullptr;
    if (type == nullptr || *type != "function") {
      return InvalidField(absl::StrCat(param, ".type"),
                          absl::StrCat("only function tools are supported (built-in tools such "
                                       "as web_search or file_search are not)"));
    }
    ordered_json function = ordered_json::object();
    for (const char* key : {"name", "description", "parameters", "strict"}) {
      if (const ordered_json* v = Field(tool, key)) function[key] = *v;
    }
    out.push_back({{"type", "function"}, {"function", std::move(function)}});
  }
  return out;
}

// The error of the chat request's parse named by the Responses API's fields.
absl::Status Renamed(const absl::Status& status) {
  std::string param = ParamOf(status);
  if (param.empty()) return status;
  std::string message(status.message());
  auto rename = [&](const std::string& from, const std::string& to) {
    if (!param.starts_with(from)) return;
    param = absl::StrCat(to, param.substr(from.size()));
    if (message.starts_with(from)) message = absl::StrCat(to, message.substr(from.size()));
  };
  rename("max_tokens", "max_output_tokens");
  rename("messages", "input");
  if (param.starts_with("tools[")) {
    const size_t dot = param.find("].function");
    if (dot != std::string::npos) {
      const std::string from = param.substr(0, dot + std::strlen("].function"));
      rename(from, from.substr(0, dot + 1));
    }
  }
  rename("tool_choice.function.name", "tool_choice.name");
  return InvalidFieldMessage(param, message);
}

// Chat's usage in the Responses API's names.
ordered_json UsageOf(const json& usage) {
  const int input = usage.value("prompt_tokens", 0);
  const int output = usage.value("completion_tokens", 0);
  return {{"input_tokens", input},
          {"input_tokens_details", {{"cached_tokens", 0}}},
          {"output_tokens", output},
          {"output_tokens_details", {{"reasoning_tokens", 0}}},
          {"total_tokens", input + output}};
}

// Streamed chat chunks turned into the Responses API's events, written through to `inner`.
class Adapter : public HttpExchange {
 public:
  Adapter(std::shared_ptr<HttpExchange> inner, ordered_json echo)
      : inner_(std::move(inner)), echo_(std::move(echo)), id_(NewResponsesId("resp")) {}

  void Respond(HttpResponse response) override {
    if (response.status == 200) {
      const json chat = json::parse(response.body, nullptr, false);
      if (!chat.is_discarded()) response.body = Text(ResponseOfChat(chat, echo_, id_));
    }
    inner_->Respond(std::move(response));
  }

  void StartStream(HttpResponse head) override {
    inner_->StartStream(std::move(head));
    absl::MutexLock lock(&mu_);
    ordered_json response = Response("in_progress");
    Emit("response.created", {{"response", response}});
    Emit("response.in_progress", {{"response", std::move(response)}});
  }

  bool Write(std::string_view data) override {
    absl::MutexLock lock(&mu_);
    // The chat path writes one `data: ...\n\n` event per call.
    for (absl::string_view split :
         absl::StrSplit(absl::string_view(data.data(), data.size()), "\n\n", absl::SkipEmpty())) {
      std::string_view event(split.data(), split.size());
      if (!event.starts_with("data: ")) continue;
      event.remove_prefix(6);
      if (event == "[DONE]") {
        Complete();
        continue;
      }
      const json chunk = json::parse(event, nullptr, false);
      if (chunk.is_object()) Take(chunk);
    }
    return !gone_;
  }

  void End() override { inner_->End(); }
  bool ClientGone() override { return inner_->ClientGone(); }

 private:
  enum class Open { kNothing, kMessage, kCall };

  void Emit(std::string_view type, const ordered_json& fields) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ordered_json event = {{"type", type}, {"sequence_number", sequence_++}};
    for (const auto& [key, value] : fields.items()) event[key] = value;
    const std::string text =
        absl::StrCat("event: ", std::string(type), "\ndata: ", Text(event), "\n\n");
    if (!gone_ && !inner_->Write(text)) gone_ = true;
  }

  ordered_json Response(std::string_view status) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ordered_json r = ResponseOfChat(json(), echo_, id_);
    r["created_at"] = created_;
    r["status"] = status;
    r["output"] = output_;
    if (status == "in_progress") r["usage"] = nullptr;
    return r;
  }

  void Take(const json& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (chunk.contains("error")) {
      const json& e = chunk["error"];
      Emit("error", {{"code", e.value("code", json())},
                     {"message", e.value("message", "")},
                     {"param", e.value("param", json())}});
      failed_ = true;
      Emit("response.failed", {{"response", Response("failed")}});
      return;
    }
    if (chunk.contains("usage") && chunk["usage"].is_object()) usage_ = chunk["usage"];
    if (!chunk.contains("choices") || chunk["choices"].empty()) return;
    const json& choice = chunk["choices"][0];
    if (choice.contains("finish_reason") && choice["finish_reason"].is_string()) {
      finish_ = choice["finish_reason"];
    }
    const json& delta = choice.value("delta", json::object());
    if (delta.contains("content") && delta["content"].is_string() &&
        !delta["content"].get_ref<const std::string&>().empty()) {
      if (open_ != Open::kMessage) OpenMessage();
      text_ += delta["content"].get<std::string>();
      Emit("response.output_text.delta", {{"item_id", item_id_},
                                          {"output_index", output_.size()},
                                          {"content_index", 0},
                                          {"delta", delta["content"]},
                                          {"logprobs", ordered_json::array()}});
    }
    if (delta.contains("tool_calls")) {
      for (const json& call : delta["tool_calls"]) {
        if (call.contains("id")) OpenCall(call);
        const std::string piece = call["function"].value("arguments", "");
        if (piece.empty() || open_ != Open::kCall) continue;
        arguments_ += piece;
        Emit("response.function_call_arguments.delta",
             {{"item_id", item_id_}, {"output_index", output_.size()}, {"delta", piece}});
      }
    }
  }

  void OpenMessage() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    CloseItem();
    open_ = Open::kMessage;
    item_id_ = NewResponsesId("msg");
    text_.clear();
    Emit("response.output_item.added", {{"output_index", output_.size()},
                                        {"item",
                                         {{"id", item_id_},
                                          {"type", "message"},
                                          {"status", "in_progress"},
                                          {"role", "assistant"},
                                          {"content", ordered_json::array()}}}});
    Emit("response.content_part.added",
         {{"item_id", item_id_},
          {"output_index", output_.size()},
          {"content_index", 0},
          {"part",
           {{"type", "output_text"}, {"text", ""}, {"annotations", ordered_json::array()}}}});
  }

  void OpenCall(const json& call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    CloseItem();
    open_ = Open::kCall;
    item_id_ = NewResponsesId("fc");
    call_id_ = call.value("id", "");
    name_ = call["function"].value("name", "");
    arguments_.clear();
    Emit("response.output_item.added", {{"output_index", output_.size()},
                                        {"item",
                                         {{"id", item_id_},
                                          {"type", "function_call"},
                                          {"status", "in_progress"},
                                          {"arguments", ""},
                                          {"call_id", call_id_},
                                          {"name", name_}}}});
  }

  void CloseItem() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (open_ == Open::kMessage) {
      const ordered_json part = {
          {"type", "output_text"}, {"text", text_}, {"annotations", ordered_json::array()}};
      Emit("response.output_text.done", {{"item_id", item_id_},
                                         {"output_index", output_.size()},
                                         {"content_index", 0},
                                         {"text", text_},
                                         {"logprobs", ordered_json::array()}});
      Emit("response.content_part.done", {{"item_id", item_id_},
                                          {"output_index", output_.size()},
                                          {"content_index", 0},
                                          {"part", part}});
      ordered_json item = {{"id", item_id_},
                           {"type", "message"},
                           {"status", "completed"},
                           {"role", "assistant"},
                           {"content", ordered_json::array({part})}};
      Emit("response.output_item.done", {{"output_index", output_.size()}, {"item", item}});
      output_.push_back(std::move(item));
    } else if (open_ == Open::kCall) {
      Emit("response.function_call_arguments.done",
           {{"item_id", item_id_}, {"output_index", output_.size()}, {"arguments", arguments_}});
      ordered_json item = {{"id", item_id_},        {"type", "function_call"},
                           {"status", "completed"}, {"arguments", arguments_},
                           {"call_id", call_id_},   {"name", name_}};
      Emit("response.output_item.done", {{"output_index", output_.size()}, {"item", item}});
      output_.push_back(std::move(item));
    }
    open_ = Open::kNothing;
  }

  void Complete() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (failed_) return;
    // A reply with no text and no calls still has its (empty) message.
    if (open_ == Open::kNothing && output_.empty()) OpenMessage();
    CloseItem();
    const bool cut = finish_ == "length";
    ordered_json response = Response(cut ? "incomplete" : "completed");
    if (cut) response["incomplete_details"] = {{"reason", "max_output_tokens"}};
    if (usage_.is_object()) response["usage"] = UsageOf(usage_);
    Emit(cut ? "response.incomplete" : "response.completed", {{"response", std::move(response)}});
  }

  const std::shared_ptr<HttpExchange> inner_;
  const ordered_json echo_;
  const std::string id_;
  const int64_t created_ = absl::ToUnixSeconds(absl::Now());
  absl::Mutex mu_;
  int64_t sequence_ ABSL_GUARDED_BY(mu_) = 0;
  ordered_json output_ ABSL_GUARDED_BY(mu_) = ordered_json::array();  // items done
  Open open_ ABSL_GUARDED_BY(mu_) = Open::kNothing;
  std::string item_id_ ABSL_GUARDED_BY(mu_);
  std::string text_ ABSL_GUARDED_BY(mu_);     // the open message's text
  std::string call_id_ ABSL_GUARDED_BY(mu_);  // the open call's
  std::string name_ ABSL_GUARDED_BY(mu_);
  std::string arguments_ ABSL_GUARDED_BY(mu_);
  std::string finish_ ABSL_GUARDED_BY(mu_);  // the chat finish_reason
  json usage_ ABSL_GUARDED_BY(mu_);
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  bool gone_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

absl::StatusOr<ResponsesRequest> ParseResponsesRequest(std::string_view body) {
  absl::StatusOr<ordered_json> parsed = ParseJsonBody(absl::string_view(body.data(), body.size()));
  if (!parsed.ok()) return parsed.status();
  const ordered_json& b = *parsed;
  // What needs stored state or produces what tandem does not.
  for (const char* name : {"previous_response_id", "conversation", "prompt", "reasoning",
                           "top_logprobs", "prompt_cache_key"}) {
    if (Field(b, name) != nullptr) {
      return InvalidField(name,
                          "is not supported (this server stores no responses and "
                          "produces text and function calls only)");
    }
  }
  if (const ordered_json* background = Field(b, "background");
      background != nullptr && *background != false) {
    return InvalidField("background", "is not supported; leave it false");
  }
  if (const ordered_json* include = Field(b, "include");
      include != nullptr && !(include->is_array() && include->empty())) {
    return InvalidField("include", "is not supported (no extra output is produced)");
  }
  if (const ordered_json* text = Field(b, "text")) {
    const ordered_json* format = text->is_object() ? Field(*text, "format") : nullptr;
    const ordered_json* type =
        format != nullptr && format->is_object() ? Field(*format, "type") : nullptr;
    if (format != nullptr && (type == nullptr || *type != "text")) {
      return InvalidField("text.format", "only {\"type\": \"text\"} is supported");
    }
  }

  ordered_json chat = ordered_json::object();
  absl::StatusOr<ordered_json> messages = Messages(b);
  if (!messages.ok()) return messages.status();
  chat["messages"] = *std::move(messages);
  ordered_json echo = {{"instructions", b.value("instructions", ordered_json())},
                       {"tools", ordered_json::array()},
                       {"tool_choice", "auto"}};
  if (const ordered_json* tools = Field(b, "tools")) {
    absl::StatusOr<ordered_json> converted = Tools(*tools);
    if (!converted.ok()) return converted.status();
    chat["tools"] = *std::move(converted);
    echo["tools"] = *tools;
  }
  if (const ordered_json* choice = Field(b, "tool_choice")) {
    echo["tool_choice"] = *choice;
    const ordered_json* type = choice->is_object() ? Field(*choice, "type") : nullptr;
    if (type != nullptr && *type == "function" && choice->contains("name")) {
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", (*choice)["name"]}}}};
    } else {
      chat["tool_choice"] = *choice;
    }
  }
  for (const char* name :
       {"model", "temperature", "top_p", "stream", "user", "parallel_tool_calls"}) {
    if (const ordered_json* v = Field(b, name)) chat[name] = *v;
  }
  if (const ordered_json* max = Field(b, "max_output_tokens")) chat["max_tokens"] = *max;
  if (const ordered_json* stream = Field(b, "stream"); stream != nullptr && *stream == true) {
    chat["stream_options"] = {{"include_usage", true}};
  }

  absl::StatusOr<ApiRequest> api = ParseChatRequest(Text(chat));
  if (!api.ok()) return Renamed(api.status());
  echo["temperature"] = b.value("temperature", ordered_json(1.0));
  echo["top_p"] = b.value("top_p", ordered_json(1.0));
  echo["max_output_tokens"] = b.value("max_output_tokens", ordered_json());
  echo["parallel_tool_calls"] = b.value("parallel_tool_calls", ordered_json(true));
  echo["metadata"] = b.value("metadata", ordered_json::object());
  echo["store"] = false;
  return ResponsesRequest{*std::move(api), std::move(echo)};
}

ordered_json ResponseOfChat(const json& chat, const ordered_json& echo, std::string_view id) {
  ordered_json output = ordered_json::array();
  std::string status = "completed";
  ordered_json incomplete = nullptr;
  if (chat.is_object() && chat.contains("choices") && !chat["choices"].empty()) {
    const json& choice = chat["choices"][0];
    const json& message = choice["message"];
    const bool has_text = message["content"].is_string();
    const bool has_calls = message.contains("tool_calls") && !message["tool_calls"].empty();
    if (has_text || !has_calls) {
      output.push_back(
          {{"id", NewResponsesId("msg")},
           {"type", "message"},
           {"status", "completed"},
           {"role", "assistant"},
           {"content", ordered_json::array({{{"type", "output_text"},
                                             {"text", has_text ? message["content"] : json("")},
                                             {"annotations", ordered_json::array()}}})}});
    }
    if (has_calls) {
      for (const json& call : message["tool_calls"]) {
        output.push_back({{"id", NewResponsesId("fc")},
                          {"type", "function_call"},
                          {"status", "completed"},
                          {"arguments", call["function"]["arguments"]},
                          {"call_id", call["id"]},
                          {"name", call["function"]["name"]}});
      }
    }
    if (choice["finish_reason"] == "length") {
      status = "incomplete";
      incomplete = {{"reason", "max_output_tokens"}};
    }
  }
  ordered_json r = {
      {"id", id},
      {"object", "response"},
      {"created_at", chat.is_object() ? chat.value("created", int64_t{0}) : int64_t{0}},
      {"status", status},
      {"error", nullptr},
      {"incomplete_details", incomplete},
      {"model",
       chat.is_object() ? chat.value("model", echo.value("model", "")) : echo.value("model", "")},
      {"output", std::move(output)}};
  for (const auto& [key, value] : echo.items()) {
    if (key != "model") r[key] = value;
  }
  r["previous_response_id"] = nullptr;
  r["reasoning"] = nullptr;
  r["text"] = {{"format", {{"type", "text"}}}};
  r["truncation"] = "disabled";
  r["usage"] = chat.is_object() && chat.contains("usage") ? UsageOf(chat["usage"]) : ordered_json();
  return r;
}

void HandleResponses(GenerationHandler& generation, std::string_view model_name,
                     const HttpRequest& req, std::shared_ptr<HttpExchange> exchange) {
  absl::StatusOr<ResponsesRequest> r = ParseResponsesRequest(req.body);
  if (!r.ok()) {
    HttpResponse res;
    SetError(res, r.status());
    return exchange->Respond(std::move(res));
  }
  r->echo["model"] = std::string(model_name);
  generation.Serve(std::move(r->chat), ResponsesExchange(std::move(exchange), std::move(r->echo)));
}

std::shared_ptr<HttpExchange> ResponsesExchange(std::shared_ptr<HttpExchange> inner,
                                                ordered_json echo) {
  return std::make_shared<Adapter>(std::move(inner), std::move(echo));
}

}  // namespace tandem::openai
