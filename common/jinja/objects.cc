#include "common/jinja/objects.h"

#include <unicode/uchar.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/jinja/args.h"
#include "common/jinja/text.h"
#include "common/status_macros.h"

namespace tandem::jinja {
namespace {

// Jinja2's object_type_repr: "dict object", "None".
std::string ObjectTypeRepr(const Value& value) {
  if (value.is_none()) return "None";
  return value.TypeName() + " object";
}

Value UndefinedAttribute(const Value& obj, std::string_view name) {
  return Value::Undefined(absl::StrFormat("'%s' has no attribute '%s'", ObjectTypeRepr(obj), name));
}

// str.format with positional `{}`/`{0}` and named `{name}` fields, written with str().
absl::StatusOr<Value> FormatString(const std::string& format, const CallArgs& a) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < format.size(); ++i) {
    char c = format[i];
    if (c == '{' && i + 1 < format.size() && format[i + 1] == '{') {
      out += '{';
      ++i;
    } else if (c == '}' && i + 1 < format.size() && format[i + 1] == '}') {
      out += '}';
      ++i;
    } else if (c == '{') {
      size_t end = format.find('}', i);
      if (end == std::string::npos) return TypeError("Single '{' encountered in format string");
      std::string field = format.substr(i + 1, end - i - 1);
      if (field.find_first_of(":!") != std::string::npos) {
        return TypeError("format specifications in str.format are not supported");
      }
      const Value* value = nullptr;
      size_t index;
      if (field.empty()) {
        index = auto_index++;
        value = index < a.positional.size() ? &a.positional[index] : nullptr;
      } else if (absl::SimpleAtoi(field, &index)) {
        value = index < a.positional.size() ? &a.positional[index] : nullptr;
      } else {
        value = a.Keyword(field);
      }
      if (value == nullptr) return TypeError(absl::StrCat("format field {", field, "} is missing"));
      out += ToString(*value);
      i = end;
    } else if (c == '}') {
      return TypeError("Single '}' encountered in format string");
    } else {
      out += c;
    }
  }
  return Value(out);
}

absl::StatusOr<Value> PrefixTest(const std::string& s, const CallArgs& a, bool suffix) {
  const Value* arg = a.Get(0, "prefix");
  if (arg == nullptr) return TypeError("startswith/endswith need an argument");
  ValueList options = arg->is_tuple() ? arg->items() : ValueList{*arg};
  for (const Value& option : options) {
    if (!option.is_string()) {
      return TypeError("startswith/endswith first arg must be str or a tuple of str");
    }
    const std::string& o = option.as_string();
    if (o.size() <= s.size() && (suffix ? s.compare(s.size() - o.size(), o.size(), o) == 0
                                        : s.compare(0, o.size(), o) == 0)) {
      return Value(true);
    }
  }
  return Value(false);
}

Value StringMethod(const std::string& s, std::string_view name) {
  auto method = [&](std::function<absl::StatusOr<Value>(const CallArgs&)> fn) {
    return Value::Callable(absl::StrCat("str.", std::string(name)), std::move(fn));
  };
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    StripSide side = name == "strip" ? StripSide::kBoth
                                     : (name == "lstrip" ? StripSide::kLeft : StripSide::kRight);
    return method([s, side](const CallArgs& a) -> absl::StatusOr<Value> {
      return Value(Strip(s, OptionalString(a, 0, "chars"), side));
    });
  }
  if (name == "split" || name == "rsplit") {
    bool from_right = name == "rsplit";
    return method([s, from_right](const CallArgs& a) -> absl::StatusOr<Value> {
      std::optional<std::string> sep = OptionalString(a, 0, "sep");
      if (sep && sep->empty()) return TypeError("empty separator");
      int maxsplit = static_cast<int>(Arg(a, 1, "maxsplit", Value(int64_t{-1})).as_int());
      return StringList(Split(s, sep, maxsplit, from_right));
    });
  }
  if (name == "splitlines") {
    return method(
        [s](const CallArgs&) -> absl::StatusOr<Value> { return StringList(SplitLines(s)); });
  }
  if (name == "startswith" || name == "endswith") {
    bool suffix = name == "endswith";
    return method([s, suffix](const CallArgs& a) { return PrefixTest(s, a, suffix); });
  }
  if (name == "upper")
    return method([s](const CallArgs&) -> absl::StatusOr<Value> { return Value(Upper(s)); });
  if (name == "lower")
    return method([s](const CallArgs&) -> absl::StatusOr<Value> { return Value(Lower(s)); });
  if (name == "title") {
    return method([s](const CallArgs&) -> absl::StatusOr<Value> { return Value(PythonTitle(s)); });
  }
  if (name == "capitalize") {
    return method([s](const CallArgs&) -> absl::StatusOr<Value> { return Value(Capitalize(s)); });
  }
  if (name == "replace") {
    return method([s](const CallArgs& a) -> absl::StatusOr<Value> {
      ASSIGN_OR_RETURN(std::string from, StringArg(a, 0, "old", "str.replace"));
      ASSIGN_OR_RETURN(std::string to, StringArg(a, 1, "new", "str.replace"));
      int count = static_cast<int>(Arg(a, 2, "count", Value(int64_t{-1})).as_int());
      return Value(Replace(s, from, to, count));
    });
  }
  if (name == "find" || name == "rfind" || name == "count") {
    std::string which(name);
    return method([s, which](const CallArgs& a) -> absl::StatusOr<Value> {
      ASSIGN_OR_RETURN(std::string sub, StringArg(a, 0, "sub", "str." + which));
      if (which == "count") {
        if (sub.empty()) return Value(CodePointCount(s) + 1);
        int64_t n = 0;
        for (size_t pos = s.find(sub); pos != std::string::npos;
             pos = s.find(sub, pos + sub.size()))
          ++n;
        return Value(n);
      }
      size_t pos = which == "find" ? s.find(sub) : s.rfind(sub);
      if (pos == std::string::npos) return Value(int64_t{-1});
      return Value(CodePointCount(s.substr(0, pos)));
    });
  }
  if (name == "join") {
    return method([s](const CallArgs& a) -> absl::StatusOr<Value> {
      const Value* items = a.Get(0, "iterable");
      if (items == nullptr) return TypeError("str.join needs an iterable");
      ASSIGN_OR_RETURN(ValueList list, Iterate(*items));
      std::string out;
      for (size_t i = 0; i < list.size(); ++i) {
        if (!list[i].is_string()) {
          return TypeError(absl::StrFormat("sequence item %d: expected str instance, %s found", i,
                                           list[i].TypeName()));
        }
        if (i) out += s;
        out += list[i].as_string();
      }
      return Value(out);
    });
  }
  if (name == "format") {
    return method([s](const CallArgs& a) { return FormatString(s, a); });
  }
  if (name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isspace" ||
      name == "isupper" || name == "islower") {
    std::string which(name);
    return method([s, which](const CallArgs&) -> absl::StatusOr<Value> {
      std::u32string text = Decode(s);
      if (which == "isupper" || which == "islower") {
        bool cased = false;
        for (char32_t c : text) {
          if (which == "isupper" ? u_isULowercase(c) : u_isUUppercase(c)) return Value(false);
          cased = cased || u_isULowercase(c) || u_isUUppercase(c);
        }
        return Value(cased);
      }
      if (text.empty()) return Value(false);
      for (char32_t c : text) {
        bool ok = which == "isdigit"   ? u_isdigit(c)
                  : which == "isalpha" ? u_isalpha(c)
                  : which == "isalnum" ? u_isalnum(c)
                                       : IsSpace(c);
        if (!ok) return Value(false);
      }
      return Value(true);
    });
  }
  return Value::Undefined(absl::StrFormat("'str object' has no attribute '%s'", name));
}

Value DictMethod(const Value& dict, std::string_view name) {
  auto method = [&](std::function<absl::StatusOr<Value>(const CallArgs&)> fn) {
    return Value::Callable(absl::StrCat("dict.", std::string(name)), std::move(fn));
  };
  if (name == "items") {
    return method([dict](const CallArgs&) -> absl::StatusOr<Value> {
      ValueList items;
      for (const auto& [key, value] : dict.dict().entries)
        items.push_back(Value::Tuple({key, value}));
      return Value::List(std::move(items));
    });
  }
  if (name == "keys" || name == "values") {
    bool keys = name == "keys";
    return method([dict, keys](const CallArgs&) -> absl::StatusOr<Value> {
      ValueList out;
      for (const auto& [k, v] : dict.dict().entries) out.push_back(keys ? k : v);
      return Value::List(std::move(out));
    });
  }
  if (name == "get") {
    return method([dict](const CallArgs& a) -> absl::StatusOr<Value> {
      if (a.positional.empty()) return TypeError("get expected at least 1 argument, got 0");
      const Value* found = dict.dict().Find(a.positional[0]);
      if (found) return *found;
      return a.positional.size() > 1 ? a.positional[1] : Value::None();
    });
  }
  if (name == "copy")
    return method([dict](const CallArgs&) -> absl::StatusOr<Value> { return dict; });
  return Value::Undefined("");
}

// The immutable sandbox refuses methods that change a list or dict.
bool IsMutatingMethod(const Value& obj, std::string_view name) {
  static const char* const kList[] = {"append",  "extend", "insert", "pop",         "remove",
                                      "reverse", "sort",   "clear",  "__setitem__", "__delitem__"};
  static const char* const kDict[] = {"clear", "pop", "popitem", "setdefault", "update"};
  if (obj.is_list()) {
    return std::find(std::begin(kList), std::end(kList), name) != std::end(kList);
  }
  if (obj.is_dict()) {
    return std::find(std::begin(kDict), std::end(kDict), name) != std::end(kDict);
  }
  return false;
}

Value SequenceMethod(const Value& seq, std::string_view name) {
  if (name == "index" || name == "count") {
    bool count = name == "count";
    return Value::Callable(absl::StrCat(seq.TypeName(), ".", std::string(name)),
                           [seq, count](const CallArgs& a) -> absl::StatusOr<Value> {
                             if (a.positional.empty()) return TypeError("expected one argument");
                             int64_t n = 0;
                             for (size_t i = 0; i < seq.items().size(); ++i) {
                               if (!Equals(seq.items()[i], a.positional[0])) continue;
                               if (!count) return Value(static_cast<int64_t>(i));
                               ++n;
                             }
                             if (!count) return TypeError("value is not in list");
                             return Value(n);
                           });
  }
  return Value::Undefined("");
}

int64_t NormalizeIndex(int64_t index, int64_t size) { return index < 0 ? index + size : index; }

}  // namespace

Value GetAttr(const Value& obj, std::string_view name) {
  if (IsMutatingMethod(obj, name)) {
    return Value::Undefined(absl::StrFormat("access to attribute '%s' of '%s' object is unsafe.",
                                            name, obj.TypeName()));
  }
  Value method;
  if (obj.is_string()) {
    method = StringMethod(obj.as_string(), name);
  } else if (obj.is_dict()) {
    method = DictMethod(obj, name);
  } else if (obj.is_sequence()) {
    method = SequenceMethod(obj, name);
  } else if (obj.is_namespace()) {
    const Value* found = obj.dict().Find(name);
    return found ? *found : UndefinedAttribute(obj, name);
  }
  if (!method.is_undefined()) return method;
  if (obj.is_dict()) {
    if (const Value* found = obj.dict().Find(name)) return *found;
  }
  return UndefinedAttribute(obj, name);
}

Value GetItem(const Value& obj, const Value& key) {
  if (obj.is_dict()) {
    if (const Value* found = obj.dict().Find(key)) return *found;
  } else if ((obj.is_sequence() || obj.is_string()) && (key.is_int() || key.is_bool())) {
    if (obj.is_string()) {
      std::u32string text = Decode(obj.as_string());
      int64_t i = NormalizeIndex(key.as_int(), static_cast<int64_t>(text.size()));
      if (i >= 0 && i < static_cast<int64_t>(text.size())) return Value(Encode(text.substr(i, 1)));
    } else {
      int64_t i = NormalizeIndex(key.as_int(), static_cast<int64_t>(obj.items().size()));
      if (i >= 0 && i < static_cast<int64_t>(obj.items().size())) return obj.items()[i];
    }
  }
  if (key.is_string()) return GetAttr(obj, key.as_string());
  return Value::Undefined(
      absl::StrFormat("'%s' has no element %s", ObjectTypeRepr(obj), Repr(key)));
}

absl::StatusOr<Value> GetSlice(const Value& obj, const Value* start, const Value* stop,
                               const Value* step) {
  auto bound = [](const Value* v) -> absl::StatusOr<std::optional<int64_t>> {
    if (v == nullptr || v->is_none()) return std::optional<int64_t>();
    if (!v->is_int() && !v->is_bool()) {
      return TypeError("slice indices must be integers or None");
    }
    return std::optional<int64_t>(v->as_int());
  };
  ASSIGN_OR_RETURN(std::optional<int64_t> first, bound(start));
  ASSIGN_OR_RETURN(std::optional<int64_t> last, bound(stop));
  ASSIGN_OR_RETURN(std::optional<int64_t> stride, bound(step));
  int64_t by = stride.value_or(1);
  if (by == 0) return TypeError("slice step cannot be zero");
  std::u32string text;
  int64_t size;
  if (obj.is_string()) {
    text = Decode(obj.as_string());
    size = static_cast<int64_t>(text.size());
  } else if (obj.is_sequence()) {
    size = static_cast<int64_t>(obj.items().size());
  } else {
    return Value::Undefined(absl::StrFormat("'%s' cannot be sliced", ObjectTypeRepr(obj)));
  }
  // Python's slice.indices().
  auto clamp = [&](std::optional<int64_t> v, int64_t fallback) {
    if (!v) return fallback;
    int64_t i = *v < 0 ? *v + size : *v;
    if (by > 0) return std::clamp<int64_t>(i, 0, size);
    return std::clamp<int64_t>(i, -1, size - 1);
  };
  int64_t from = clamp(first, by > 0 ? 0 : size - 1);
  int64_t to = clamp(last, by > 0 ? size : -1);
  std::vector<int64_t> picks;
  for (int64_t i = from; by > 0 ? i < to : i > to; i += by) picks.push_back(i);
  if (obj.is_string()) {
    std::u32string out;
    for (int64_t i : picks) out += text[i];
    return Value(Encode(out));
  }
  ValueList out;
  for (int64_t i : picks) out.push_back(obj.items()[i]);
  return obj.is_tuple() ? Value::Tuple(std::move(out)) : Value::List(std::move(out));
}

absl::StatusOr<ValueList> Iterate(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      return ValueList{};
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return value.items();
    case Value::Kind::kDict: {
      ValueList keys;
      for (const auto& [k, v] : value.dict().entries) keys.push_back(k);
      return keys;
    }
    case Value::Kind::kString: {
      ValueList chars;
      for (char32_t c : Decode(value.as_string())) chars.emplace_back(Encode(std::u32string(1, c)));
      return chars;
    }
    default:
      return TypeError(absl::StrFormat("'%s' object is not iterable", value.TypeName()));
  }
}

absl::StatusOr<bool> Contains(const Value& container, const Value& item) {
  if (container.is_string()) {
    if (!item.is_string()) {
      return TypeError(absl::StrFormat("'in <string>' requires string as left operand, not %s",
                                       item.TypeName()));
    }
    return container.as_string().find(item.as_string()) != std::string::npos;
  }
  if (container.is_dict()) return container.dict().Find(item) != nullptr;
  if (container.is_sequence()) {
    for (const Value& v : container.items()) {
      if (Equals(v, item)) return true;
    }
    return false;
  }
  if (container.is_undefined()) return false;
  return TypeError(absl::StrFormat("argument of type '%s' is not iterable", container.TypeName()));
}

namespace {

absl::Status OperandError(std::string_view op, const Value& left, const Value& right) {
  return TypeError(absl::StrFormat("unsupported operand type(s) for %s: '%s' and '%s'", op,
                                   left.TypeName(), right.TypeName()));
}

int64_t FloorDiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

// Python's printf-style `str % args` for the conversions templates use.
absl::StatusOr<Value> PercentFormat(const std::string& format, const Value& args) {
  ValueList values = args.is_tuple() ? args.items() : ValueList{args};
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%') {
      out += format[i];
      continue;
    }
    if (++i >= format.size()) return TypeError("incomplete format");
    char conversion = format[i];
    if (conversion == '%') {
      out += '%';
      continue;
    }
    if (next >= values.size()) return TypeError("not enough arguments for format string");
    const Value& v = values[next++];
    if (conversion == 's') {
      out += ToString(v);
    } else if (conversion == 'r') {
      out += Repr(v);
    } else if ((conversion == 'd' || conversion == 'i') && v.is_number()) {
      out +=
          absl::StrCat(v.is_float() ? static_cast<int64_t>(std::trunc(v.as_float())) : v.as_int());
    } else {
      return TypeError(
          absl::StrFormat("the format conversion '%%%c' is not supported", conversion));
    }
  }
  if (next < values.size())
    return TypeError("not all arguments converted during string formatting");
  return Value(out);
}

}  // namespace

absl::StatusOr<Value> BinaryOp(std::string_view op, const Value& left, const Value& right) {
  if (op == "~") return Value(ToString(left) + ToString(right));
  if (left.is_undefined()) return FailUndefined(left);
  if (right.is_undefined()) return FailUndefined(right);
  const bool numbers = left.is_number() && right.is_number();
  const bool floats = numbers && (left.is_float() || right.is_float());
  if (op == "+") {
    if (numbers)
      return floats ? Value(left.as_float() + right.as_float())
                    : Value(left.as_int() + right.as_int());
    if (left.is_string() && right.is_string()) return Value(left.as_string() + right.as_string());
    if (left.is_string()) {
      return TypeError(
          absl::StrFormat("can only concatenate str (not \"%s\") to str", right.TypeName()));
    }
    if (left.is_sequence() && left.kind() == right.kind()) {
      ValueList items = left.items();
      items.insert(items.end(), right.items().begin(), right.items().end());
      return left.is_tuple() ? Value::Tuple(std::move(items)) : Value::List(std::move(items));
    }
    return OperandError(op, left, right);
  }
  if (op == "-") {
    if (!numbers) return OperandError(op, left, right);
    return floats ? Value(left.as_float() - right.as_float())
                  : Value(left.as_int() - right.as_int());
  }
  if (op == "*") {
    if (numbers)
      return floats ? Value(left.as_float() * right.as_float())
                    : Value(left.as_int() * right.as_int());
    const Value& seq = left.is_number() ? right : left;
    const Value& times = left.is_number() ? left : right;
    if ((seq.is_string() || seq.is_sequence()) && (times.is_int() || times.is_bool())) {
      int64_t n = std::max<int64_t>(times.as_int(), 0);
      if (seq.is_string()) {
        std::string out;
        for (int64_t i = 0; i < n; ++i) out += seq.as_string();
        return Value(out);
      }
      ValueList items;
      for (int64_t i = 0; i < n; ++i)
        items.insert(items.end(), seq.items().begin(), seq.items().end());
      return seq.is_tuple() ? Value::Tuple(std::move(items)) : Value::List(std::move(items));
    }
    return OperandError(op, left, right);
  }
  if (op == "%" && left.is_string()) return PercentFormat(left.as_string(), right);
  if (!numbers) return OperandError(op, left, right);
  if (op == "/") {
    if (right.as_float() == 0) return TypeError("division by zero");
    return Value(left.as_float() / right.as_float());
  }
  if (op == "//" || op == "%") {
    if (right.as_float() == 0)
      return TypeError(op == "%" ? "modulo by zero" : "integer division or modulo by zero");
    if (floats) {
      double a = left.as_float(), b = right.as_float();
      double mod = std::fmod(a, b);
      if (mod != 0 && ((mod < 0) != (b < 0))) mod += b;
      if (op == "%") return Value(mod);
      // Python's float floor division: the exact quotient of a - mod by b, rounded.
      double quotient = (a - mod) / b;
      double floored = std::floor(quotient);
      if (quotient - floored > 0.5) floored += 1;
      return Value(floored);
    }
    int64_t q = FloorDiv(left.as_int(), right.as_int());
    if (op == "//") return Value(q);
    return Value(left.as_int() - q * right.as_int());
  }
  if (op == "**") {
    if (!floats && right.as_int() >= 0) {
      int64_t result = 1;
      for (int64_t i = 0; i < right.as_int(); ++i) result *= left.as_int();
      return Value(result);
    }
    return Value(std::pow(left.as_float(), right.as_float()));
  }
  return TypeError(absl::StrCat("unknown operator ", std::string(op)));
}

absl::StatusOr<Value> CallValue(const Value& callee, const CallArgs& args) {
  if (callee.is_undefined()) return FailUndefined(callee);
  if (!callee.is_callable()) {
    return TypeError(absl::StrFormat("'%s' object is not callable", callee.TypeName()));
  }
  return callee.function()(args);
}

Value BuiltinGlobal(std::string_view name) {
  if (name == "range") {
    return Value::Callable("range", [](const CallArgs& a) -> absl::StatusOr<Value> {
      int64_t start = 0, stop = 0, step = 1;
      for (const Value& v : a.positional) {
        if (!v.is_int() && !v.is_bool()) {
          return TypeError(
              absl::StrFormat("'%s' object cannot be interpreted as an integer", v.TypeName()));
        }
      }
      if (a.positional.size() == 1) {
        stop = a.positional[0].as_int();
      } else if (a.positional.size() >= 2) {
        start = a.positional[0].as_int();
        stop = a.positional[1].as_int();
        if (a.positional.size() > 2) step = a.positional[2].as_int();
      } else {
        return TypeError("range expected at least 1 argument, got 0");
      }
      if (step == 0) return TypeError("range() arg 3 must not be zero");
      ValueList out;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (out.size() >= 100000) return TypeError("range too big");
        out.emplace_back(i);
      }
      return Value::List(std::move(out));
    });
  }
  if (name == "namespace" || name == "dict") {
    bool is_namespace = name == "namespace";
    return Value::Callable(
        std::string(name), [is_namespace](const CallArgs& a) -> absl::StatusOr<Value> {
          Dict attributes;
          for (const Value& v : a.positional) {
            if (!v.is_dict())
              return TypeError("namespace()/dict() take a mapping or keyword arguments");
            for (const auto& [k, item] : v.dict().entries) attributes.Set(k, item);
          }
          for (const auto& [k, item] : a.keyword) attributes.Set(Value(k), item);
          return is_namespace ? Value::Namespace(std::move(attributes))
                              : Value::MakeDict(std::move(attributes));
        });
  }
  return Value::Undefined(absl::StrFormat("'%s' is undefined", name));
}

}  // namespace tandem::jinja