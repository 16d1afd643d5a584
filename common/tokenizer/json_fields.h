// Reading tokenizer.json's component objects strictly: every field a component has is known, and
// a field or value the tokenizer does not implement is an error naming it.
#pragma once

#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/tokenizer/regex.h"
#include "nlohmann/json.hpp"

namespace tandem::tokenizer {

// The "type" string of a component object at `where`.
absl::StatusOr<std::string> ComponentType(const nlohmann::json& obj, const std::string& where);

// INVALID_ARGUMENT naming the first key of `obj` not in `known`.
absl::Status CheckKeys(const nlohmann::json& obj, std::initializer_list<std::string_view> known,
                       const std::string& where);

// obj[key] as a string / bool / integer; `fallback` when absent or null, an error when it has
// another type.
absl::StatusOr<std::string> StringField(const nlohmann::json& obj, const char* key,
                                        const std::string& where,
                                        std::optional<std::string> fallback = std::nullopt);
absl::StatusOr<bool> BoolField(const nlohmann::json& obj, const char* key,
                               const std::string& where, std::optional<bool> fallback);
absl::StatusOr<int64_t> IntField(const nlohmann::json& obj, const char* key,
                                 const std::string& where, std::optional<int64_t> fallback);

// A pattern object {"String": "..."} or {"Regex": "..."} at obj[key].
absl::StatusOr<std::shared_ptr<const Pattern>> PatternField(const nlohmann::json& obj,
                                                            const char* key,
                                                            const std::string& where);

// A single character given as a one-code-point string (Metaspace's replacement, Strip's content).
absl::StatusOr<std::string> CharField(const nlohmann::json& obj, const char* key,
                                      const std::string& where,
                                      std::optional<std::string> fallback = std::nullopt);

// The error for a component type that is not implemented.
absl::Status Unsupported(const std::string& where, const std::string& what);

}  // namespace tandem::tokenizer
