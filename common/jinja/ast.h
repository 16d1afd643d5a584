// The parsed form of a template: expressions (Expr) and statements (Node), as Jinja2's parser
// builds them. Trees are immutable once parsed, so one parse serves any number of renders.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/jinja/value.h"

namespace tandem::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kConst,      // constant
    kName,       // name
    kList,       // args: items
    kTuple,      // args: items
    kDict,       // args: key, value, key, value, ...
    kGetAttr,    // args[0].name
    kGetItem,    // args[0][args[1]]
    kSlice,      // args[0][args[1]:args[2]:args[3]], absent bounds null
    kCall,       // args[0](args[1:], kwargs)
    kFilter,     // args[0] | name(args[1:], kwargs); args[0] null in a filter block
    kTest,       // args[0] is name(args[1:], kwargs)
    kNeg,        // -args[0]
    kPos,        // +args[0]
    kNot,        // not args[0]
    kAnd,        // args[0] and args[1]
    kOr,         // args[0] or args[1]
    kBinary,     // args[0] name args[1], name one of + - * / // % ** ~
    kCompare,    // args[0] ops[0] args[1] ops[1] args[2] ..., ops: == != < <= > >= in notin
    kCondition,  // args[1] if args[0] else args[2] (args[2] null: undefined)
  };
  Expr() = default;
  Expr(const Expr&) = delete;
  Expr& operator=(const Expr&) = delete;
  // Takes the tree apart without recursing: a chain of 100,000 `+` is 100,000 levels deep.
  ~Expr();

  Kind kind;
  int line = 0;
  Value constant;
  std::string name;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

struct MacroParam {
  std::string name;
  ExprPtr default_value;  // null: required
};

struct Node {
  enum class Kind {
    kData,      // text
    kOutput,    // {{ expr }}
    kIf,        // conditions[i] guard bodies[i]; bodies has one more entry for else when present
    kFor,       // for targets in expr [if filter]: bodies[0]; else: bodies[1]
    kSet,       // targets[0] (or targets[0].attribute) = expr
    kSetBlock,  // {% set targets[0] %}bodies[0]{% endset %}, through `filter` when set
    kMacro,     // {% macro name(params) %}bodies[0]
    kBreak,
    kContinue,
    kFilterBlock,  // {% filter filter %}bodies[0]{% endfilter %}
    kPlain,        // a block that writes its body as is ({% generation %})
  };
  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr filter;  // for-loop condition; filter of a filter block or set block
  std::vector<ExprPtr> conditions;
  std::vector<Body> bodies;
  std::vector<std::string> targets;
  std::string attribute;  // set ns.attribute
  std::vector<MacroParam> params;
};

// INVALID_ARGUMENT naming the line where an expression tree in `body` is deeper than
// `max_depth` (chains such as `a + b + ...` or `x|f|f|...` deepen a tree without deepening the
// parser's recursion); walked without recursion over expressions, the statements' own nesting
// being bounded by the parser.
absl::Status CheckExpressionDepth(const Body& body, int max_depth);

}  // namespace tandem::jinja
