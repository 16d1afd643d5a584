// Strict field access for tokenizer.json components.
#include "common/tokenizer/json_fields.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/utf8.h"

namespace tandem::tokenizer {

absl::Status Unsupported(const std::string& where, const std::string& what) {
  return absl::UnimplementedError(absl::StrCat(where, ": ", what, " is not supported"));
}

absl::StatusOr<std::string> ComponentType(const nlohmann::json& obj, const std::string& where) {
  if (!obj.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " must be an object or null, got ", obj.type_name()));
  }
  auto it = obj.find("type");
  if (it == obj.end() || !it->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(where, " has no \"type\" string"));
  }
  return it->get<std::string>();
}

absl::Status CheckKeys(const nlohmann::json& obj, std::initializer_list<std::string_view> known,
                       const std::string& where) {
  for (const auto& [key, value] : obj.items()) {
    bool ok = false;
    for (std::string_view k : known) ok = ok || k == key;
    if (!ok) {
      return absl::UnimplementedError(absl::StrCat(where, ": field \"", key, "\" (", value.dump(),
                                                   ") is not supported"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> StringField(const nlohmann::json& obj, const char* key,
                                        const std::string& where,
                                        std::optional<std::string> fallback) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    if (fallback.has_value()) return *fallback;
    return absl::InvalidArgumentError(absl::StrCat(where, ": no \"", key, "\" string"));
  }
  if (!it->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".", key, " must be a string, got ", it->dump()));
  }
  return it->get<std::string>();
}

absl::StatusOr<bool> BoolField(const nlohmann::json& obj, const char* key,
                               const std::string& where, std::optional<bool> fallback) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    if (fallback.has_value()) return *fallback;
    return absl::InvalidArgumentError(absl::StrCat(where, ": no \"", key, "\" boolean"));
  }
  if (!it->is_boolean()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".", key, " must be true or false, got ", it->dump()));
  }
  return it->get<bool>();
}

absl::StatusOr<int64_t> IntField(const nlohmann::json& obj, const char* key,
                                 const std::string& where, std::optional<int64_t> fallback) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    if (fallback.has_value()) return *fallback;
    return absl::InvalidArgumentError(absl::StrCat(where, ": no \"", key, "\" integer"));
  }
  if (!it->is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".", key, " must be an integer, got ", it->dump()));
  }
  return it->get<int64_t>();
}

absl::StatusOr<std::shared_ptr<const Pattern>> PatternField(const nlohmann::json& obj,
                                                            const char* key,
                                                            const std::string& where) {
  const std::string field = absl::StrCat(where, ".", key);
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_object() || it->size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be {\"String\": ...} or {\"Regex\": ...}"));
  }
  if (auto s = it->find("String"); s != it->end() && s->is_string()) {
    return Pattern::Literal(s->get<std::string>());
  }
  if (auto r = it->find("Regex"); r != it->end() && r->is_string()) {
    return Pattern::Regex(r->get<std::string>(), field);
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " must be {\"String\": ...} or {\"Regex\": ...}, got ", it->dump()));
}

absl::StatusOr<std::string> CharField(const nlohmann::json& obj, const char* key,
                                      const std::string& where,
                                      std::optional<std::string> fallback) {
  auto s = StringField(obj, key, where, fallback);
  if (!s.ok()) return s.status();
  if (!IsValidUtf8(*s) || CountCodePoints(*s) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".", key, " must be one character, got \"", *s, "\""));
  }
  return s;
}

}  // namespace tandem::tokenizer
