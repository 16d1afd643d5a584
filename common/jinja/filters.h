// Jinja2's filters (`value | name(args)`), with Jinja2 3.1's semantics and transformers' tojson.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "common/jinja/value.h"

namespace tandem::jinja {

bool IsFilter(std::string_view name);
absl::StatusOr<Value> ApplyFilter(std::string_view name, const Value& input, const CallArgs& args);

}  // namespace tandem::jinja
