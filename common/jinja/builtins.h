// What a template can call without defining it: Jinja2's filters and tests, the methods of str,
// dict and list that Python would find, attribute and item lookup as Jinja2's immutable sandbox
// does it, and the operators' Python semantics.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "common/jinja/value.h"

namespace tandem::jinja {

bool IsFilter(std::string_view name);
bool IsTest(std::string_view name);
absl::StatusOr<Value> ApplyFilter(std::string_view name, const Value& input, const CallArgs& args);
absl::StatusOr<bool> ApplyTest(std::string_view name, const Value& input, const CallArgs& args);

// `obj.name`: a method of the object's Python type first, then a dict key; undefined otherwise.
// `obj` is not undefined (using an undefined value's attribute is an error the caller reports).
Value GetAttr(const Value& obj, std::string_view name);
// `obj[key]`: the item first, then (for string keys) the attribute; undefined otherwise.
Value GetItem(const Value& obj, const Value& key);
// `obj[start:stop:step]`, null bounds left out.
absl::StatusOr<Value> GetSlice(const Value& obj, const Value* start, const Value* stop,
                               const Value* step);

// Python's iter(): a list's items, a dict's keys, a string's code points; undefined is empty.
absl::StatusOr<ValueList> Iterate(const Value& value);
// Python's `item in container`.
absl::StatusOr<bool> Contains(const Value& container, const Value& item);
// Python's binary operators + - * / // % ** as Jinja2 evaluates them; `~` concatenates as text.
absl::StatusOr<Value> BinaryOp(std::string_view op, const Value& left, const Value& right);
// Calls `callee` (an error naming it when it is undefined or not callable).
absl::StatusOr<Value> CallValue(const Value& callee, const CallArgs& args);

// The globals every template sees besides the caller's variables: range, namespace, dict.
// (raise_exception and strftime_now come from the renderer, which owns the clock.)
Value BuiltinGlobal(std::string_view name);

}  // namespace tandem::jinja
