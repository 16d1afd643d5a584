#include "common/jinja/tests.h"

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
#include "common/jinja/text.h"
#include "common/status_macros.h"

namespace tandem::jinja {
namespace {

using Test = absl::StatusOr<bool> (*)(const Value&, const CallArgs&);

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
absl::StatusOr<bool> TestTrue(const Value& v, const CallArgs&) {
  return v.is_bool() && v.as_bool();
}
absl::StatusOr<bool> TestFalse(const Value& v, const CallArgs&) {
  return v.is_bool() && !v.as_bool();
}
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
  if (other == nullptr)
    return TypeError(absl::StrCat("the '", std::string(op), "' test needs a value"));
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
  if (v.is_none() || v.is_bool() || v.is_undefined())
    return v.kind() == other->kind() && Equals(v, *other);
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
      {"!=", TestNe},
      {"<", TestLt},
      {"<=", TestLe},
      {"==", TestEq},
      {">", TestGt},
      {">=", TestGe},
      {"boolean", TestBoolean},
      {"callable", TestCallable},
      {"defined", TestDefined},
      {"divisibleby", TestDivisibleBy},
      {"eq", TestEq},
      {"equalto", TestEq},
      {"even", TestEven},
      {"false", TestFalse},
      {"float", TestFloat},
      {"ge", TestGe},
      {"greaterthan", TestGt},
      {"gt", TestGt},
      {"in", TestIn},
      {"integer", TestInteger},
      {"iterable", TestIterable},
      {"le", TestLe},
      {"lessthan", TestLt},
      {"lower", TestLowerCase},
      {"lt", TestLt},
      {"mapping", TestMapping},
      {"ne", TestNe},
      {"none", TestNone},
      {"number", TestNumber},
      {"odd", TestOdd},
      {"sameas", TestSameAs},
      {"sequence", TestSequence},
      {"string", TestString},
      {"true", TestTrue},
      {"undefined", TestUndefined},
      {"upper", TestUpperCase},
  };
  return *tests;
}

}  // namespace

bool IsTest(std::string_view name) { return Tests().count(name) > 0; }

absl::StatusOr<bool> ApplyTest(std::string_view name, const Value& input, const CallArgs& args) {
  auto it = Tests().find(name);
  if (it == Tests().end())
    return TypeError(absl::StrCat("No test named '", std::string(name), "'."));
  return it->second(input, args);
}

}  // namespace tandem::jinja
