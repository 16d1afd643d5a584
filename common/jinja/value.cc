#include "common/jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/jinja/text.h"
#include "common/status_macros.h"

namespace tandem::jinja {

const Value* Dict::Find(const Value& key) const {
  for (const auto& [k, v] : entries) {
    if (Equals(k, key)) return &v;
  }
  return nullptr;
}

const Value* Dict::Find(std::string_view key) const {
  for (const auto& [k, v] : entries) {
    if (k.is_string() && k.as_string() == key) return &v;
  }
  return nullptr;
}

void Dict::Set(Value key, Value value) {
  for (auto& [k, v] : entries) {
    if (Equals(k, key)) {
      v = std::move(value);
      return;
    }
  }
  entries.emplace_back(std::move(key), std::move(value));
}

const Value* CallArgs::Keyword(std::string_view name) const {
  for (const auto& [key, value] : keyword) {
    if (key == name) return &value;
  }
  return nullptr;
}

const Value* CallArgs::Get(size_t index, std::string_view name) const {
  for (const auto& [key, value] : keyword) {
    if (key == name) return &value;
  }
  return index < positional.size() ? &positional[index] : nullptr;
}

Value Value::Undefined(std::string hint) {
  Value v;
  v.string_ = std::move(hint);
  return v;
}

Value Value::None() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}

Value::Value(bool b) : kind_(Kind::kBool), bool_(b) {}
Value::Value(int64_t i) : kind_(Kind::kInt), int_(i) {}
Value::Value(double d) : kind_(Kind::kFloat), float_(d) {}
Value::Value(std::string s) : kind_(Kind::kString), string_(std::move(s)) {}

Value Value::List(ValueList items) {
  Value v;
  v.kind_ = Kind::kList;
  v.list_ = std::make_shared<const ValueList>(std::move(items));
  return v;
}

Value Value::Tuple(ValueList items) {
  Value v = List(std::move(items));
  v.kind_ = Kind::kTuple;
  return v;
}

Value Value::MakeDict(Dict dict) {
  Value v;
  v.kind_ = Kind::kDict;
  v.dict_ = std::make_shared<Dict>(std::move(dict));
  return v;
}

Value Value::Namespace(Dict attributes) {
  Value v = MakeDict(std::move(attributes));
  v.kind_ = Kind::kNamespace;
  return v;
}

Value Value::Callable(std::string name, Function fn) {
  Value v;
  v.kind_ = Kind::kCallable;
  v.string_ = std::move(name);
  v.function_ = std::make_shared<const Function>(std::move(fn));
  return v;
}

Value Value::FromJson(const nlohmann::ordered_json& json) {
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::null:
      return None();
    case nlohmann::ordered_json::value_t::boolean:
      return Value(json.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value(json.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      uint64_t u = json.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Value(static_cast<double>(u));
      }
      return Value(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value(json.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value(json.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      ValueList items;
      items.reserve(json.size());
      for (const auto& item : json) items.push_back(FromJson(item));
      return List(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict dict;
      dict.entries.reserve(json.size());
      for (const auto& [key, item] : json.items()) {
        dict.entries.emplace_back(Value(key), FromJson(item));
      }
      return MakeDict(std::move(dict));
    }
    default:
      return None();
  }
}

std::string Value::TypeName() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return "list";
    case Kind::kTuple:
      return "tuple";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kCallable:
      return "function";
  }
  return "object";
}

bool Truthy(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
      return value.as_bool();
    case Value::Kind::kInt:
      return value.as_int() != 0;
    case Value::Kind::kFloat:
      return value.as_float() != 0;
    case Value::Kind::kString:
      return !value.as_string().empty();
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return !value.items().empty();
    case Value::Kind::kDict:
      return !value.dict().entries.empty();
    default:
      return true;
  }
}

std::string FloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  // Shortest round-trip digits, then Python's layout: positional for exponents -4..15.
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, end);
  size_t e = sci.find('e');
  std::string mantissa = sci.substr(0, e);
  int exponent = std::atoi(sci.c_str() + e + 1);
  bool negative = !mantissa.empty() && mantissa[0] == '-';
  if (negative) mantissa.erase(0, 1);
  std::string digits;
  for (char c : mantissa) {
    if (c != '.') digits += c;
  }
  std::string out = negative ? "-" : "";
  if (exponent >= -4 && exponent < 16) {
    int point = exponent + 1;  // digits before the decimal point
    if (point <= 0) {
      out += "0." + std::string(-point, '0') + digits;
    } else if (point >= static_cast<int>(digits.size())) {
      out += digits + std::string(point - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, point) + "." + digits.substr(point);
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  out += absl::StrFormat("e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
  return out;
}

std::string Repr(const Value& value) {
  // Python writes a value that contains itself as `[...]`; a namespace may (`set ns.a = [ns]`),
  // and a value built in a loop may nest deeper than the stack allows.
  thread_local int depth = 0;
  if (depth >= kMaxValueDepth) return "...";
  ++depth;
  absl::Cleanup leave = [] { --depth; };
  switch (value.kind()) {
    case Value::Kind::kString:
      return StringRepr(value.as_string());
    case Value::Kind::kUndefined:
      return "Undefined";
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      std::string out = value.is_list() ? "[" : "(";
      const ValueList& items = value.items();
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += ", ";
        out += Repr(items[i]);
      }
      if (value.is_tuple() && items.size() == 1) out += ",";
      out += value.is_list() ? "]" : ")";
      return out;
    }
    case Value::Kind::kDict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, v] : value.dict().entries) {
        if (!first) out += ", ";
        first = false;
        out += Repr(k) + ": " + Repr(v);
      }
      return out + "}";
    }
    default:
      return ToString(value);
  }
}

std::string ToString(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      return "";
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kBool:
      return value.as_bool() ? "True" : "False";
    case Value::Kind::kInt:
      return absl::StrCat(value.as_int());
    case Value::Kind::kFloat:
      return FloatRepr(value.as_float());
    case Value::Kind::kString:
      return value.as_string();
    case Value::Kind::kNamespace: {
      std::string out = "<Namespace {";
      bool first = true;
      for (const auto& [k, v] : value.dict().entries) {
        if (!first) out += ", ";
        first = false;
        out += Repr(k) + ": " + Repr(v);
      }
      return out + "}>";
    }
    case Value::Kind::kCallable:
      return "<function " + value.hint() + ">";
    default:
      return Repr(value);
  }
}

bool Equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_float() == b.as_float();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.as_string() == b.as_string();
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      if (a.items().size() != b.items().size()) return false;
      for (size_t i = 0; i < a.items().size(); ++i) {
        if (!Equals(a.items()[i], b.items()[i])) return false;
      }
      return true;
    }
    case Value::Kind::kDict: {
      if (a.dict().entries.size() != b.dict().entries.size()) return false;
      for (const auto& [k, v] : a.dict().entries) {
        const Value* other = b.dict().Find(k);
        if (other == nullptr || !Equals(v, *other)) return false;
      }
      return true;
    }
    default:
      return a.identity() == b.identity();
  }
}

absl::StatusOr<int> Compare(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      double x = a.as_float(), y = b.as_float();
      return x < y ? -1 : (x > y ? 1 : 0);
    }
    int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) {
    // UTF-8 byte order is code point order, which is Python's.
    int c = a.as_string().compare(b.as_string());
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.kind() == b.kind() && a.is_sequence()) {
    const ValueList& x = a.items();
    const ValueList& y = b.items();
    for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
      if (Equals(x[i], y[i])) continue;
      return Compare(x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "'<' not supported between instances of '%s' and '%s'", a.TypeName(), b.TypeName()));
}

namespace {

// json.dumps's string: control characters escaped; with ensure_ascii everything outside
// printable ASCII too, as \uXXXX (UTF-16 surrogate pairs above U+FFFF).
void JsonString(std::string_view s, bool ensure_ascii, std::string& out) {
  out += '"';
  for (char32_t c : Decode(s)) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20 || (ensure_ascii && c >= 0x7F && c < 0x10000)) {
          out += absl::StrFormat("\\u%04x", static_cast<unsigned>(c));
        } else if (ensure_ascii && c >= 0x10000) {
          char32_t v = c - 0x10000;
          out += absl::StrFormat("\\u%04x\\u%04x", static_cast<unsigned>(0xD800 + (v >> 10)),
                                 static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
        } else {
          out += Encode(std::u32string(1, c));
        }
    }
  }
  out += '"';
}

absl::Status JsonKey(const Value& key, bool ensure_ascii, std::string& out) {
  switch (key.kind()) {
    case Value::Kind::kString:
      JsonString(key.as_string(), ensure_ascii, out);
      return absl::OkStatus();
    case Value::Kind::kBool:
      out += key.as_bool() ? "\"true\"" : "\"false\"";
      return absl::OkStatus();
    case Value::Kind::kNone:
      out += "\"null\"";
      return absl::OkStatus();
    case Value::Kind::kInt:
    case Value::Kind::kFloat:
      out += "\"" + ToString(key) + "\"";
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("keys must be str, int, float, bool or None, not %s", key.TypeName()));
  }
}

absl::Status JsonValue(const Value& value, const JsonOptions& options, int level,
                       std::string& out) {
  if (level > kMaxValueDepth) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tojson: the value nests deeper than %d levels", kMaxValueDepth));
  }
  const bool indented = options.indent >= 0 || !options.indent_string.empty();
  auto newline = [&](int depth) {
    if (!indented) return;
    out += '\n';
    for (int i = 0; i < depth; ++i) {
      out +=
          options.indent_string.empty() ? std::string(options.indent, ' ') : options.indent_string;
    }
  };
  switch (value.kind()) {
    case Value::Kind::kNone:
      out += "null";
      return absl::OkStatus();
    case Value::Kind::kBool:
      out += value.as_bool() ? "true" : "false";
      return absl::OkStatus();
    case Value::Kind::kInt:
      out += absl::StrCat(value.as_int());
      return absl::OkStatus();
    case Value::Kind::kFloat: {
      double d = value.as_float();
      if (std::isnan(d)) {
        out += "NaN";
      } else if (std::isinf(d)) {
        out += d > 0 ? "Infinity" : "-Infinity";
      } else {
        out += FloatRepr(d);
      }
      return absl::OkStatus();
    }
    case Value::Kind::kString:
      JsonString(value.as_string(), options.ensure_ascii, out);
      return absl::OkStatus();
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      if (value.items().empty()) {
        out += "[]";
        return absl::OkStatus();
      }
      out += '[';
      bool first = true;
      for (const Value& item : value.items()) {
        if (!first) out += options.item_separator;
        first = false;
        newline(level + 1);
        RETURN_IF_ERROR(JsonValue(item, options, level + 1, out));
      }
      newline(level);
      out += ']';
      return absl::OkStatus();
    }
    case Value::Kind::kDict: {
      if (value.dict().entries.empty()) {
        out += "{}";
        return absl::OkStatus();
      }
      std::vector<const std::pair<Value, Value>*> entries;
      for (const auto& entry : value.dict().entries) entries.push_back(&entry);
      if (options.sort_keys) {
        absl::Status status;
        std::stable_sort(entries.begin(), entries.end(), [&](auto* x, auto* y) {
          absl::StatusOr<int> c = Compare(x->first, y->first);
          if (!c.ok()) status = c.status();
          return c.ok() && *c < 0;
        });
        if (!status.ok()) return status;
      }
      out += '{';
      bool first = true;
      for (const auto* entry : entries) {
        if (!first) out += options.item_separator;
        first = false;
        newline(level + 1);
        RETURN_IF_ERROR(JsonKey(entry->first, options.ensure_ascii, out));
        out += options.key_separator;
        RETURN_IF_ERROR(JsonValue(entry->second, options, level + 1, out));
      }
      newline(level);
      out += '}';
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("Object of type %s is not JSON serializable", value.TypeName()));
  }
}

}  // namespace

absl::StatusOr<std::string> ToJson(const Value& value, const JsonOptions& options) {
  std::string out;
  absl::Status status = JsonValue(value, options, 0, out);
  if (!status.ok()) return status;
  return out;
}

}  // namespace tandem::jinja
