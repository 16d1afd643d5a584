// Jinja2's tests (`value is name(args)`): defined, none, string, mapping, iterable, number, odd,
// divisibleby, the comparison tests and the rest of Jinja2 3.1's list.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "common/jinja/value.h"

namespace tandem::jinja {

bool IsTest(std::string_view name);
absl::StatusOr<bool> ApplyTest(std::string_view name, const Value& input, const CallArgs& args);

}  // namespace tandem::jinja
