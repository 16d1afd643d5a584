// Builds the statement tree of a template from its tokens, with Jinja2's grammar and operator
// precedence. Anything outside the supported subset (template inheritance, includes, call blocks,
// recursive loops, unknown filters or tests) is refused here, naming the construct and its line.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "common/jinja/ast.h"

namespace tandem::jinja {

// Bounds on a template's shape, so that a hostile chat template (it comes with the checkpoint)
// fails at load with an error instead of overflowing the stack of the parser, of the renderer or
// of the tree's destructor. Each pair of parentheses costs the parser four levels (63 pairs fit);
// Python's Jinja2 gives up near 75 pairs (its recursion limit of 1,000 over 13 frames a pair),
// and real chat templates nest fewer than 10 levels of either kind.
inline constexpr int kMaxTemplateNesting = 256;  // recursion of the parser: blocks, parentheses
inline constexpr int kMaxExpressionDepth = 256;  // levels of one expression tree, chains included

absl::StatusOr<Body> ParseTemplate(std::string_view source);

}  // namespace tandem::jinja
