// Reading the two generation bodies. Each field has one reader that checks its JSON type and its
// range; the error names the field as the client wrote it.
#include "coordinator/openai/request_parsing.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/bounded_json.h"
#include "common/step.h"
#include "common/utf8.h"
#include "coordinator/openai/api_error.h"
#include "coordinator/openai/structured_output.h"
#include "coordinator/request_validation.h"

namespace tandem::openai {
namespace {

// Objects keep the client's key order up to the chat template.
using json = nlohmann::ordered_json;

// Most choices one request may ask for (prompts x n).
constexpr int kMaxPromptChoices = 128;

std::string TypeName(const json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number_integer() || v.is_number_unsigned()) return "an integer";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  return "an object";
}

absl::Status WrongType(absl::string_view param, absl::string_view want, const json& got) {
  return InvalidField(param, absl::StrCat("must be ", want, ", got ", TypeName(got)));
}

// The body's fields; a field given as null counts as absent (OpenAI's clients send nulls).
class Fields {
 public:
  explicit Fields(const json& body) : body_(body) {}

  const json* Get(absl::string_view name) const {
    auto it = body_.find(name);
    if (it == body_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  absl::StatusOr<std::optional<bool>> Bool(absl::string_view name) const {
    const json* v = Get(name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_boolean()) return WrongType(name, "a boolean", *v);
    return v->get<bool>();
  }

  absl::StatusOr<std::optional<double>> Number(absl::string_view name, double lo,
                                               double hi) const {
    const json* v = Get(name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number()) return WrongType(name, "a number", *v);
    const double x = v->get<double>();
    if (!std::isfinite(x) || x < lo || x > hi) {
      return InvalidField(name, absl::StrFormat("must be in [%g, %g], got %g", lo, hi, x));
    }
    return x;
  }

  absl::StatusOr<std::optional<int64_t>> Integer(absl::string_view name, int64_t lo,
                                                 int64_t hi) const {
    const json* v = Get(name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number_integer() && !v->is_number_unsigned()) {
      return WrongType(name, "an integer", *v);
    }
    if (v->is_number_unsigned() &&
        v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return InvalidField(name, absl::StrFormat("must be in [%d, %d]", lo, hi));
    }
    const int64_t x = v->get<int64_t>();
    if (x < lo || x > hi) {
      return InvalidField(name, absl::StrFormat("must be in [%d, %d], got %d", lo, hi, x));
    }
    return x;
  }

  absl::StatusOr<std::optional<std::string>> String(absl::string_view name) const {
    const json* v = Get(name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) return WrongType(name, "a string", *v);
    return v->get<std::string>();
  }

  const json& body() const { return body_; }

 private:
  const json& body_;
};

#define ASSIGN_OR_RETURN_FIELD(lhs, expr) \
  auto lhs##_or = (expr);                 \
  if (!lhs##_or.ok()) return lhs##_or.status(); \
  auto lhs = *std::move(lhs##_or)

// A token id as JSON: an integer in int32's range (the vocabulary is checked later).
bool IsTokenId(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>() <= 0x7fffffffu;
  return v.is_number_integer() && v.get<int64_t>() >= std::numeric_limits<int32_t>::min() &&
         v.get<int64_t>() <= std::numeric_limits<int32_t>::max();
}

absl::StatusOr<std::vector<int32_t>> TokenList(const json& list, absl::string_view param) {
  if (list.empty()) return InvalidField(param, "is an empty list of token ids");
  std::vector<int32_t> ids;
  for (size_t i = 0; i < list.size(); ++i) {
    if (!IsTokenId(list[i])) {
      return InvalidField(absl::StrCat(param, "[", i, "]"),
                          absl::StrCat("must be a token id (an integer), got ",
                                       TypeName(list[i])));
    }
    ids.push_back(list[i].get<int32_t>());
  }
  return ids;
}

PromptInput TextPrompt(std::string text) {
  PromptInput p;
  p.text = std::move(text);
  return p;
}

PromptInput TokenPrompt(std::vector<int32_t> ids) {
  PromptInput p;
  p.token_ids = std::move(ids);
  p.is_tokens = true;
  return p;
}

// OpenAI's prompt: a string, a list of strings, a list of token ids, or a list of such lists.
absl::StatusOr<std::vector<PromptInput>> Prompts(const json* prompt) {
  if (prompt == nullptr) return InvalidField("prompt", "is required");
  std::vector<PromptInput> out;
  if (prompt->is_string()) {
    out.push_back(TextPrompt(prompt->get<std::string>()));
  } else if (prompt->is_array()) {
    if (prompt->empty()) return InvalidField("prompt", "is an empty list");
    const json& first = (*prompt)[0];
    if (first.is_number()) {
      ASSIGN_OR_RETURN_FIELD(ids, TokenList(*prompt, "prompt"));
      out.push_back(TokenPrompt(std::move(ids)));
    } else {
      for (size_t i = 0; i < prompt->size(); ++i) {
        const json& p = (*prompt)[i];
        const std::string param = absl::StrCat("prompt[", i, "]");
        if (p.is_string()) {
          out.push_back(TextPrompt(p.get<std::string>()));
        } else if (p.is_array()) {
          ASSIGN_OR_RETURN_FIELD(ids, TokenList(p, param));
          out.push_back(TokenPrompt(std::move(ids)));
        } else {
          return WrongType(param, "a string or a list of token ids", p);
        }
      }
    }
  } else {
    return WrongType("prompt", "a string, a list of strings or a list of token ids", *prompt);
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (!out[i].is_tokens && out[i].text.empty()) {
      return InvalidField(out.size() == 1 && prompt->is_string() ? std::string("prompt")
                                                                  : absl::StrCat("prompt[", i, "]"),
                          "is empty");
    }
  }
  return out;
}

// A message's content: a string, null (an assistant message with tool calls), or a list of parts
// of which only {"type": "text", "text": ...} is understood; the texts are joined by newlines.
absl::StatusOr<json> Content(const json& content, absl::string_view param) {
  if (content.is_null() || content.is_string()) return content;
  if (!content.is_array()) {
    return WrongType(param, "a string, null or a list of content parts", content);
  }
  std::vector<std::string> texts;
  for (size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string part_param = absl::StrCat(param, "[", i, "]");
    if (!part.is_object()) return WrongType(part_param, "a content part (an object)", part);
    auto type = part.find("type");
    if (type == part.end() || !type->is_string()) {
      return InvalidField(absl::StrCat(part_param, ".type"), "must be a string");
    }
    if (*type != "text") {
      return InvalidField(absl::StrCat(part_param, ".type"),
                          absl::StrCat("'", type->get<std::string>(),
                                       "' content is not supported; only 'text' is"));
    }
    auto text = part.find("text");
    if (text == part.end() || !text->is_string()) {
      return InvalidField(absl::StrCat(part_param, ".text"), "must be a string");
    }
    texts.push_back(text->get<std::string>());
  }
  return json(absl::StrJoin(texts, "\n"));
}

absl::StatusOr<json> Messages(const json* messages) {
  if (messages == nullptr) return InvalidField("messages", "is required");
  if (!messages->is_array()) return WrongType("messages", "a list of messages", *messages);
  if (messages->empty()) return InvalidField("messages", "is an empty list");
  json out = json::array();
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    const std::string param = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return WrongType(param, "a message (an object)", m);
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) {
      return InvalidField(absl::StrCat(param, ".role"), "must be a string");
    }
    static const char* kRoles[] = {"system", "developer", "user", "assistant", "tool"};
    bool known = false;
    for (const char* r : kRoles) known |= *role == r;
    if (!known) {
      return InvalidField(absl::StrCat(param, ".role"),
                          absl::StrCat("'", role->get<std::string>(),
                                       "' is not one of system, developer, user, assistant, tool"));
    }
    json message = m;
    auto content = m.find("content");
    if (content == m.end()) {
      if (*role != "assistant") {
        return InvalidField(absl::StrCat(param, ".content"), "is required");
      }
      message["content"] = nullptr;
    } else {
      ASSIGN_OR_RETURN_FIELD(text, Content(*content, absl::StrCat(param, ".content")));
      message["content"] = std::move(text);
    }
    out.push_back(std::move(message));
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> Stops(const json* stop) {
  std::vector<std::string> out;
  if (stop == nullptr) return out;
  if (stop->is_string()) {
    out.push_back(stop->get<std::string>());
  } else if (stop->is_array()) {
    for (size_t i = 0; i < stop->size(); ++i) {
      if (!(*stop)[i].is_string()) {
        return WrongType(absl::StrCat("stop[", i, "]"), "a string", (*stop)[i]);
      }
      out.push_back((*stop)[i].get<std::string>());
    }
  } else {
    return WrongType("stop", "a string or a list of strings", *stop);
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i].empty()) {
      return InvalidField(stop->is_string() ? std::string("stop") : absl::StrCat("stop[", i, "]"),
                          "is an empty string");
    }
  }
  return out;
}

// The fields both endpoints share.
absl::Status Common(const Fields& f, ApiRequest& r) {
  ASSIGN_OR_RETURN_FIELD(model, f.String("model"));
  r.model = model.value_or("");
  ASSIGN_OR_RETURN_FIELD(n, f.Integer("n", 1, tandem::kMaxChoices));
  r.n = static_cast<int>(n.value_or(1));
  ASSIGN_OR_RETURN_FIELD(stream, f.Bool("stream"));
  r.stream = stream.value_or(false);
  if (const json* so = f.Get("stream_options")) {
    if (!so->is_object()) return WrongType("stream_options", "an object", *so);
    if (!r.stream) {
      return InvalidField("stream_options", "is only allowed when stream is true");
    }
    auto iu = so->find("include_usage");
    if (iu != so->end() && !iu->is_null()) {
      if (!iu->is_boolean()) {
        return WrongType("stream_options.include_usage", "a boolean", *iu);
      }
      r.include_usage = iu->get<bool>();
    }
  }
  ASSIGN_OR_RETURN_FIELD(return_token_ids, f.Bool("return_token_ids"));
  r.return_token_ids = return_token_ids.value_or(false);
  ASSIGN_OR_RETURN_FIELD(tokens_as_ids, f.Bool("return_tokens_as_token_ids"));
  r.tokens_as_ids = tokens_as_ids.value_or(false);
  ASSIGN_OR_RETURN_FIELD(user, f.String("user"));
  (void)user;  // accepted for compatibility; tandem keeps no per-user state

  v1::GenerateRequest& g = r.generation;
  v1::SamplingParams& s = *g.mutable_sampling();
  ASSIGN_OR_RETURN_FIELD(temperature, f.Number("temperature", 0, 2));
  s.set_temperature(static_cast<float>(temperature.value_or(1.0)));
  ASSIGN_OR_RETURN_FIELD(top_p, f.Number("top_p", 0, 1));
  if (top_p.has_value()) {
    if (*top_p <= 0) return InvalidField("top_p", "must be in (0, 1], got 0");
    s.set_top_p(static_cast<float>(*top_p));
  }
  // vLLM: -1 (or 0) is no limit.
  ASSIGN_OR_RETURN_FIELD(top_k, f.Integer("top_k", -1, std::numeric_limits<int32_t>::max()));
  s.set_top_k(static_cast<int32_t>(std::max<int64_t>(top_k.value_or(0), 0)));
  ASSIGN_OR_RETURN_FIELD(min_p, f.Number("min_p", 0, 1));
  s.set_min_p(static_cast<float>(min_p.value_or(0)));
  ASSIGN_OR_RETURN_FIELD(presence, f.Number("presence_penalty", -2, 2));
  s.set_presence_penalty(static_cast<float>(presence.value_or(0)));
  ASSIGN_OR_RETURN_FIELD(frequency, f.Number("frequency_penalty", -2, 2));
  s.set_frequency_penalty(static_cast<float>(frequency.value_or(0)));
  ASSIGN_OR_RETURN_FIELD(repetition, f.Number("repetition_penalty", 0, 100));
  if (repetition.has_value()) {
    if (*repetition <= 0) return InvalidField("repetition_penalty", "must be > 0, got 0");
    s.set_repetition_penalty(static_cast<float>(*repetition));
  }
  ASSIGN_OR_RETURN_FIELD(seed, f.Integer("seed", std::numeric_limits<int64_t>::min(),
                                         std::numeric_limits<int64_t>::max()));
  if (seed.has_value()) r.seed = static_cast<uint64_t>(*seed);

  ASSIGN_OR_RETURN_FIELD(max_completion, f.Integer("max_completion_tokens", 1,
                                                   std::numeric_limits<int32_t>::max()));
  ASSIGN_OR_RETURN_FIELD(max_tokens,
                         f.Integer("max_tokens", 1, std::numeric_limits<int32_t>::max()));
  if (max_completion.has_value()) {
    g.set_max_new_tokens(static_cast<int32_t>(*max_completion));
  } else if (max_tokens.has_value()) {
    g.set_max_new_tokens(static_cast<int32_t>(*max_tokens));
  }
  ASSIGN_OR_RETURN_FIELD(stops, Stops(f.Get("stop")));
  for (std::string& stop : stops) g.add_stop(std::move(stop));
  if (const json* ids = f.Get("stop_token_ids")) {
    if (!ids->is_array()) return WrongType("stop_token_ids", "a list of token ids", *ids);
    for (size_t i = 0; i < ids->size(); ++i) {
      if (!IsTokenId((*ids)[i])) {
        return WrongType(absl::StrCat("stop_token_ids[", i, "]"), "a token id (an integer)",
                         (*ids)[i]);
      }
      g.add_stop_token_ids((*ids)[i].get<int32_t>());
    }
  }
  ASSIGN_OR_RETURN_FIELD(ignore_eos, f.Bool("ignore_eos"));
  g.set_ignore_eos(ignore_eos.value_or(false));
  ASSIGN_OR_RETURN_FIELD(min_tokens, f.Integer("min_tokens", 0, std::numeric_limits<int32_t>::max()));
  r.min_tokens = static_cast<int>(min_tokens.value_or(0));
  if (g.has_max_new_tokens() && r.min_tokens > g.max_new_tokens()) {
    return InvalidField("min_tokens", absl::StrFormat("%d is more than max_tokens (%d)",
                                                      r.min_tokens, g.max_new_tokens()));
  }

  // tandem's own: a deadline in seconds from arrival (504 when it passes).
  ASSIGN_OR_RETURN_FIELD(timeout, f.Number("timeout", 0, 86400));
  if (timeout.has_value()) {
    if (*timeout <= 0) return InvalidField("timeout", "must be > 0 seconds, got 0");
    g.set_timeout_ms(static_cast<uint32_t>(std::max(1.0, std::round(*timeout * 1000))));
  }

  // What tandem does not do is refused rather than silently ignored.
  if (const json* bias = f.Get("logit_bias"); bias != nullptr && !bias->empty()) {
    return InvalidField("logit_bias", "is not supported");
  }
  ASSIGN_OR_RETURN_FIELD(best_of, f.Integer("best_of", 1, tandem::kMaxChoices));
  if (best_of.has_value() && *best_of != r.n) {
    return InvalidField("best_of", "is not supported (other than equal to n)");
  }
  return ParseOutputConstraint(f.body(), *g.mutable_constraint());
}


// What a chat template sees: messages, tools, chat_template_kwargs and the two flags that shape
// the prompt's end (chat requests and /tokenize with messages).
absl::Status Conversation(const Fields& f, ApiRequest& r) {
  ASSIGN_OR_RETURN_FIELD(messages, Messages(f.Get("messages")));
  r.messages = std::move(messages);
  if (const json* tools = f.Get("tools")) {
    if (!tools->is_array()) return WrongType("tools", "a list of tools", *tools);
    if (absl::Status s = CheckTools(*tools); !s.ok()) return s;
    r.tools = *tools;
  }
  ASSIGN_OR_RETURN_FIELD(add_gen, f.Bool("add_generation_prompt"));
  ASSIGN_OR_RETURN_FIELD(continue_final, f.Bool("continue_final_message"));
  r.continue_final_message = continue_final.value_or(false);
  if (r.continue_final_message) {
    // As vLLM: the prompt cannot both leave the last message open and start a new one.
    if (add_gen.value_or(false)) {
      return InvalidField("continue_final_message",
                          "cannot be true together with add_generation_prompt true; set "
                          "add_generation_prompt to false");
    }
    const json& last = r.messages.back();
    if (!last["content"].is_string()) {
      return InvalidField(absl::StrCat("messages[", r.messages.size() - 1, "].content"),
                          "must be text for continue_final_message to continue it");
    }
  }
  r.add_generation_prompt = add_gen.value_or(!r.continue_final_message);
  if (absl::Status s = NormalizeToolMessages(r.messages); !s.ok()) return s;
  r.template_kwargs = json::object();
  if (const json* kw = f.Get("chat_template_kwargs")) {
    if (!kw->is_object()) return WrongType("chat_template_kwargs", "an object", *kw);
    r.template_kwargs = *kw;
  }
  return absl::OkStatus();
}

// tool_choice; "required" and a named function constrain the output to a call (vLLM's way).
absl::Status ForceToolCall(const Fields& f, ApiRequest& r) {
  ASSIGN_OR_RETURN_FIELD(choice, ParseToolChoice(f.Get("tool_choice"), r.tools));
  r.tool_choice = std::move(choice);
  ASSIGN_OR_RETURN_FIELD(parallel, f.Bool("parallel_tool_calls"));
  const std::string schema = ForcedCallSchema(r.tool_choice, r.tools, parallel.value_or(true));
  if (schema.empty()) return absl::OkStatus();
  if (r.generation.has_constraint() &&
      r.generation.constraint().kind_case() != v1::OutputConstraint::KIND_NOT_SET) {
    return InvalidField("tool_choice", "cannot force a tool call together with response_format; "
                                       "drop one of them");
  }
  r.generation.mutable_constraint()->set_json_schema(schema);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<json> ParseJsonBody(absl::string_view body) {
  if (absl::Status utf8 = CheckUtf8("the request body", std::string_view(body.data(), body.size()));
      !utf8.ok()) {
    return utf8;
  }
  const std::string_view text(body.data(), body.size());
  if (const std::string path = FirstTooDeepPath(text); !path.empty()) {
    return InvalidField(path, absl::StrCat("nests deeper than ", kMaxJsonDepth,
                                           " levels of arrays and objects, the most a request may "
                                           "nest (real tool schemas and messages nest far less)"));
  }
  json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    return absl::InvalidArgumentError("the request body is not valid JSON");
  }
  if (!parsed.is_object()) {
    return absl::InvalidArgumentError("the request body must be a JSON object");
  }
  return parsed;
}

absl::StatusOr<ApiRequest> ParseCompletionRequest(absl::string_view body) {
  ASSIGN_OR_RETURN_FIELD(parsed, ParseJsonBody(body));
  const Fields f(parsed);
  ApiRequest r;
  r.endpoint = Endpoint::kCompletions;
  ASSIGN_OR_RETURN_FIELD(prompts, Prompts(f.Get("prompt")));
  r.prompts = std::move(prompts);
  if (absl::Status s = Common(f, r); !s.ok()) return s;
  if (!r.generation.has_max_new_tokens()) r.generation.set_max_new_tokens(16);
  if (static_cast<int>(r.prompts.size()) * r.n > kMaxPromptChoices) {
    return InvalidField("n", absl::StrFormat("%d prompts x n = %d exceeds %d choices",
                                             r.prompts.size(), r.prompts.size() * r.n,
                                             kMaxPromptChoices));
  }
  ASSIGN_OR_RETURN_FIELD(logprobs, f.Integer("logprobs", 0, kMaxTopLogprobs));
  if (logprobs.has_value()) r.logprobs = static_cast<int>(*logprobs);
  ASSIGN_OR_RETURN_FIELD(echo, f.Bool("echo"));
  r.echo = echo.value_or(false);
  ASSIGN_OR_RETURN_FIELD(suffix, f.String("suffix"));
  if (suffix.has_value() && !suffix->empty()) return InvalidField("suffix", "is not supported");
  return r;
}

absl::StatusOr<ApiRequest> ParseChatRequest(absl::string_view body) {
  ASSIGN_OR_RETURN_FIELD(parsed, ParseJsonBody(body));
  const Fields f(parsed);
  ApiRequest r;
  r.endpoint = Endpoint::kChat;
  if (absl::Status s = Conversation(f, r); !s.ok()) return s;
  if (absl::Status s = Common(f, r); !s.ok()) return s;
  if (absl::Status s = ForceToolCall(f, r); !s.ok()) return s;
  ASSIGN_OR_RETURN_FIELD(logprobs, f.Bool("logprobs"));
  ASSIGN_OR_RETURN_FIELD(top, f.Integer("top_logprobs", 0, kMaxTopLogprobs));
  if (top.has_value() && !logprobs.value_or(false)) {
    return InvalidField("top_logprobs", "requires logprobs to be true");
  }
  if (logprobs.value_or(false)) r.logprobs = static_cast<int>(top.value_or(0));
  return r;
}

absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(absl::string_view body) {
  ASSIGN_OR_RETURN_FIELD(parsed, ParseJsonBody(body));
  const Fields f(parsed);
  TokenizeRequest r;
  const json* prompt = f.Get("prompt");
  const json* messages = f.Get("messages");
  if (prompt != nullptr && messages != nullptr) {
    return InvalidField("messages", "give either prompt or messages, not both");
  }
  if (messages != nullptr) {
    r.chat = true;
    r.conversation.endpoint = Endpoint::kChat;
    if (absl::Status s = Conversation(f, r.conversation); !s.ok()) return s;
  } else {
    ASSIGN_OR_RETURN_FIELD(text, f.String("prompt"));
    if (!text.has_value()) return InvalidField("prompt", "is required (or give messages)");
    r.prompt = *std::move(text);
  }
  ASSIGN_OR_RETURN_FIELD(model, f.String("model"));
  r.conversation.model = model.value_or("");
  ASSIGN_OR_RETURN_FIELD(special, f.Bool("add_special_tokens"));
  r.add_special_tokens = special.value_or(!r.chat);
  return r;
}

v1::GenerateRequest PromptRequest(const ApiRequest& request, const std::vector<int32_t>& prompt) {
  v1::GenerateRequest g = request.generation;
  g.mutable_token_ids()->Assign(prompt.begin(), prompt.end());
  v1::SamplingParams& s = *g.mutable_sampling();
  s.set_n(request.n);
  if (request.seed.has_value()) s.set_seed(*request.seed);
  if (request.logprobs.has_value()) {
    s.set_logprobs(true);
    s.set_top_logprobs(*request.logprobs);
    if (request.echo) {
      s.set_prompt_logprobs(true);
      s.set_prompt_top_logprobs(*request.logprobs);
    }
  }
  return g;
}

absl::Status ToApiError(const absl::Status& status, Endpoint endpoint,
                        absl::string_view prompt_param) {
  if (status.code() != absl::StatusCode::kInvalidArgument || !ParamOf(status).empty()) {
    return status;
  }
  // ValidateRequest's messages start with the proto field: "sampling.top_p: ...",
  // "token_ids[3]: ...", "max_new_tokens: ...".
  const absl::string_view message = status.message();
  const absl::string_view field = message.substr(0, message.find_first_of(":["));
  static const std::pair<absl::string_view, absl::string_view> kNames[] = {
      {"max_new_tokens", "max_tokens"},
      {"sampling.temperature", "temperature"},
      {"sampling.top_k", "top_k"},
      {"sampling.top_p", "top_p"},
      {"sampling.min_p", "min_p"},
      {"sampling.presence_penalty", "presence_penalty"},
      {"sampling.frequency_penalty", "frequency_penalty"},
      {"sampling.repetition_penalty", "repetition_penalty"},
      {"sampling.seed", "seed"},
      {"stop_token_ids", "stop_token_ids"},
      {"stop", "stop"},
  };
  std::string param;
  if (field == "token_ids" || field == "prompt") param = std::string(prompt_param);
  if (field == "sampling.top_logprobs" || field == "sampling.logprobs") {
    param = endpoint == Endpoint::kChat ? "top_logprobs" : "logprobs";
  }
  if (field == "sampling.prompt_logprobs" || field == "sampling.prompt_top_logprobs") {
    param = "echo";
  }
  for (const auto& [proto_name, api_name] : kNames) {
    if (field == proto_name) param = std::string(api_name);
  }
  if (param.empty()) return status;
  // "token_ids[3]: 70000 is outside ..." -> "prompt[3]: 70000 is outside ..."
  absl::string_view rest = message.substr(field.size());
  std::string named = absl::StrCat(param, rest);
  if (endpoint == Endpoint::kChat && param == "messages" && !rest.empty() && rest[0] == '[') {
    named = absl::StrCat("messages: the rendered conversation's token ", rest);
  }
  // The param is the field itself, without the element index the message names.
  return InvalidFieldMessage(param, named);
}

}  // namespace tandem::openai
