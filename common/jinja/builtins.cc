#include "common/jinja/builtins.h"

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
#include "common/jinja/text.h"
#include "common/status_macros.h"

namespace tandem::jinja {
namespace {

using Filter = absl::StatusOr<Value> (*)(const Value&, const CallArgs&);
using Test = absl::StatusOr<bool> (*)(const Value&, const CallArgs&);

absl::Status TypeError(const std::string& message) {
  return absl::InvalidArgumentError(message);
}

// Jinja2's object_type_repr: "dict object", "None".
std::string ObjectTypeRepr(const Value& value) {
  if (value.is_none()) return "None";
  return value.TypeName() + " object";
}

Value UndefinedAttribute(const Value& obj, std::string_view name) {
  return Value::Undefined(absl::StrFormat("'%s' has no attribute '%s'", ObjectTypeRepr(obj), name));
}

absl::Status FailUndefined(const Value& value) {
  return absl::InvalidArgumentError(value.hint().empty() ? "undefined value" : value.hint());
}

// An argument by position or name, or `fallback`.
Value Arg(const CallArgs& args, size_t index, std::string_view name, Value fallback) {
  const Value* v = args.Get(index, name);
  return v ? *v : fallback;
}

absl::StatusOr<std::string> StringArg(const CallArgs& args, size_t index, std::string_view name,
                                      std::string_view what) {
  const Value* v = args.Get(index, name);
  if (v == nullptr || !v->is_string()) {
    return TypeError(absl::StrCat(std::string(what), " expects a string argument '", std::string(name), "'"));
  }
  return v->as_string();
}

std::optional<std::string> OptionalString(const CallArgs& args, size_t index,
                                          std::string_view name) {
  const Value* v = args.Get(index, name);
  if (v == nullptr || v->is_none() || !v->is_string()) return std::nullopt;
  return v->as_string();
}

Value StringList(const std::vector<std::string>& parts) {
  ValueList items;
  for (const std::string& part : parts) items.emplace_back(part);
  return Value::List(std::move(items));
}

int64_t CodePointCount(const std::string& s) {
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

// ---- attribute paths (selectattr, map, sort's `attribute=`): "a.b.0" ----

Value AttributePath(const Value& item, const std::string& path) {
  Value current = item;
  for (absl::string_view part : absl::StrSplit(path, '.')) {
    int64_t index;
    if (absl::SimpleAtoi(part, &index)) {
      current = GetItem(current, Value(index));
    } else {
      current = GetItem(current, Value(std::string(part)));
    }
    if (current.is_undefined()) break;
  }
  return current;
}

// Jinja2's ignore_case: strings compare lower-cased unless case_sensitive.
Value SortKey(const Value& value, bool case_sensitive) {
  if (!case_sensitive && value.is_string()) return Value(Lower(value.as_string()));
  return value;
}

absl::StatusOr<ValueList> SortValues(ValueList items, bool reverse,
                                     const std::function<Value(const Value&)>& key) {
  absl::Status status;
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    absl::StatusOr<int> c = Compare(key(a), key(b));
    if (!c.ok()) {
      status = c.status();
      return false;
    }
    return reverse ? *c > 0 : *c < 0;
  });
  RETURN_IF_ERROR(status);
  return items;
}

// ---- filters ----

absl::StatusOr<Value> FilterTrim(const Value& v, const CallArgs& a) {
  return Value(Strip(ToString(v), OptionalString(a, 0, "chars"), StripSide::kBoth));
}

absl::StatusOr<Value> FilterToJson(const Value& v, const CallArgs& a) {
  // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
  JsonOptions options;
  options.ensure_ascii = Truthy(Arg(a, 0, "ensure_ascii", Value(false)));
  Value indent = Arg(a, 1, "indent", Value::None());
  if (indent.is_int()) {
    options.indent = static_cast<int>(indent.as_int());
  } else if (indent.is_string()) {
    options.indent_string = indent.as_string();
    options.indent = 0;
  }
  if (options.indent >= 0) options.item_separator = ",";
  Value separators = Arg(a, 2, "separators", Value::None());
  if (separators.is_sequence() && separators.items().size() == 2 &&
      separators.items()[0].is_string() && separators.items()[1].is_string()) {
    options.item_separator = separators.items()[0].as_string();
    options.key_separator = separators.items()[1].as_string();
  }
  options.sort_keys = Truthy(Arg(a, 3, "sort_keys", Value(false)));
  ASSIGN_OR_RETURN(std::string json, ToJson(v, options));
  return Value(std::move(json));
}

absl::StatusOr<Value> FilterLength(const Value& v, const CallArgs&) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return Value(int64_t{0});
    case Value::Kind::kString: return Value(CodePointCount(v.as_string()));
    case Value::Kind::kList:
    case Value::Kind::kTuple: return Value(static_cast<int64_t>(v.items().size()));
    case Value::Kind::kDict: return Value(static_cast<int64_t>(v.dict().entries.size()));
    default: return TypeError(absl::StrFormat("object of type '%s' has no len()", v.TypeName()));
  }
}

absl::StatusOr<Value> FilterUpper(const Value& v, const CallArgs&) { return Value(Upper(ToString(v))); }
absl::StatusOr<Value> FilterLower(const Value& v, const CallArgs&) { return Value(Lower(ToString(v))); }
absl::StatusOr<Value> FilterCapitalize(const Value& v, const CallArgs&) {
  return Value(Capitalize(ToString(v)));
}

// Jinja2's title: each run after `-`, whitespace or an opening bracket starts a word.
absl::StatusOr<Value> FilterTitle(const Value& v, const CallArgs&) {
  std::u32string text = Decode(ToString(v));
  std::string out;
  bool word_start = true;
  for (char32_t c : text) {
    bool separator = c == '-' || IsSpace(c) || c == '(' || c == '{' || c == '[' || c == '<';
    std::string one = Encode(std::u32string(1, c));
    if (separator) {
      out += one;
      word_start = true;
    } else {
      out += word_start ? Upper(one) : Lower(one);
      word_start = false;
    }
  }
  return Value(out);
}

absl::StatusOr<Value> FilterReplace(const Value& v, const CallArgs& a) {
  Value from = Arg(a, 0, "old", Value(""));
  Value to = Arg(a, 1, "new", Value(""));
  Value count = Arg(a, 2, "count", Value::None());
  return Value(Replace(ToString(v), ToString(from), ToString(to),
                       count.is_int() ? static_cast<int>(count.as_int()) : -1));
}

absl::StatusOr<Value> FilterJoin(const Value& v, const CallArgs& a) {
  std::string separator = ToString(Arg(a, 0, "d", Value("")));
  Value attribute = Arg(a, 1, "attribute", Value::None());
  ASSIGN_OR_RETURN(ValueList items, Iterate(v));
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += separator;
    out += ToString(attribute.is_none() ? items[i] : AttributePath(items[i], ToString(attribute)));
  }
  return Value(out);
}

absl::StatusOr<Value> FilterFirst(const Value& v, const CallArgs&) {
  ASSIGN_OR_RETURN(ValueList items, Iterate(v));
  if (items.empty()) return Value::Undefined("No first item, sequence was empty.");
  return items.front();
}

absl::StatusOr<Value> FilterLast(const Value& v, const CallArgs&) {
  ASSIGN_OR_RETURN(ValueList items, Iterate(v));
  if (items.empty()) return Value::Undefined("No last item, sequence was empty.");
  return items.back();
}

absl::StatusOr<Value> FilterDefault(const Value& v, const CallArgs& a) {
  Value fallback = Arg(a, 0, "default_value", Value(""));
  bool boolean = Truthy(Arg(a, 1, "boolean", Value(false)));
  if (v.is_undefined() || (boolean && !Truthy(v))) return fallback;
  return v;
}

absl::StatusOr<Value> FilterList(const Value& v, const CallArgs&) {
  ASSIGN_OR_RETURN(ValueList items, Iterate(v));
  return Value::List(std::move(items));
}

absl::StatusOr<Value> FilterItems(const Value& v, const CallArgs&) {
  if (v.is_undefined()) return Value::List({});
  if (!v.is_dict()) return TypeError("Can only get item pairs from a mapping.");
  ValueList items;
  for (const auto& [key, value] : v.dict().entries) items.push_back(Value::Tuple({key, value}));
  return Value::List(std::move(items));
}

absl::StatusOr<Value> FilterMap(const Value& v, const CallArgs& a) {
  // Jinja2 maps nothing over a false value (None included) without iterating it.
  if (!Truthy(v)) return Value::List({});
  ASSIGN_OR_RETURN(ValueList items, Iterate(v));
  ValueList out;
  if (const Value* attribute = a.Keyword("attribute")) {
    const Value* fallback = a.Keyword("default");
    for (const Value& item : items) {
      Value mapped = AttributePath(item, ToString(*attribute));
      out.push_back(mapped.is_undefined() && fallback ? *fallback : mapped);
    }
    return Value::List(std::move(out));
  }
  if (a.positional.empty() || !a.positional[0].is_string()) {
    return TypeError("map expects a filter name or attribute=");
  }
  const std::string name = a.positional[0].as_string();
  if (!IsFilter(name)) return TypeError(absl::StrCat("No filter named '", std::string(name), "'."));
  CallArgs rest;
  rest.positional.assign(a.positional.begin() + 1, a.positional.end());
  rest.keyword = a.keyword;
  for (const Value& item : items) {
    ASSIGN_OR_RETURN(Value mapped, ApplyFilter(name, item, rest));
    out.push_back(std::move(mapped));
  }
  return Value::List(std::move(out));
}

// select/reject/selectattr/rejectattr: keep items whose (attribute's) test passes (or fails).
absl::StatusOr<Value> SelectOrReject(const Value& v, const CallArgs& a, bool by_attribute,
                                     bool keep) {
  // Jinja2 selects nothing from a false value (None included) without iterating it.
  if (!Truthy(v)) return Value::List({});
  ASSIGN_OR_RETURN(ValueList items, Iterate(v));
  size_t next = 0;
  std::string attribute;
  if (by_attribute) {
    if (a.positional.empty()) return TypeError("selectattr/rejectattr need an attribute");
    attribute = ToString(a.positional[next++]);
  }
  std::string test;
  CallArgs test_args;
  if (next < a.positional.size()) {
    test = ToString(a.positional[next++]);
    if (!IsTest(test)) return TypeError(absl::StrCat("No test named '", test, "'."));
    test_args.positional.assign(a.positional.begin() + next, a.positional.end());
    test_args.keyword = a.keyword;
  }
  ValueList out;
  for (const Value& item : items) {
    Value subject = by_attribute ? AttributePath(item, attribute) : item;
    bool passed;
    if (test.empty()) {
      passed = Truthy(subject);
    } else {
      ASSIGN_OR_RETURN(passed, ApplyTest(test, subject, test_args));
    }
    if (passed == keep) out.push_back(item);
  }
  return Value::List(std::move(out));
}

absl::StatusOr<Value> FilterSelect(const Value& v, const CallArgs& a) {
  return SelectOrReject(v, a, false, true);
}
absl::StatusOr<Value> FilterReject(const Value& v, const CallArgs& a) {
  return SelectOrReject(v, a, false, false);
}
absl::StatusOr<Value> FilterSelectAttr(const Value& v, const CallArgs& a) {
  return SelectOrReject(v, a, true, true);
}
absl::StatusOr<Value> FilterRejectAttr(const Value& v, const CallArgs& a) {
  return SelectOrReject(v, a, true, false);
}

absl::StatusOr<Value> FilterString(const Value& v, const CallArgs&) { return Value(ToString(v)); }

absl::StatusOr<Value> FilterInt(const Value& v, const CallArgs& a) {
  Value fallback = Arg(a, 0, "default", Value(int64_t{0}));
  if (v.is_int() || v.is_bool()) return Value(v.as_int());
  if (v.is_float()) return Value(static_cast<int64_t>(std::trunc(v.as_float())));
  if (v.is_string()) {
    std::string text = Strip(v.as_string(), std::nullopt, StripSide::kBoth);
    text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
    int64_t i;
    if (absl::SimpleAtoi(text, &i)) return Value(i);
    double d;
    if (absl::SimpleAtod(text, &d) && std::isfinite(d)) {
      return Value(static_cast<int64_t>(std::trunc(d)));
    }
  }
  return fallback;
}

absl::StatusOr<Value> FilterFloat(const Value& v, const CallArgs& a) {
  Value fallback = Arg(a, 0, "default", Value(0.0));
  if (v.is_number()) return Value(v.as_float());
  if (v.is_string()) {
    double d;
    if (absl::SimpleAtod(Strip(v.as_string(), std::nullopt, StripSide::kBoth), &d)) return Value(d);
  }
  return fallback;
}

absl::StatusOr<Value> FilterAbs(const Value& v, const CallArgs&) {
  if (v.is_float()) return Value(std::fabs(v.as_float()));
  if (v.is_int() || v.is_bool()) return Value(std::abs(v.as_int()));
  return TypeError(absl::StrFormat("bad operand type for abs(): '%s'", v.TypeName()));
}

absl::StatusOr<Value> FilterRound(const Value& v, const CallArgs& a) {
  int precision = static_cast<int>(Arg(a, 0, "precision", Value(int64_t{0})).as_int());
  std::string method = ToString(Arg(a, 1, "method", Value("common")));
  if (!v.is_number()) {
    return TypeError(absl::StrFormat("type %s doesn't define __round__ method", v.TypeName()));
  }
  double x = v.as_float();
  double scale = std::pow(10.0, precision);
  if (method == "ceil") return Value(std::ceil(x * scale) / scale);
  if (method == "floor") return Value(std::floor(x * scale) / scale);
  if (method != "common") return TypeError("method must be 'common', 'ceil' or 'floor'");
  // Python's round(x, n): correctly rounded, ties to even; an int stays an int.
  if (!v.is_float()) return Value(v.as_int());
  char buf[512];
  std::snprintf(buf, sizeof(buf), "%.*f", std::max(precision, 0), x);
  double rounded = std::strtod(buf, nullptr);
  if (precision < 0) rounded = std::nearbyint(x * scale) / scale;
  return Value(rounded);
}

absl::StatusOr<Value> FilterUnique(const Value& v, const CallArgs& a) {
  bool case_sensitive = Truthy(Arg(a, 0, "case_sensitive", Value(false)));
  Value attribute = Arg(a, 1, "attribute", Value::None());
  ASSIGN_OR_RETURN(ValueList items, Iterate(v));
  ValueList out, seen;
  for (const Value& item : items) {
    Value key = SortKey(attribute.is_none() ? item : AttributePath(item, ToString(attribute)),
                        case_sensitive);
    if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return Equals(s, key); })) {
      continue;
    }
    seen.push_back(key);
    out.push_back(item);
  }
  return Value::List(std::move(out));
}

absl::StatusOr<Value> FilterIndent(const Value& v, const CallArgs& a) {
  Value width = Arg(a, 0, "width", Value(int64_t{4}));
  bool first = Truthy(Arg(a, 1, "first", Value(false)));
  bool blank = Truthy(Arg(a, 2, "blank", Value(false)));
  std::string indention =
      width.is_string() ? width.as_string() : std::string(std::max<int64_t>(width.as_int(), 0), ' ');
  std::vector<std::string> lines = SplitLines(ToString(v) + "\n");
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i == 0) {
      out = lines[0];
      continue;
    }
    out += "\n";
    if (blank || !lines[i].empty()) out += indention;
    out += lines[i];
  }
  if (first) out = indention + out;
  return Value(out);
}

absl::StatusOr<Value> FilterSafe(const Value& v, const CallArgs&) {
  return v.is_string() ? v : Value(ToString(v));
}

absl::StatusOr<Value> FilterEscape(const Value& v, const CallArgs&) {
  std::string out;
  for (char c : ToString(v)) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return Value(out);
}

absl::StatusOr<Value> FilterDictSort(const Value& v, const CallArgs& a) {
  if (!v.is_dict()) return TypeError("dictsort expects a mapping");
  bool case_sensitive = Truthy(Arg(a, 0, "case_sensitive", Value(false)));
  std::string by = ToString(Arg(a, 1, "by", Value("key")));
  bool reverse = Truthy(Arg(a, 2, "reverse", Value(false)));
  ValueList items;
  for (const auto& [key, value] : v.dict().entries) items.push_back(Value::Tuple({key, value}));
  const size_t pos = by == "value" ? 1 : 0;
  ASSIGN_OR_RETURN(items, SortValues(std::move(items), reverse, [&](const Value& item) {
    return SortKey(item.items()[pos], case_sensitive);
  }));
  return Value::List(std::move(items));
}

absl::StatusOr<Value> FilterReverse(const Value& v, const CallArgs&) {
  if (v.is_string()) {
    std::u32string text = Decode(v.as_string());
    std::reverse(text.begin(), text.end());
    return Value(Encode(text));
  }
  ASSIGN_OR_RETURN(ValueList items, Iterate(v));
  std::reverse(items.begin(), items.end());
  return Value::List(std::move(items));
}

absl::StatusOr<Value> FilterSort(const Value& v, const CallArgs& a) {
  bool reverse = Truthy(Arg(a, 0, "reverse", Value(false)));
  bool case_sensitive = Truthy(Arg(a, 1, "case_sensitive", Value(false)));
  Value attribute = Arg(a, 2, "attribute", Value::None());
  ASSIGN_OR_RETURN(ValueList items, Iterate(v));
  ASSIGN_OR_RETURN(items, SortValues(std::move(items), reverse, [&](const Value& item) {
    return SortKey(attribute.is_none() ? item : AttributePath(item, ToString(attribute)),
                   case_sensitive);
  }));
  return Value::List(std::move(items));
}

absl::StatusOr<Value> FilterSum(const Value& v, const CallArgs& a) {
  Value attribute = Arg(a, 0, "attribute", Value::None());
  Value total = Arg(a, 1, "start", Value(int64_t{0}));
  ASSIGN_OR_RETURN(ValueList items, Iterate(v));
  for (const Value& item : items) {
    ASSIGN_OR_RETURN(total, BinaryOp("+", total,
                                     attribute.is_none() ? item
                                                         : AttributePath(item, ToString(attribute))));
  }
  return total;
}

absl::StatusOr<Value> FilterMinMax(const Value& v, const CallArgs& a, bool max) {
  bool case_sensitive = Truthy(Arg(a, 0, "case_sensitive", Value(false)));
  Value attribute = Arg(a, 1, "attribute", Value::None());
  ASSIGN_OR_RETURN(ValueList items, Iterate(v));
  if (items.empty()) return Value::Undefined("No aggregated item, sequence was empty.");
  ASSIGN_OR_RETURN(items, SortValues(std::move(items), max, [&](const Value& item) {
    return SortKey(attribute.is_none() ? item : AttributePath(item, ToString(attribute)),
                   case_sensitive);
  }));
  return items.front();
}
absl::StatusOr<Value> FilterMin(const Value& v, const CallArgs& a) { return FilterMinMax(v, a, false); }
absl::StatusOr<Value> FilterMax(const Value& v, const CallArgs& a) { return FilterMinMax(v, a, true); }

absl::StatusOr<Value> FilterBatch(const Value& v, const CallArgs& a) {
  int64_t count = Arg(a, 0, "linecount", Value(int64_t{1})).as_int();
  const Value* fill = a.Get(1, "fill_with");
  if (count <= 0) return TypeError("batch needs a positive line count");
  ASSIGN_OR_RETURN(ValueList items, Iterate(v));
  ValueList out, row;
  for (const Value& item : items) {
    row.push_back(item);
    if (static_cast<int64_t>(row.size()) == count) {
      out.push_back(Value::List(std::move(row)));
      row.clear();
    }
  }
  if (!row.empty()) {
    if (fill && !fill->is_none()) {
      while (static_cast<int64_t>(row.size()) < count) row.push_back(*fill);
    }
    out.push_back(Value::List(std::move(row)));
  }
  return Value::List(std::move(out));
}

absl::StatusOr<Value> FilterWordCount(const Value& v, const CallArgs&) {
  int64_t words = 0;
  bool in_word = false;
  for (char32_t c : Decode(ToString(v))) {
    bool word_char = c == '_' || u_isalnum(static_cast<UChar32>(c));
    if (word_char && !in_word) ++words;
    in_word = word_char;
  }
  return Value(words);
}

absl::StatusOr<Value> FilterAttr(const Value& v, const CallArgs& a) {
  ASSIGN_OR_RETURN(std::string name, StringArg(a, 0, "name", "attr"));
  if (v.is_undefined()) return FailUndefined(v);
  return GetAttr(v, name);
}

absl::StatusOr<Value> FilterCenter(const Value& v, const CallArgs& a) {
  std::u32string text = Decode(ToString(v));
  int64_t width = Arg(a, 0, "width", Value(int64_t{80})).as_int();
  if (static_cast<int64_t>(text.size()) >= width) return Value(ToString(v));
  int64_t pad = width - text.size();
  // Python's str.center puts the extra space on the right unless the text length is odd.
  int64_t left = pad / 2 + (pad & width & 1);
  return Value(std::string(left, ' ') + ToString(v) + std::string(pad - left, ' '));
}

const std::map<std::string, Filter, std::less<>>& Filters() {
  static const auto* filters = new std::map<std::string, Filter, std::less<>>{
      {"abs", FilterAbs},           {"attr", FilterAttr},
      {"batch", FilterBatch},       {"capitalize", FilterCapitalize},
      {"center", FilterCenter},     {"count", FilterLength},
      {"d", FilterDefault},         {"default", FilterDefault},
      {"dictsort", FilterDictSort}, {"e", FilterEscape},
      {"escape", FilterEscape},     {"first", FilterFirst},
      {"float", FilterFloat},       {"indent", FilterIndent},
      {"int", FilterInt},           {"items", FilterItems},
      {"join", FilterJoin},         {"last", FilterLast},
      {"length", FilterLength},     {"list", FilterList},
      {"lower", FilterLower},       {"map", FilterMap},
      {"max", FilterMax},           {"min", FilterMin},
      {"reject", FilterReject},     {"rejectattr", FilterRejectAttr},
      {"replace", FilterReplace},   {"reverse", FilterReverse},
      {"round", FilterRound},       {"safe", FilterSafe},
      {"select", FilterSelect},     {"selectattr", FilterSelectAttr},
      {"sort", FilterSort},         {"string", FilterString},
      {"sum", FilterSum},           {"title", FilterTitle},
      {"tojson", FilterToJson},     {"trim", FilterTrim},
      {"unique", FilterUnique},     {"upper", FilterUpper},
      {"wordcount", FilterWordCount},
  };
  return *filters;
}

// ---- tests ----

absl::StatusOr<bool> TestDefined(const Value& v, const CallArgs&) { return !v.is_undefined(); }
absl::StatusOr<bool> TestUndefined(const Value& v, const CallArgs&) { return v.is_undefined(); }
absl::StatusOr<bool> TestNone(const Value& v, const CallArgs&) { return v.is_none(); }
absl::StatusOr<bool> TestString(const Value& v, const CallArgs&) { return v.is_string(); }
absl::StatusOr<bool> TestMapping(const Value& v, const CallArgs&) { return v.is_dict(); }
// Undefined counts: Jinja2's Undefined defines __iter__, __len__ and __getitem__.
absl::StatusOr<bool> TestIterable(const Value& v, const CallArgs&) {
  return v.is_string() || v.is_sequence() || v.is_dict() || v.is_undefined();
}
absl::StatusOr<bool> TestSequence(const Value& v, const CallArgs& a) { return TestIterable(v, a); }
absl::StatusOr<bool> TestNumber(const Value& v, const CallArgs&) { return v.is_number(); }
absl::StatusOr<bool> TestInteger(const Value& v, const CallArgs&) { return v.is_int(); }
absl::StatusOr<bool> TestFloat(const Value& v, const CallArgs&) { return v.is_float(); }
absl::StatusOr<bool> TestBoolean(const Value& v, const CallArgs&) { return v.is_bool(); }
absl::StatusOr<bool> TestTrue(const Value& v, const CallArgs&) { return v.is_bool() && v.as_bool(); }
absl::StatusOr<bool> TestFalse(const Value& v, const CallArgs&) { return v.is_bool() && !v.as_bool(); }
absl::StatusOr<bool> TestCallable(const Value& v, const CallArgs&) { return v.is_callable(); }

absl::StatusOr<int64_t> IntOperand(const Value& v, std::string_view test) {
  if (v.is_int() || v.is_bool()) return v.as_int();
  if (v.is_undefined()) return FailUndefined(v);
  return TypeError(absl::StrFormat("the '%s' test needs an integer, not %s", test, v.TypeName()));
}

absl::StatusOr<bool> TestEven(const Value& v, const CallArgs&) {
  ASSIGN_OR_RETURN(int64_t i, IntOperand(v, "even"));
  return i % 2 == 0;
}
absl::StatusOr<bool> TestOdd(const Value& v, const CallArgs&) {
  ASSIGN_OR_RETURN(int64_t i, IntOperand(v, "odd"));
  return i % 2 != 0;
}
absl::StatusOr<bool> TestDivisibleBy(const Value& v, const CallArgs& a) {
  ASSIGN_OR_RETURN(int64_t i, IntOperand(v, "divisibleby"));
  const Value* by = a.Get(0, "num");
  if (by == nullptr) return TypeError("divisibleby needs a number");
  ASSIGN_OR_RETURN(int64_t n, IntOperand(*by, "divisibleby"));
  if (n == 0) return TypeError("integer division or modulo by zero");
  return ((i % n) + n) % n == 0;
}

absl::StatusOr<bool> CompareTest(const Value& v, const CallArgs& a, std::string_view op) {
  const Value* other = a.Get(0, "other");
  if (other == nullptr) return TypeError(absl::StrCat("the '", std::string(op), "' test needs a value"));
  if (op == "==") return Equals(v, *other);
  if (op == "!=") return !Equals(v, *other);
  if (v.is_undefined()) return FailUndefined(v);
  if (other->is_undefined()) return FailUndefined(*other);
  ASSIGN_OR_RETURN(int c, Compare(v, *other));
  if (op == "<") return c < 0;
  if (op == "<=") return c <= 0;
  if (op == ">") return c > 0;
  return c >= 0;
}
absl::StatusOr<bool> TestEq(const Value& v, const CallArgs& a) { return CompareTest(v, a, "=="); }
absl::StatusOr<bool> TestNe(const Value& v, const CallArgs& a) { return CompareTest(v, a, "!="); }
absl::StatusOr<bool> TestLt(const Value& v, const CallArgs& a) { return CompareTest(v, a, "<"); }
absl::StatusOr<bool> TestLe(const Value& v, const CallArgs& a) { return CompareTest(v, a, "<="); }
absl::StatusOr<bool> TestGt(const Value& v, const CallArgs& a) { return CompareTest(v, a, ">"); }
absl::StatusOr<bool> TestGe(const Value& v, const CallArgs& a) { return CompareTest(v, a, ">="); }

absl::StatusOr<bool> TestIn(const Value& v, const CallArgs& a) {
  const Value* seq = a.Get(0, "seq");
  if (seq == nullptr) return TypeError("the 'in' test needs a container");
  return Contains(*seq, v);
}

absl::StatusOr<bool> TestSameAs(const Value& v, const CallArgs& a) {
  const Value* other = a.Get(0, "other");
  if (other == nullptr) return TypeError("the 'sameas' test needs a value");
  // Python's `is`: singletons and small values compare by identity; containers only with
  // themselves.
  if (v.is_none() || v.is_bool() || v.is_undefined()) return v.kind() == other->kind() && Equals(v, *other);
  if (v.is_namespace() || v.is_callable()) return v.identity() == other->identity();
  return false;
}

absl::StatusOr<bool> TestLowerCase(const Value& v, const CallArgs&) {
  return v.is_string() && Lower(v.as_string()) == v.as_string();
}
absl::StatusOr<bool> TestUpperCase(const Value& v, const CallArgs&) {
  return v.is_string() && Upper(v.as_string()) == v.as_string();
}

const std::map<std::string, Test, std::less<>>& Tests() {
  static const auto* tests = new std::map<std::string, Test, std::less<>>{
      {"!=", TestNe},          {"<", TestLt},
      {"<=", TestLe},          {"==", TestEq},
      {">", TestGt},           {">=", TestGe},
      {"boolean", TestBoolean}, {"callable", TestCallable},
      {"defined", TestDefined}, {"divisibleby", TestDivisibleBy},
      {"eq", TestEq},          {"equalto", TestEq},
      {"even", TestEven},      {"false", TestFalse},
      {"float", TestFloat},    {"ge", TestGe},
      {"greaterthan", TestGt}, {"gt", TestGt},
      {"in", TestIn},          {"integer", TestInteger},
      {"iterable", TestIterable}, {"le", TestLe},
      {"lessthan", TestLt},    {"lower", TestLowerCase},
      {"lt", TestLt},          {"mapping", TestMapping},
      {"ne", TestNe},          {"none", TestNone},
      {"number", TestNumber},  {"odd", TestOdd},
      {"sameas", TestSameAs},  {"sequence", TestSequence},
      {"string", TestString},  {"true", TestTrue},
      {"undefined", TestUndefined}, {"upper", TestUpperCase},
  };
  return *tests;
}

// ---- methods ----

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
    if (o.size() <= s.size() &&
        (suffix ? s.compare(s.size() - o.size(), o.size(), o) == 0 : s.compare(0, o.size(), o) == 0)) {
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
    return method([s](const CallArgs&) -> absl::StatusOr<Value> { return StringList(SplitLines(s)); });
  }
  if (name == "startswith" || name == "endswith") {
    bool suffix = name == "endswith";
    return method([s, suffix](const CallArgs& a) { return PrefixTest(s, a, suffix); });
  }
  if (name == "upper") return method([s](const CallArgs&) -> absl::StatusOr<Value> { return Value(Upper(s)); });
  if (name == "lower") return method([s](const CallArgs&) -> absl::StatusOr<Value> { return Value(Lower(s)); });
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
        for (size_t pos = s.find(sub); pos != std::string::npos; pos = s.find(sub, pos + sub.size())) ++n;
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
        bool ok = which == "isdigit" ? u_isdigit(c)
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
  if (name == "items") return method([dict](const CallArgs& a) { return FilterItems(dict, a); });
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
  if (name == "copy") return method([dict](const CallArgs&) -> absl::StatusOr<Value> { return dict; });
  return Value::Undefined("");
}

// The immutable sandbox refuses methods that change a list or dict.
bool IsMutatingMethod(const Value& obj, std::string_view name) {
  static const char* const kList[] = {"append", "extend", "insert", "pop", "remove", "reverse",
                                      "sort", "clear", "__setitem__", "__delitem__"};
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

bool IsFilter(std::string_view name) { return Filters().count(name) > 0; }
bool IsTest(std::string_view name) { return Tests().count(name) > 0; }

absl::StatusOr<Value> ApplyFilter(std::string_view name, const Value& input, const CallArgs& args) {
  auto it = Filters().find(name);
  if (it == Filters().end()) return TypeError(absl::StrCat("No filter named '", std::string(name), "'."));
  return it->second(input, args);
}

absl::StatusOr<bool> ApplyTest(std::string_view name, const Value& input, const CallArgs& args) {
  auto it = Tests().find(name);
  if (it == Tests().end()) return TypeError(absl::StrCat("No test named '", std::string(name), "'."));
  return it->second(input, args);
}

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
  return TypeError(
      absl::StrFormat("argument of type '%s' is not iterable", container.TypeName()));
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
      out += absl::StrCat(v.is_float() ? static_cast<int64_t>(std::trunc(v.as_float())) : v.as_int());
    } else {
      return TypeError(absl::StrFormat("the format conversion '%%%c' is not supported", conversion));
    }
  }
  if (next < values.size()) return TypeError("not all arguments converted during string formatting");
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
    if (numbers) return floats ? Value(left.as_float() + right.as_float()) : Value(left.as_int() + right.as_int());
    if (left.is_string() && right.is_string()) return Value(left.as_string() + right.as_string());
    if (left.is_string()) {
      return TypeError(absl::StrFormat("can only concatenate str (not \"%s\") to str", right.TypeName()));
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
    return floats ? Value(left.as_float() - right.as_float()) : Value(left.as_int() - right.as_int());
  }
  if (op == "*") {
    if (numbers) return floats ? Value(left.as_float() * right.as_float()) : Value(left.as_int() * right.as_int());
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
      for (int64_t i = 0; i < n; ++i) items.insert(items.end(), seq.items().begin(), seq.items().end());
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
    if (right.as_float() == 0) return TypeError(op == "%" ? "modulo by zero" : "integer division or modulo by zero");
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
          return TypeError(absl::StrFormat("'%s' object cannot be interpreted as an integer", v.TypeName()));
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
    return Value::Callable(std::string(name), [is_namespace](const CallArgs& a) -> absl::StatusOr<Value> {
      Dict attributes;
      for (const Value& v : a.positional) {
        if (!v.is_dict()) return TypeError("namespace()/dict() take a mapping or keyword arguments");
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
