#include "coordinator/openai/structured_output.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/structured/grammar_cache.h"
#include "coordinator/openai/api_error.h"

namespace tandem::openai {
namespace {

using json = nlohmann::ordered_json;
using structured::Constraint;

const json* Field(const json& object, const char* name) {
  auto it = object.find(name);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::Status Choices(const json& list, const std::string& param, Constraint& c) {
  if (!list.is_array() || list.empty()) {
    return InvalidField(param, "must be a non-empty list of strings");
  }
  c.kind = Constraint::kChoice;
  for (size_t i = 0; i < list.size(); ++i) {
    if (!list[i].is_string()) {
      return InvalidField(absl::StrCat(param, "[", i, "]"), "must be a string");
    }
    c.options.push_back(list[i].get<std::string>());
  }
  return absl::OkStatus();
}

// A schema given as an object or as its JSON text.
absl::Status Schema(const json& schema, const std::string& param, Constraint& c) {
  if (schema.is_string()) {
    c.text = schema.get<std::string>();
  } else if (schema.is_object() || schema.is_boolean()) {
    c.text = schema.dump(-1, ' ', false, json::error_handler_t::replace);
  } else {
    return InvalidField(param, "must be a JSON Schema (an object)");
  }
  c.kind = Constraint::kJsonSchema;
  return absl::OkStatus();
}

absl::Status ResponseFormat(const json& rf, Constraint& c, std::string& param) {
  param = "response_format";
  if (!rf.is_object()) return InvalidField(param, "must be an object with a \"type\"");
  const json* type = Field(rf, "type");
  if (type == nullptr || !type->is_string()) {
    return InvalidField("response_format.type", "must be \"text\", \"json_object\" or \"json_schema\"");
  }
  if (*type == "text") return absl::OkStatus();
  if (*type == "json_object") {
    c.kind = Constraint::kJsonObject;
    return absl::OkStatus();
  }
  if (*type != "json_schema") {
    return InvalidField("response_format.type", absl::StrCat("\"", type->get<std::string>(),
                        "\" is not one of \"text\", \"json_object\", \"json_schema\""));
  }
  const json* spec = Field(rf, "json_schema");
  if (spec == nullptr || !spec->is_object()) {
    return InvalidField("response_format.json_schema",
                        "must be an object with \"name\" and \"schema\"");
  }
  const json* schema = Field(*spec, "schema");
  param = "response_format.json_schema.schema";
  if (schema == nullptr) {
    // OpenAI allows a schema-less json_schema: any JSON object then.
    c.kind = Constraint::kJsonObject;
    return absl::OkStatus();
  }
  return Schema(*schema, param, c);
}

}  // namespace

absl::Status ParseOutputConstraint(const json& body, v1::OutputConstraint& out) {
  Constraint c;
  std::string param;
  int given = 0;
  auto count = [&given](const json* v) { given += v != nullptr; return v; };
  const json* rf = count(Field(body, "response_format"));
  const json* guided_json = count(Field(body, "guided_json"));
  const json* guided_regex = count(Field(body, "guided_regex"));
  const json* guided_choice = count(Field(body, "guided_choice"));
  const json* so = count(Field(body, "structured_outputs"));
  if (rf != nullptr && rf->is_object() && rf->value("type", json()) == "text") --given;
  if (given > 1) {
    return InvalidField("response_format",
                        "give at most one of response_format, guided_json, guided_regex, "
                        "guided_choice and structured_outputs");
  }
  if (rf != nullptr) {
    if (absl::Status s = ResponseFormat(*rf, c, param); !s.ok()) return s;
  } else if (guided_json != nullptr) {
    param = "guided_json";
    if (absl::Status s = Schema(*guided_json, param, c); !s.ok()) return s;
  } else if (guided_regex != nullptr) {
    param = "guided_regex";
    if (!guided_regex->is_string()) return InvalidField(param, "must be a string");
    c.kind = Constraint::kRegex;
    c.text = guided_regex->get<std::string>();
  } else if (guided_choice != nullptr) {
    param = "guided_choice";
    if (absl::Status s = Choices(*guided_choice, param, c); !s.ok()) return s;
  } else if (so != nullptr) {
    if (!so->is_object()) return InvalidField("structured_outputs", "must be an object");
    int inner = 0;
    for (const auto& [key, value] : so->items()) {
      if (value.is_null()) continue;
      param = absl::StrCat("structured_outputs.", key);
      ++inner;
      if (key == "json") {
        if (absl::Status s = Schema(value, param, c); !s.ok()) return s;
      } else if (key == "regex") {
        if (!value.is_string()) return InvalidField(param, "must be a string");
        c.kind = Constraint::kRegex;
        c.text = value.get<std::string>();
      } else if (key == "choice") {
        if (absl::Status s = Choices(value, param, c); !s.ok()) return s;
      } else if (key == "json_object") {
        if (value != true) return InvalidField(param, "must be true");
        c.kind = Constraint::kJsonObject;
      } else {
        return InvalidField(param, "is not supported; use json, regex, choice or json_object");
      }
    }
    if (inner > 1) {
      return InvalidField("structured_outputs", "give one of json, regex, choice, json_object");
    }
  }
  if (c.kind == Constraint::kNone) return absl::OkStatus();
  auto grammar = structured::CompileCached(c);
  if (!grammar.ok()) return InvalidField(param, grammar.status().message());
  switch (c.kind) {
    case Constraint::kJsonObject: out.set_json_object(true); break;
    case Constraint::kJsonSchema: out.set_json_schema(c.text); break;
    case Constraint::kRegex: out.set_regex(c.text); break;
    case Constraint::kChoice:
      for (std::string& o : c.options) out.mutable_choice()->add_options(std::move(o));
      break;
    case Constraint::kNone: break;
  }
  return absl::OkStatus();
}

}  // namespace tandem::openai
