// The parsed tree's behaviour: taking a deep expression apart and measuring its depth, both
// without recursion.
#include "common/jinja/ast.h"

#include "absl/strings/str_format.h"

namespace tandem::jinja {

Expr::~Expr() {
  std::vector<ExprPtr> pending;
  auto take_children = [&pending](Expr& expr) {
    for (ExprPtr& arg : expr.args) {
      if (arg != nullptr) pending.push_back(std::move(arg));
    }
    for (auto& [name, value] : expr.kwargs) {
      if (value != nullptr) pending.push_back(std::move(value));
    }
  };
  take_children(*this);
  while (!pending.empty()) {
    ExprPtr expr = std::move(pending.back());
    pending.pop_back();
    take_children(*expr);
  }  // `expr` is destroyed childless here, so its own destructor does not recurse
}

absl::Status CheckExpressionDepth(const Body& body, int max_depth) {
  std::vector<std::pair<const Expr*, int>> pending;
  std::vector<const Body*> bodies = {&body};
  while (!bodies.empty()) {
    const Body* b = bodies.back();
    bodies.pop_back();
    for (const NodePtr& node : *b) {
      for (const Expr* root : {node->expr.get(), node->filter.get()}) {
        if (root != nullptr) pending.push_back({root, 1});
      }
      for (const ExprPtr& c : node->conditions) pending.push_back({c.get(), 1});
      for (const MacroParam& p : node->params) {
        if (p.default_value) pending.push_back({p.default_value.get(), 1});
      }
      for (const Body& inner : node->bodies) bodies.push_back(&inner);
    }
  }
  while (!pending.empty()) {
    const auto [expr, depth] = pending.back();
    pending.pop_back();
    if (expr == nullptr) continue;
    if (depth > max_depth) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "line %d: an expression nests deeper than %d levels", expr->line, max_depth));
    }
    for (const ExprPtr& arg : expr->args) pending.push_back({arg.get(), depth + 1});
    for (const auto& [name, value] : expr->kwargs) pending.push_back({value.get(), depth + 1});
  }
  return absl::OkStatus();
}

}  // namespace tandem::jinja
