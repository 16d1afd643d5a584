// The parsed tree's one piece of behaviour: taking a deep expression apart without recursion.
#include "common/jinja/ast.h"

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

}  // namespace tandem::jinja
