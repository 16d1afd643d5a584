// Small helpers shared by the builtins (filters, tests, methods): Python-style TypeErrors,
// reading call arguments by position or keyword, and code point counts.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/jinja/value.h"
#include "common/utf8.h"

namespace tandem::jinja {

inline absl::Status TypeError(const std::string& message) {
  return absl::InvalidArgumentError(message);
}

inline absl::Status FailUndefined(const Value& value) {
  return absl::InvalidArgumentError(value.hint().empty() ? "undefined value" : value.hint());
}

// An argument by position or name, or `fallback`.
inline Value Arg(const CallArgs& args, size_t index, std::string_view name, Value fallback) {
  const Value* v = args.Get(index, name);
  return v ? *v : fallback;
}

inline absl::StatusOr<std::string> StringArg(const CallArgs& args, size_t index,
                                             std::string_view name, std::string_view what) {
  const Value* v = args.Get(index, name);
  if (v == nullptr || !v->is_string()) {
    return TypeError(
        absl::StrCat(std::string(what), " expects a string argument '", std::string(name), "'"));
  }
  return v->as_string();
}

inline std::optional<std::string> OptionalString(const CallArgs& args, size_t index,
                                                 std::string_view name) {
  const Value* v = args.Get(index, name);
  if (v == nullptr || v->is_none() || !v->is_string()) return std::nullopt;
  return v->as_string();
}

inline Value StringList(const std::vector<std::string>& parts) {
  ValueList items;
  for (const std::string& part : parts) items.emplace_back(part);
  return Value::List(std::move(items));
}

// Python's len() of a str: code points.
inline int64_t CodePointCount(const std::string& s) {
  return static_cast<int64_t>(CountCodePoints(s));
}

}  // namespace tandem::jinja
