// Builds the statement tree of a template from its tokens, with Jinja2's grammar and operator
// precedence. Anything outside the supported subset (template inheritance, includes, call blocks,
// recursive loops, unknown filters or tests) is refused here, naming the construct and its line.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "common/jinja/ast.h"

namespace tandem::jinja {

absl::StatusOr<Body> ParseTemplate(std::string_view source);

}  // namespace tandem::jinja
