// How template values behave as Python objects under Jinja2's immutable sandbox: attribute and item
// lookup, slices, iteration, `in`, the binary operators, calls, the methods of str, dict and list
// that templates use, and the globals range, namespace and dict.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "common/jinja/value.h"

namespace tandem::jinja {

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
