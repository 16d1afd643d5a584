// Tool definitions, tool_choice, the tool parts of messages, and the three call formats.
#include "coordinator/openai/tool_calls.h"

#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "coordinator/openai/api_error.h"
#include "coordinator/request_group.h"

namespace tandem::openai {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr std::string_view kHermesOpen = "<tool_call>";
constexpr std::string_view kHermesClose = "</tool_call>";
constexpr std::string_view kPythonTag = "<|python_tag|>";
constexpr std::string_view kMistralCalls = "[TOOL_CALLS]";

bool IsFunctionName(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-' && c != '.') {
      return false;
    }
  }
  return true;
}

// One past the end of the JSON object or array that starts at text[start] ('{' or '['); npos when
// the text ends first. Strings and their escapes are skipped, so braces inside them do not count.
size_t JsonValueEnd(std::string_view text, size_t start) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = start; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      if (--depth == 0) return i + 1;
    }
  }
  return std::string_view::npos;
}

// {"name": ..., <args_key>: {...}} (the other spelling of the arguments' key is taken too, and a
// string holding an object, as some models write it); nullopt when it is not a call.
std::optional<ToolCall> CallOf(const json& v, ToolCallFormat format) {
  if (!v.is_object()) return std::nullopt;
  auto name = v.find("name");
  if (name == v.end() || !name->is_string() || name->get_ref<const std::string&>().empty()) {
    return std::nullopt;
  }
  auto args = v.find("arguments");
  if (args == v.end()) args = v.find("parameters");
  json arguments = json::object();
  if (args != v.end()) {
    arguments = *args;
    if (arguments.is_string()) {
      arguments = json::parse(arguments.get_ref<const std::string&>(), nullptr, false);
    }
    if (!arguments.is_object()) return std::nullopt;
  }
  return ToolCall{NewToolCallId(format), name->get<std::string>(), arguments.dump()};
}

// The calls in `text`: JSON values separated by `separator` (and whitespace); each an object that
// is a call, or (`arrays`) an array of them. nullopt when anything there is not.
std::optional<std::vector<ToolCall>> CallList(std::string_view text, char separator, bool arrays,
                                              ToolCallFormat format) {
  std::vector<ToolCall> calls;
  size_t at = 0;
  while (true) {
    while (at < text.size() && absl::ascii_isspace(static_cast<unsigned char>(text[at]))) ++at;
    if (at == text.size()) break;
    if (!calls.empty()) {
      if (text[at] != separator) return std::nullopt;
      ++at;
      while (at < text.size() && absl::ascii_isspace(static_cast<unsigned char>(text[at]))) ++at;
    }
    if (at == text.size() || (text[at] != '{' && !(arrays && text[at] == '['))) {
      return std::nullopt;
    }
    const size_t end = JsonValueEnd(text, at);
    if (end == std::string_view::npos) return std::nullopt;
    const json v = json::parse(text.substr(at, end - at), nullptr, false);
    const json items = v.is_array() ? v : json::array({v});
    if (items.empty()) return std::nullopt;
    for (const json& item : items) {
      std::optional<ToolCall> call = CallOf(item, format);
      if (!call.has_value()) return std::nullopt;
      calls.push_back(*std::move(call));
    }
    at = end;
  }
  if (calls.empty()) return std::nullopt;
  return calls;
}

std::optional<std::vector<ToolCall>> HermesCalls(std::string_view text) {
  std::vector<ToolCall> calls;
  size_t at = text.find(kHermesOpen);
  while (at != std::string_view::npos) {
    const size_t body = at + kHermesOpen.size();
    const size_t close = text.find(kHermesClose, body);
    // The last block may be cut off by the end of the reply (a stop token in place of its close).
    const std::string_view inner =
        text.substr(body, close == std::string_view::npos ? std::string_view::npos : close - body);
    const json v = json::parse(inner, nullptr, false);
    std::optional<ToolCall> call = CallOf(v, ToolCallFormat::kHermes);
    if (!call.has_value()) return std::nullopt;
    calls.push_back(*std::move(call));
    if (close == std::string_view::npos) break;
    at = text.find(kHermesOpen, close + kHermesClose.size());
  }
  return calls;
}

// Where Llama's calls start: the reply opens with '{' (after whitespace), else its python tag.
size_t Llama3Start(std::string_view text) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first != std::string_view::npos && text[first] == '{') return first;
  return text.find(kPythonTag);
}

// The length of the longest end of `text` that begins `marker` (a marker that may be arriving).
size_t PartialMarker(std::string_view text, std::string_view marker) {
  for (size_t k = std::min(text.size(), marker.size() - 1); k > 0; --k) {
    if (text.substr(text.size() - k) == marker.substr(0, k)) return k;
  }
  return 0;
}

// A function's parameters schema, its keys in the client's order (which orders the output's).
ordered_json ParametersSchema(const ordered_json& function) {
  auto params = function.find("parameters");
  if (params == function.end() || params->is_null()) {
    return {{"type", "object"}, {"properties", ordered_json::object()}};
  }
  return *params;
}

}  // namespace

absl::StatusOr<ToolCallFormat> ToolCallFormatNamed(std::string_view name) {
  if (name == "llama3_json") return ToolCallFormat::kLlama3Json;
  if (name == "hermes") return ToolCallFormat::kHermes;
  if (name == "mistral") return ToolCallFormat::kMistral;
  return absl::InvalidArgumentError(absl::StrCat("tool_call_parser: '", std::string(name),
                                                 "' is not one of llama3_json, hermes, mistral"));
}

std::string_view ToolCallFormatName(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::kLlama3Json:
      return "llama3_json";
    case ToolCallFormat::kHermes:
      return "hermes";
    case ToolCallFormat::kMistral:
      return "mistral";
    case ToolCallFormat::kNone:
      break;
  }
  return "none";
}

ToolCallFormat ToolCallFormatOfTemplate(std::string_view chat_template) {
  if (chat_template.find(kHermesOpen) != std::string_view::npos) return ToolCallFormat::kHermes;
  if (chat_template.find(kMistralCalls) != std::string_view::npos) return ToolCallFormat::kMistral;
  // Llama-3.1 writes the tag for its built-in tools; 3.2's templates only ask for the JSON.
  if (chat_template.find(kPythonTag) != std::string_view::npos ||
      chat_template.find("respond with a JSON for a function call") != std::string_view::npos) {
    return ToolCallFormat::kLlama3Json;
  }
  return ToolCallFormat::kNone;
}

absl::Status CheckTools(const ordered_json& tools) {
  if (!tools.is_array()) return InvalidField("tools", "must be a list of tools");
  for (size_t i = 0; i < tools.size(); ++i) {
    const ordered_json& tool = tools[i];
    const std::string param = absl::StrCat("tools[", i, "]");
    if (!tool.is_object()) return InvalidField(param, "must be a tool (an object)");
    auto type = tool.find("type");
    if (type == tool.end() || *type != "function") {
      return InvalidField(absl::StrCat(param, ".type"),
                          "must be \"function\" (the only kind of tool served here; built-in "
                          "tools are not)");
    }
    auto function = tool.find("function");
    if (function == tool.end() || !function->is_object()) {
      return InvalidField(absl::StrCat(param, ".function"),
                          "must be an object with the function's name and parameters");
    }
    auto name = function->find("name");
    if (name == function->end() || !name->is_string() ||
        !IsFunctionName(name->get_ref<const std::string&>())) {
      return InvalidField(absl::StrCat(param, ".function.name"),
                          "must be a name of 1 to 64 letters, digits, '_', '-' or '.'");
    }
    auto description = function->find("description");
    if (description != function->end() && !description->is_null() && !description->is_string()) {
      return InvalidField(absl::StrCat(param, ".function.description"), "must be a string");
    }
    auto parameters = function->find("parameters");
    if (parameters != function->end() && !parameters->is_null() && !parameters->is_object()) {
      return InvalidField(absl::StrCat(param, ".function.parameters"),
                          "must be a JSON schema (an object)");
    }
    auto strict = function->find("strict");
    if (strict != function->end() && !strict->is_null() && !strict->is_boolean()) {
      return InvalidField(absl::StrCat(param, ".function.strict"), "must be a boolean");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ToolChoice> ParseToolChoice(const ordered_json* choice, const ordered_json& tools) {
  ToolChoice out;
  const bool any_tools = tools.is_array() && !tools.empty();
  if (choice == nullptr || choice->is_null()) {
    out.kind = any_tools ? ToolChoice::Kind::kAuto : ToolChoice::Kind::kNone;
    return out;
  }
  if (choice->is_string()) {
    const std::string& s = choice->get_ref<const std::string&>();
    if (s == "none") {
      out.kind = ToolChoice::Kind::kNone;
      return out;
    }
    if (s != "auto" && s != "required") {
      return InvalidField("tool_choice", absl::StrCat("'", s,
                                                      "' is not one of none, auto, required or "
                                                      "{\"type\": \"function\", ...}"));
    }
    if (!any_tools) {
      if (s == "auto") {
        out.kind = ToolChoice::Kind::kNone;
        return out;
      }
      return InvalidField("tool_choice", "\"required\" needs tools; the request gives none");
    }
    out.kind = s == "auto" ? ToolChoice::Kind::kAuto : ToolChoice::Kind::kRequired;
    return out;
  }
  if (!choice->is_object()) {
    return InvalidField("tool_choice", "must be a string or {\"type\": \"function\", ...}");
  }
  auto type = choice->find("type");
  if (type == choice->end() || *type != "function") {
    return InvalidField("tool_choice.type", "must be \"function\"");
  }
  auto function = choice->find("function");
  const ordered_json* name = nullptr;
  if (function != choice->end() && function->is_object() && function->contains("name")) {
    name = &(*function)["name"];
  } else if (choice->contains("name")) {  // the Responses API's flat form
    name = &(*choice)["name"];
  }
  if (name == nullptr || !name->is_string()) {
    return InvalidField("tool_choice.function.name", "must be the name of one of the tools");
  }
  out.kind = ToolChoice::Kind::kNamed;
  out.name = name->get<std::string>();
  if (any_tools) {
    for (const ordered_json& tool : tools) {
      if (tool["function"]["name"] == out.name) return out;
    }
  }
  return InvalidField("tool_choice.function.name",
                      absl::StrCat("'", out.name, "' is not one of the request's tools"));
}

absl::Status NormalizeToolMessages(ordered_json& messages) {
  for (size_t i = 0; i < messages.size(); ++i) {
    ordered_json& m = messages[i];
    const std::string param = absl::StrCat("messages[", i, "]");
    // vLLM hands templates "" for no content (Qwen3's looks for '</think>' in every assistant's).
    if (m["content"].is_null()) m["content"] = "";
    if (m["role"] == "tool") {
      auto id = m.find("tool_call_id");
      if (id == m.end() || !id->is_string()) {
        return InvalidField(absl::StrCat(param, ".tool_call_id"),
                            "must be the id (a string) of the call this message answers");
      }
      continue;
    }
    auto calls = m.find("tool_calls");
    if (calls == m.end() || calls->is_null()) continue;
    if (m["role"] != "assistant") {
      return InvalidField(absl::StrCat(param, ".tool_calls"), "is only for assistant messages");
    }
    if (!calls->is_array()) {
      return InvalidField(absl::StrCat(param, ".tool_calls"), "must be a list of calls");
    }
    for (size_t j = 0; j < calls->size(); ++j) {
      ordered_json& call = (*calls)[j];
      const std::string cparam = absl::StrCat(param, ".tool_calls[", j, "]");
      if (!call.is_object()) return InvalidField(cparam, "must be a call (an object)");
      auto id = call.find("id");
      if (id != call.end() && !id->is_null() && !id->is_string()) {
        return InvalidField(absl::StrCat(cparam, ".id"), "must be a string");
      }
      auto function = call.find("function");
      if (function == call.end() || !function->is_object()) {
        return InvalidField(absl::StrCat(cparam, ".function"),
                            "must be an object with the function's name and arguments");
      }
      auto name = function->find("name");
      if (name == function->end() || !name->is_string()) {
        return InvalidField(absl::StrCat(cparam, ".function.name"), "must be a string");
      }
      auto args = function->find("arguments");
      if (args == function->end() || args->is_null()) {
        (*function)["arguments"] = ordered_json::object();
      } else if (args->is_string()) {
        ordered_json parsed =
            ordered_json::parse(args->get_ref<const std::string&>(), nullptr, false);
        if (parsed.is_discarded() || !parsed.is_object()) {
          return InvalidField(absl::StrCat(cparam, ".function.arguments"),
                              "must be a JSON object encoded as a string (as replies give it)");
        }
        *args = std::move(parsed);
      } else if (!args->is_object()) {
        return InvalidField(absl::StrCat(cparam, ".function.arguments"),
                            "must be a JSON object encoded as a string");
      }
      if (call.find("type") == call.end()) call["type"] = "function";
    }
  }
  return absl::OkStatus();
}

std::string ForcedCallSchema(const ToolChoice& choice, const ordered_json& tools, bool parallel) {
  if (choice.kind == ToolChoice::Kind::kNamed) {
    for (const ordered_json& tool : tools) {
      if (tool["function"]["name"] == choice.name) return ParametersSchema(tool["function"]).dump();
    }
    return "";
  }
  if (choice.kind != ToolChoice::Kind::kRequired) return "";
  ordered_json any_of = ordered_json::array();
  for (const ordered_json& tool : tools) {
    ordered_json name = {{"type", "string"},
                         {"enum", ordered_json::array({tool["function"]["name"]})}};
    any_of.push_back(
        {{"type", "object"},
         {"properties",
          {{"name", std::move(name)}, {"parameters", ParametersSchema(tool["function"])}}},
         {"required", {"name", "parameters"}}});
  }
  ordered_json schema = {{"type", "array"}, {"minItems", 1}, {"items", {{"anyOf", any_of}}}};
  // parallel_tool_calls: false allows one call only (OpenAI's meaning).
  if (!parallel) schema["maxItems"] = 1;
  return schema.dump();
}

std::string NewToolCallId(ToolCallFormat format) {
  static constexpr char kAlphabet[] =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  const size_t length = format == ToolCallFormat::kMistral ? 9 : 24;
  std::string id = format == ToolCallFormat::kMistral ? "" : "call_";
  uint64_t bits = FreshSeed();
  for (size_t i = 0; i < length; ++i) {
    if (i % 10 == 0) bits = FreshSeed();
    id += kAlphabet[bits % 62];
    bits /= 62;
  }
  return id;
}

ParsedReply ParseToolCalls(ToolCallFormat format, std::string_view text) {
  ParsedReply out{std::string(text), {}};
  size_t start = std::string_view::npos;
  std::optional<std::vector<ToolCall>> calls;
  switch (format) {
    case ToolCallFormat::kNone:
      return out;
    case ToolCallFormat::kHermes:
      start = text.find(kHermesOpen);
      if (start != std::string_view::npos) calls = HermesCalls(text);
      break;
    case ToolCallFormat::kLlama3Json: {
      start = Llama3Start(text);
      if (start == std::string_view::npos) break;
      std::string_view rest = text.substr(start);
      if (rest.starts_with(kPythonTag)) rest.remove_prefix(kPythonTag.size());
      calls = CallList(rest, ';', false, format);
      // A reply opening with '{' is text before its first call only where that is whitespace.
      if (calls.has_value() && text[start] == '{') start = 0;
      break;
    }
    case ToolCallFormat::kMistral:
      start = text.find(kMistralCalls);
      if (start != std::string_view::npos) {
        calls = CallList(text.substr(start + kMistralCalls.size()), ',', true, format);
      }
      break;
  }
  if (!calls.has_value() || calls->empty()) return out;
  out.content.resize(start);
  out.calls = *std::move(calls);
  return out;
}

ParsedReply ParseForcedCalls(const ToolChoice& choice, std::string_view text,
                             ToolCallFormat format) {
  ParsedReply out;
  if (choice.kind == ToolChoice::Kind::kNamed) {
    out.calls.push_back({NewToolCallId(format), choice.name, std::string(text)});
    return out;
  }
  const json v = json::parse(text, nullptr, false);
  if (v.is_array() && !v.empty()) {
    for (const json& item : v) {
      std::optional<ToolCall> call = CallOf(item, format);
      if (!call.has_value()) {
        out.calls.clear();
        break;
      }
      out.calls.push_back(*std::move(call));
    }
  }
  if (out.calls.empty()) out.content = std::string(text);
  return out;
}

json ToolCallsJson(const std::vector<ToolCall>& calls) {
  json out = json::array();
  for (const ToolCall& call : calls) {
    out.push_back({{"id", call.id},
                   {"type", "function"},
                   {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
  }
  return out;
}

ToolCallStream::ToolCallStream(ToolCallFormat format, ToolChoice choice)
    : format_(format), choice_(std::move(choice)) {
  // A forced call is the whole reply.
  holding_ = choice_.kind == ToolChoice::Kind::kRequired;
}

size_t ToolCallStream::MarkerStart(size_t& safe) const {
  const std::string_view text = text_;
  safe = text.size();
  std::string_view marker;
  switch (format_) {
    case ToolCallFormat::kNone:
      return std::string_view::npos;
    case ToolCallFormat::kHermes:
      marker = kHermesOpen;
      break;
    case ToolCallFormat::kMistral:
      marker = kMistralCalls;
      break;
    case ToolCallFormat::kLlama3Json: {
      const size_t first = text.find_first_not_of(" \t\r\n");
      if (first == std::string_view::npos) {
        safe = 0;  // whitespace so far: the reply may still open with a call
        return std::string_view::npos;
      }
      if (text[first] == '{') return 0;
      // Only the text's start may be the tag's start; it is text once it cannot be.
      if (shown_ == 0 && kPythonTag.starts_with(text.substr(first))) {
        safe = 0;
        return std::string_view::npos;
      }
      marker = kPythonTag;
      break;
    }
  }
  const size_t at = text.find(marker);
  if (at != std::string_view::npos) return at;
  safe = text.size() - PartialMarker(text, marker);
  return std::string_view::npos;
}

void ToolCallStream::AddCall(const ToolCall& call, Delta& out) {
  const int index = calls_++;
  out.tool_calls.push_back({{"index", index},
                            {"id", call.id},
                            {"type", "function"},
                            {"function", {{"name", call.name}, {"arguments", ""}}}});
  out.tool_calls.push_back({{"index", index}, {"function", {{"arguments", call.arguments}}}});
}

ToolCallStream::Delta ToolCallStream::Next(std::string_view piece) {
  Delta out;
  if (choice_.kind == ToolChoice::Kind::kNamed) {
    // The whole reply is the arguments, streamed as they come.
    if (named_id_.empty()) {
      named_id_ = NewToolCallId(format_);
      out.tool_calls.push_back({{"index", 0},
                                {"id", named_id_},
                                {"type", "function"},
                                {"function", {{"name", choice_.name}, {"arguments", ""}}}});
      calls_ = 1;
    }
    if (!piece.empty()) {
      out.tool_calls.push_back({{"index", 0}, {"function", {{"arguments", std::string(piece)}}}});
    }
    return out;
  }
  text_.append(piece);
  if (holding_) return out;
  size_t safe = 0;
  const size_t start = MarkerStart(safe);
  if (start != std::string_view::npos) {
    holding_ = true;
    safe = start;
  }
  if (safe > shown_) {
    out.content = text_.substr(shown_, safe - shown_);
    shown_ = safe;
  }
  return out;
}

ToolCallStream::Delta ToolCallStream::Finish() {
  Delta out;
  if (choice_.kind == ToolChoice::Kind::kNamed) {
    if (named_id_.empty()) return Next("");
    return out;
  }
  const ParsedReply reply = choice_.kind == ToolChoice::Kind::kRequired
                                ? ParseForcedCalls(choice_, text_, format_)
                                : ParseToolCalls(format_, text_);
  // The parse's text begins with what was shown: it is the text before the first marker, or all.
  if (reply.content.size() > shown_) out.content = reply.content.substr(shown_);
  shown_ = std::max(shown_, reply.content.size());
  for (const ToolCall& call : reply.calls) AddCall(call, out);
  return out;
}

}  // namespace tandem::openai
