#include "common/jinja/filters.h"

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
#include "common/jinja/objects.h"
#include "common/jinja/tests.h"
#include "common/jinja/text.h"
#include "common/status_macros.h"

namespace tandem::jinja {
namespace {

using Filter = absl::StatusOr<Value> (*)(const Value&, const CallArgs&);

// Attribute paths (selectattr, map, sort's `attribute=`): "a.b.0" ----

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
    case Value::Kind::kUndefined:
      return Value(int64_t{0});
    case Value::Kind::kString:
      return Value(CodePointCount(v.as_string()));
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return Value(static_cast<int64_t>(v.items().size()));
    case Value::Kind::kDict:
      return Value(static_cast<int64_t>(v.dict().entries.size()));
    default:
      return TypeError(absl::StrFormat("object of type '%s' has no len()", v.TypeName()));
  }
}

absl::StatusOr<Value> FilterUpper(const Value& v, const CallArgs&) {
  return Value(Upper(ToString(v)));
}
absl::StatusOr<Value> FilterLower(const Value& v, const CallArgs&) {
  return Value(Lower(ToString(v)));
}
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
  std::string indention = width.is_string()
                              ? width.as_string()
                              : std::string(std::max<int64_t>(width.as_int(), 0), ' ');
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
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
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
                     return SortKey(
                         attribute.is_none() ? item : AttributePath(item, ToString(attribute)),
                         case_sensitive);
                   }));
  return Value::List(std::move(items));
}

absl::StatusOr<Value> FilterSum(const Value& v, const CallArgs& a) {
  Value attribute = Arg(a, 0, "attribute", Value::None());
  Value total = Arg(a, 1, "start", Value(int64_t{0}));
  ASSIGN_OR_RETURN(ValueList items, Iterate(v));
  for (const Value& item : items) {
    ASSIGN_OR_RETURN(
        total, BinaryOp("+", total,
                        attribute.is_none() ? item : AttributePath(item, ToString(attribute))));
  }
  return total;
}

absl::StatusOr<Value> FilterMinMax(const Value& v, const CallArgs& a, bool max) {
  bool case_sensitive = Truthy(Arg(a, 0, "case_sensitive", Value(false)));
  Value attribute = Arg(a, 1, "attribute", Value::None());
  ASSIGN_OR_RETURN(ValueList items, Iterate(v));
  if (items.empty()) return Value::Undefined("No aggregated item, sequence was empty.");
  ASSIGN_OR_RETURN(items, SortValues(std::move(items), max, [&](const Value& item) {
                     return SortKey(
                         attribute.is_none() ? item : AttributePath(item, ToString(attribute)),
                         case_sensitive);
                   }));
  return items.front();
}
absl::StatusOr<Value> FilterMin(const Value& v, const CallArgs& a) {
  return FilterMinMax(v, a, false);
}
absl::StatusOr<Value> FilterMax(const Value& v, const CallArgs& a) {
  return FilterMinMax(v, a, true);
}

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
      {"abs", FilterAbs},
      {"attr", FilterAttr},
      {"batch", FilterBatch},
      {"capitalize", FilterCapitalize},
      {"center", FilterCenter},
      {"count", FilterLength},
      {"d", FilterDefault},
      {"default", FilterDefault},
      {"dictsort", FilterDictSort},
      {"e", FilterEscape},
      {"escape", FilterEscape},
      {"first", FilterFirst},
      {"float", FilterFloat},
      {"indent", FilterIndent},
      {"int", FilterInt},
      {"items", FilterItems},
      {"join", FilterJoin},
      {"last", FilterLast},
      {"length", FilterLength},
      {"list", FilterList},
      {"lower", FilterLower},
      {"map", FilterMap},
      {"max", FilterMax},
      {"min", FilterMin},
      {"reject", FilterReject},
      {"rejectattr", FilterRejectAttr},
      {"replace", FilterReplace},
      {"reverse", FilterReverse},
      {"round", FilterRound},
      {"safe", FilterSafe},
      {"select", FilterSelect},
      {"selectattr", FilterSelectAttr},
      {"sort", FilterSort},
      {"string", FilterString},
      {"sum", FilterSum},
      {"title", FilterTitle},
      {"tojson", FilterToJson},
      {"trim", FilterTrim},
      {"unique", FilterUnique},
      {"upper", FilterUpper},
      {"wordcount", FilterWordCount},
  };
  return *filters;
}

}  // namespace

bool IsFilter(std::string_view name) { return Filters().count(name) > 0; }
absl::StatusOr<Value> ApplyFilter(std::string_view name, const Value& input, const CallArgs& args) {
  auto it = Filters().find(name);
  if (it == Filters().end())
    return TypeError(absl::StrCat("No filter named '", std::string(name), "'."));
  return it->second(input, args);
}

}  // namespace tandem::jinja
