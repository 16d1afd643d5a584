// The values a chat template computes with, modelled on the Python objects Jinja2 hands around:
// undefined, None, bool, int, float, str, list, tuple, dict (insertion-ordered), namespace and
// callables. Printing, repr, truthiness, equality and ordering follow Python's rules, so that what
// a template writes matches Jinja2 byte for byte.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::jinja {

class Value;
using ValueList = std::vector<Value>;

// A Python dict: keys in insertion order. Lookup is linear; template dicts hold a handful of keys.
struct Dict {
  std::vector<std::pair<Value, Value>> entries;

  const Value* Find(const Value& key) const;
  const Value* Find(std::string_view key) const;
  void Set(Value key, Value value);
};

// Arguments of a call: positional, then keyword (in the order written).
struct CallArgs {
  ValueList positional;
  std::vector<std::pair<std::string, Value>> keyword;

  // The argument named `name` or at position `index` (keyword first), or nullptr.
  const Value* Get(size_t index, std::string_view name) const;
  // The argument given as `name=...`, or nullptr.
  const Value* Keyword(std::string_view name) const;
};

using Function = std::function<absl::StatusOr<Value>(const CallArgs&)>;

class Value {
 public:
  enum class Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kTuple,
    kDict,
    kNamespace,
    kCallable
  };

  // Undefined; `hint` is the message Jinja2 gives when it is used where a value is required.
  Value() = default;
  static Value Undefined(std::string hint);
  static Value None();
  Value(bool b);
  Value(int64_t i);
  Value(int i) : Value(static_cast<int64_t>(i)) {}
  Value(double d);
  Value(std::string s);
  Value(const char* s) : Value(std::string(s)) {}
  static Value List(ValueList items);
  static Value Tuple(ValueList items);
  static Value MakeDict(Dict dict);
  // A namespace() object: the one value a template may change after making it.
  static Value Namespace(Dict attributes);
  static Value Callable(std::string name, Function fn);
  static Value FromJson(const nlohmann::ordered_json& json);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  // Python's numbers.Number: bool counts, as in Python.
  bool is_number() const { return is_bool() || is_int() || is_float(); }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_tuple() const { return kind_ == Kind::kTuple; }
  bool is_sequence() const { return is_list() || is_tuple(); }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_namespace() const { return kind_ == Kind::kNamespace; }
  bool is_callable() const { return kind_ == Kind::kCallable; }

  bool as_bool() const { return bool_; }
  int64_t as_int() const { return is_bool() ? (bool_ ? 1 : 0) : int_; }
  double as_float() const { return is_float() ? float_ : static_cast<double>(as_int()); }
  const std::string& as_string() const { return string_; }
  const ValueList& items() const { return *list_; }
  const Dict& dict() const { return *dict_; }
  Dict& mutable_namespace() const { return *dict_; }
  const Function& function() const { return *function_; }
  // The undefined value's message, or the callable's name.
  const std::string& hint() const { return string_; }
  // The shared object behind a namespace or callable: two such values are equal when it is one.
  const void* identity() const {
    return dict_ ? static_cast<const void*>(dict_.get())
                 : static_cast<const void*>(function_.get());
  }

  // Python's type name as Jinja2 writes it in errors ("dict object", "str object").
  std::string TypeName() const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool bool_ = false;
  int64_t int_ = 0;
  double float_ = 0;
  std::string string_;
  std::shared_ptr<const ValueList> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<const Function> function_;
};

// Python's bool(value).
bool Truthy(const Value& value);
// Python's str(value): what `{{ value }}` and `~` write. Undefined writes nothing.
std::string ToString(const Value& value);
// Levels of lists, dicts and namespaces that printing (str, repr) and tojson walk. Values from
// requests nest at most kMaxJsonDepth (128) levels; a template can build deeper ones in a loop
// through a namespace, or one that contains itself (`set ns.a = [ns]`). Repr writes "..." below
// this depth, as Python writes a list that contains itself; tojson fails.
inline constexpr int kMaxValueDepth = 256;

// Python's repr(value): how values inside a printed list or dict appear.
std::string Repr(const Value& value);
// Python's repr of a float ("1.0", "1e-05", "1e+16").
std::string FloatRepr(double d);
// Python's ==.
bool Equals(const Value& a, const Value& b);
// Python's <: -1, 0, 1; an error for types Python cannot order.
absl::StatusOr<int> Compare(const Value& a, const Value& b);

// json.dumps(value, ensure_ascii=False, indent, separators, sort_keys): `indent` < 0 is None;
// `item_sep`/`key_sep` as Python's separators.
struct JsonOptions {
  int indent = -1;
  std::string indent_string;  // used instead of `indent` spaces when set
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
  bool ensure_ascii = false;  // non-ASCII characters as \uXXXX escapes
};
absl::StatusOr<std::string> ToJson(const Value& value, const JsonOptions& options);

}  // namespace tandem::jinja
