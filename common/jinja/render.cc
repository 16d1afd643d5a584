#include "common/jinja/render.h"

#include <string_view>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/jinja/filters.h"
#include "common/jinja/objects.h"
#include "common/jinja/tests.h"
#include "common/status_macros.h"

namespace tandem::jinja {
namespace {

// Marks a status whose message is final: raise_exception's, or one that already names its line.
constexpr char kFinalPayload[] = "tandem.jinja.final";

absl::Status Final(absl::Status status) {
  status.SetPayload(kFinalPayload, absl::Cord("1"));
  return status;
}

absl::Status Locate(absl::Status status, int line) {
  if (status.ok() || status.GetPayload(kFinalPayload).has_value()) return status;
  return Final(absl::InvalidArgumentError(absl::StrFormat("line %d: %s", line, status.message())));
}

// Variables set in one frame: the template's top level, a for loop, a macro call.
struct Scope {
  Scope* parent = nullptr;
  std::vector<std::pair<std::string, Value>> vars;

  const Value* Find(std::string_view name) const {
    for (const Scope* s = this; s != nullptr; s = s->parent) {
      for (const auto& [key, value] : s->vars) {
        if (key == name) return &value;
      }
    }
    return nullptr;
  }
  void Set(const std::string& name, Value value) {
    for (auto& [key, v] : vars) {
      if (key == name) {
        v = std::move(value);
        return;
      }
    }
    vars.emplace_back(name, std::move(value));
  }
};

enum class Flow { kNormal, kBreak, kContinue };

class Renderer {
 public:
  Renderer(const Value& variables, const std::function<std::tm()>& now)
      : variables_(variables), now_(now) {}

  absl::StatusOr<Flow> Exec(const Body& body, Scope& scope, std::string& out) {
    for (const NodePtr& node : body) {
      // Nested loops multiply: a bound on the statements one render runs keeps a template (or
      // a request feeding it) from holding a core for minutes.
      if (++statements_ > kMaxRenderStatements) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "the template runs more than %d statements in one render (loops nested too deep?)",
            kMaxRenderStatements));
      }
      absl::StatusOr<Flow> flow = ExecNode(*node, scope, out);
      if (!flow.ok()) return Locate(flow.status(), node->line);
      if (*flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

 private:
  int64_t statements_ = 0;  // run so far in this render (kMaxRenderStatements)

  absl::StatusOr<Flow> ExecNode(const Node& node, Scope& scope, std::string& out) {
    switch (node.kind) {
      case Node::Kind::kData:
        out += node.text;
        return Flow::kNormal;
      case Node::Kind::kOutput: {
        ASSIGN_OR_RETURN(Value value, Eval(*node.expr, scope));
        out += ToString(value);
        return Flow::kNormal;
      }
      case Node::Kind::kIf:
        for (size_t i = 0; i < node.conditions.size(); ++i) {
          ASSIGN_OR_RETURN(Value condition, Eval(*node.conditions[i], scope));
          if (Truthy(condition)) return Exec(node.bodies[i], scope, out);
        }
        if (node.bodies.size() > node.conditions.size())
          return Exec(node.bodies.back(), scope, out);
        return Flow::kNormal;
      case Node::Kind::kFor:
        RETURN_IF_ERROR(ExecFor(node, scope, out));
        return Flow::kNormal;
      case Node::Kind::kSet: {
        ASSIGN_OR_RETURN(Value value, Eval(*node.expr, scope));
        if (node.attribute.empty()) {
          scope.Set(node.targets[0], std::move(value));
          return Flow::kNormal;
        }
        const Value* target = Lookup(node.targets[0], scope);
        if (target == nullptr || !target->is_namespace()) {
          return absl::InvalidArgumentError("cannot assign attribute on non-namespace object");
        }
        target->mutable_namespace().Set(Value(node.attribute), std::move(value));
        return Flow::kNormal;
      }
      case Node::Kind::kSetBlock: {
        std::string text;
        RETURN_IF_ERROR(Exec(node.bodies[0], scope, text).status());
        Value value(std::move(text));
        if (node.filter) {
          ASSIGN_OR_RETURN(value, EvalFilter(*node.filter, scope, &value));
        }
        scope.Set(node.targets[0], std::move(value));
        return Flow::kNormal;
      }
      case Node::Kind::kFilterBlock: {
        std::string text;
        RETURN_IF_ERROR(Exec(node.bodies[0], scope, text).status());
        Value input(std::move(text));
        ASSIGN_OR_RETURN(Value value, EvalFilter(*node.filter, scope, &input));
        out += ToString(value);
        return Flow::kNormal;
      }
      case Node::Kind::kMacro:
        scope.Set(node.text, MakeMacro(node, scope));
        return Flow::kNormal;
      case Node::Kind::kBreak:
        return Flow::kBreak;
      case Node::Kind::kContinue:
        return Flow::kContinue;
      case Node::Kind::kPlain: {
        // transformers runs the block's body as a call block: names it sets stay inside.
        Scope inner{&scope, {}};
        return Exec(node.bodies[0], inner, out);
      }
    }
    return Flow::kNormal;
  }

  absl::Status Bind(const std::vector<std::string>& targets, const Value& item, Scope& scope) {
    if (targets.size() == 1) {
      scope.Set(targets[0], item);
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(ValueList parts, Iterate(item));
    if (parts.size() != targets.size()) {
      return absl::InvalidArgumentError(
          parts.size() > targets.size()
              ? absl::StrFormat("too many values to unpack (expected %d)", targets.size())
              : absl::StrFormat("not enough values to unpack (expected %d, got %d)", targets.size(),
                                parts.size()));
    }
    for (size_t i = 0; i < targets.size(); ++i) scope.Set(targets[i], parts[i]);
    return absl::OkStatus();
  }

  absl::Status ExecFor(const Node& node, Scope& scope, std::string& out) {
    ASSIGN_OR_RETURN(Value iterable, Eval(*node.expr, scope));
    if (iterable.is_none() || iterable.is_number() || iterable.is_callable() ||
        iterable.is_namespace()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("'%s' object is not iterable", iterable.TypeName()));
    }
    ASSIGN_OR_RETURN(ValueList items, Iterate(iterable));
    Scope loop_scope{&scope, {}};
    if (node.filter) {
      ValueList kept;
      for (const Value& item : items) {
        RETURN_IF_ERROR(Bind(node.targets, item, loop_scope));
        ASSIGN_OR_RETURN(Value keep, Eval(*node.filter, loop_scope));
        if (Truthy(keep)) kept.push_back(item);
      }
      items = std::move(kept);
    }
    const int64_t length = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < length; ++i) {
      RETURN_IF_ERROR(Bind(node.targets, items[i], loop_scope));
      Dict loop;
      loop.Set(Value("index"), Value(i + 1));
      loop.Set(Value("index0"), Value(i));
      loop.Set(Value("revindex"), Value(length - i));
      loop.Set(Value("revindex0"), Value(length - i - 1));
      loop.Set(Value("first"), Value(i == 0));
      loop.Set(Value("last"), Value(i == length - 1));
      loop.Set(Value("length"), Value(length));
      loop.Set(Value("depth"), Value(int64_t{1}));
      loop.Set(Value("depth0"), Value(int64_t{0}));
      if (i > 0) loop.Set(Value("previtem"), items[i - 1]);
      if (i + 1 < length) loop.Set(Value("nextitem"), items[i + 1]);
      loop.Set(Value("cycle"),
               Value::Callable("loop.cycle", [i](const CallArgs& args) -> absl::StatusOr<Value> {
                 if (args.positional.empty()) {
                   return absl::InvalidArgumentError("no items for cycling given");
                 }
                 return args.positional[i % args.positional.size()];
               }));
      loop_scope.Set("loop", Value::MakeDict(std::move(loop)));
      ASSIGN_OR_RETURN(Flow flow, Exec(node.bodies[0], loop_scope, out));
      if (flow == Flow::kBreak) break;
    }
    if (length == 0 && node.bodies.size() > 1) {
      RETURN_IF_ERROR(Exec(node.bodies[1], loop_scope, out).status());
    }
    return absl::OkStatus();
  }

  // A macro is a callable that renders its body in a fresh scope over the one it was defined in.
  Value MakeMacro(const Node& node, Scope& defined_in) {
    const Node* macro = &node;
    Scope* parent = &defined_in;
    return Value::Callable(
        node.text, [this, macro, parent](const CallArgs& args) -> absl::StatusOr<Value> {
          if (args.positional.size() > macro->params.size()) {
            return absl::InvalidArgumentError(
                absl::StrFormat("macro '%s' takes not more than %d argument(s)", macro->text,
                                macro->params.size()));
          }
          // A macro that calls itself without end (or over a value deeper than any chat needs)
          // stops here instead of overflowing the stack.
          if (call_depth_ >= kMaxCallDepth) {
            return absl::InvalidArgumentError(absl::StrFormat(
                "macro '%s': macro calls nest deeper than %d levels", macro->text, kMaxCallDepth));
          }
          ++call_depth_;
          absl::Cleanup leave = [this] { --call_depth_; };
          Scope call_scope{parent, {}};
          for (const auto& [key, value] : args.keyword) {
            bool known = false;
            for (const MacroParam& param : macro->params) known = known || param.name == key;
            if (!known) {
              return absl::InvalidArgumentError(
                  absl::StrFormat("macro '%s' takes no keyword argument '%s'", macro->text, key));
            }
          }
          for (size_t i = 0; i < macro->params.size(); ++i) {
            const MacroParam& param = macro->params[i];
            const Value* given = args.Get(i, param.name);
            if (given != nullptr) {
              call_scope.Set(param.name, *given);
            } else if (param.default_value) {
              ASSIGN_OR_RETURN(Value fallback, Eval(*param.default_value, call_scope));
              call_scope.Set(param.name, std::move(fallback));
            } else {
              call_scope.Set(param.name, Value::Undefined(absl::StrFormat(
                                             "parameter '%s' was not provided", param.name)));
            }
          }
          std::string text;
          RETURN_IF_ERROR(Exec(macro->bodies[0], call_scope, text).status());
          return Value(std::move(text));
        });
  }

  const Value* Lookup(std::string_view name, const Scope& scope) {
    if (const Value* found = scope.Find(name)) return found;
    if (const Value* found = variables_.dict().Find(name)) return found;
    return nullptr;
  }

  Value Global(std::string_view name) {
    if (name == "raise_exception") {
      return Value::Callable("raise_exception", [](const CallArgs& args) -> absl::StatusOr<Value> {
        return Final(absl::InvalidArgumentError(
            args.positional.empty() ? "" : ToString(args.positional[0])));
      });
    }
    if (name == "strftime_now") {
      return Value::Callable("strftime_now", [this](const CallArgs& args) -> absl::StatusOr<Value> {
        if (args.positional.empty() || !args.positional[0].is_string()) {
          return absl::InvalidArgumentError("strftime_now expects a format string");
        }
        std::tm now = now_();
        char buf[512];
        size_t n = std::strftime(buf, sizeof(buf), args.positional[0].as_string().c_str(), &now);
        return Value(std::string(buf, n));
      });
    }
    return BuiltinGlobal(name);
  }

  absl::StatusOr<CallArgs> EvalArgs(const Expr& expr, size_t first, Scope& scope) {
    CallArgs args;
    for (size_t i = first; i < expr.args.size(); ++i) {
      ASSIGN_OR_RETURN(Value v, Eval(*expr.args[i], scope));
      args.positional.push_back(std::move(v));
    }
    for (const auto& [key, value_expr] : expr.kwargs) {
      ASSIGN_OR_RETURN(Value v, Eval(*value_expr, scope));
      args.keyword.emplace_back(key, std::move(v));
    }
    return args;
  }

  // A filter, or a chain of them; the innermost takes `block_input` when it has no operand.
  absl::StatusOr<Value> EvalFilter(const Expr& expr, Scope& scope, const Value* block_input) {
    Value input;
    if (expr.args[0] == nullptr) {
      input = *block_input;
    } else if (expr.args[0]->kind == Expr::Kind::kFilter) {
      ASSIGN_OR_RETURN(input, EvalFilter(*expr.args[0], scope, block_input));
    } else {
      ASSIGN_OR_RETURN(input, Eval(*expr.args[0], scope));
    }
    ASSIGN_OR_RETURN(CallArgs args, EvalArgs(expr, 1, scope));
    return ApplyFilter(expr.name, input, args);
  }

  absl::StatusOr<Value> EvalDefinedObject(const Expr& expr, Scope& scope) {
    ASSIGN_OR_RETURN(Value obj, Eval(expr, scope));
    if (obj.is_undefined()) return absl::InvalidArgumentError(obj.hint());
    return obj;
  }

  absl::StatusOr<Value> Eval(const Expr& expr, Scope& scope) {
    switch (expr.kind) {
      case Expr::Kind::kConst:
        return expr.constant;
      case Expr::Kind::kName: {
        if (const Value* found = Lookup(expr.name, scope)) return *found;
        return Global(expr.name);
      }
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        ValueList items;
        for (const ExprPtr& item : expr.args) {
          ASSIGN_OR_RETURN(Value v, Eval(*item, scope));
          items.push_back(std::move(v));
        }
        return expr.kind == Expr::Kind::kList ? Value::List(std::move(items))
                                              : Value::Tuple(std::move(items));
      }
      case Expr::Kind::kDict: {
        Dict dict;
        for (size_t i = 0; i + 1 < expr.args.size(); i += 2) {
          ASSIGN_OR_RETURN(Value key, Eval(*expr.args[i], scope));
          ASSIGN_OR_RETURN(Value value, Eval(*expr.args[i + 1], scope));
          dict.Set(std::move(key), std::move(value));
        }
        return Value::MakeDict(std::move(dict));
      }
      case Expr::Kind::kGetAttr: {
        ASSIGN_OR_RETURN(Value obj, EvalDefinedObject(*expr.args[0], scope));
        return GetAttr(obj, expr.name);
      }
      case Expr::Kind::kGetItem: {
        ASSIGN_OR_RETURN(Value obj, EvalDefinedObject(*expr.args[0], scope));
        ASSIGN_OR_RETURN(Value key, Eval(*expr.args[1], scope));
        return GetItem(obj, key);
      }
      case Expr::Kind::kSlice: {
        ASSIGN_OR_RETURN(Value obj, EvalDefinedObject(*expr.args[0], scope));
        Value bounds[3];
        for (int i = 0; i < 3; ++i) {
          if (expr.args[i + 1]) {
            ASSIGN_OR_RETURN(bounds[i], Eval(*expr.args[i + 1], scope));
          }
        }
        return GetSlice(obj, expr.args[1] ? &bounds[0] : nullptr,
                        expr.args[2] ? &bounds[1] : nullptr, expr.args[3] ? &bounds[2] : nullptr);
      }
      case Expr::Kind::kCall: {
        ASSIGN_OR_RETURN(Value callee, Eval(*expr.args[0], scope));
        ASSIGN_OR_RETURN(CallArgs args, EvalArgs(expr, 1, scope));
        return CallValue(callee, args);
      }
      case Expr::Kind::kFilter:
        return EvalFilter(expr, scope, nullptr);
      case Expr::Kind::kTest: {
        ASSIGN_OR_RETURN(Value input, Eval(*expr.args[0], scope));
        ASSIGN_OR_RETURN(CallArgs args, EvalArgs(expr, 1, scope));
        ASSIGN_OR_RETURN(bool passed, ApplyTest(expr.name, input, args));
        return Value(passed);
      }
      case Expr::Kind::kNeg:
      case Expr::Kind::kPos: {
        ASSIGN_OR_RETURN(Value operand, Eval(*expr.args[0], scope));
        if (operand.is_undefined()) return absl::InvalidArgumentError(operand.hint());
        if (!operand.is_number()) {
          return absl::InvalidArgumentError(
              absl::StrFormat("bad operand type for unary %s: '%s'",
                              expr.kind == Expr::Kind::kNeg ? "-" : "+", operand.TypeName()));
        }
        if (expr.kind == Expr::Kind::kPos) {
          return operand.is_float() ? operand : Value(operand.as_int());
        }
        return operand.is_float() ? Value(-operand.as_float()) : Value(-operand.as_int());
      }
      case Expr::Kind::kNot: {
        ASSIGN_OR_RETURN(Value operand, Eval(*expr.args[0], scope));
        return Value(!Truthy(operand));
      }
      case Expr::Kind::kAnd:
      case Expr::Kind::kOr: {
        // Python's and/or give back an operand, not a bool.
        ASSIGN_OR_RETURN(Value left, Eval(*expr.args[0], scope));
        if (Truthy(left) == (expr.kind == Expr::Kind::kOr)) return left;
        return Eval(*expr.args[1], scope);
      }
      case Expr::Kind::kBinary: {
        ASSIGN_OR_RETURN(Value left, Eval(*expr.args[0], scope));
        ASSIGN_OR_RETURN(Value right, Eval(*expr.args[1], scope));
        return BinaryOp(expr.name, left, right);
      }
      case Expr::Kind::kCompare: {
        ASSIGN_OR_RETURN(Value left, Eval(*expr.args[0], scope));
        for (size_t i = 0; i < expr.ops.size(); ++i) {
          ASSIGN_OR_RETURN(Value right, Eval(*expr.args[i + 1], scope));
          ASSIGN_OR_RETURN(bool holds, CompareOp(expr.ops[i], left, right));
          if (!holds) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case Expr::Kind::kCondition: {
        ASSIGN_OR_RETURN(Value test, Eval(*expr.args[0], scope));
        if (Truthy(test)) return Eval(*expr.args[1], scope);
        if (expr.args[2]) return Eval(*expr.args[2], scope);
        return Value::Undefined(
            "the inline if-expression evaluated to false and no else section was defined.");
      }
    }
    return absl::InternalError("unknown expression");
  }

  static absl::StatusOr<bool> CompareOp(const std::string& op, const Value& left,
                                        const Value& right) {
    if (op == "==") return Equals(left, right);
    if (op == "!=") return !Equals(left, right);
    if (op == "in") return Contains(right, left);
    if (op == "notin") {
      ASSIGN_OR_RETURN(bool in, Contains(right, left));
      return !in;
    }
    if (left.is_undefined()) return absl::InvalidArgumentError(left.hint());
    if (right.is_undefined()) return absl::InvalidArgumentError(right.hint());
    ASSIGN_OR_RETURN(int c, Compare(left, right));
    if (op == "<") return c < 0;
    if (op == "<=") return c <= 0;
    if (op == ">") return c > 0;
    return c >= 0;
  }

  const Value& variables_;
  const std::function<std::tm()>& now_;
  int call_depth_ = 0;  // macro calls in progress
};

}  // namespace

absl::StatusOr<std::string> Render(const Body& body, const Value& variables,
                                   const std::function<std::tm()>& now) {
  Renderer renderer(variables, now);
  Scope root;
  std::string out;
  absl::StatusOr<Flow> flow = renderer.Exec(body, root, out);
  if (!flow.ok()) {
    absl::Status status = flow.status();
    status.ErasePayload(kFinalPayload);
    return status;
  }
  return out;
}

}  // namespace tandem::jinja
