// Runs a parsed template: walks the statement tree with the caller's variables and writes the
// output, with Jinja2's scoping (for loops and macros have their own, `if` does not), loop
// variables, loop controls, macros and the globals Hugging Face gives chat templates.
#pragma once

#include <ctime>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "common/jinja/ast.h"
#include "common/jinja/value.h"

namespace tandem::jinja {

// Macro calls in progress at once. Templates that render tool schemas recurse once per level of
// the schema, and requests nest at most kMaxJsonDepth (128, common/bounded_json.h) levels; a
// macro that recurses without end fails here instead of overflowing the stack.
inline constexpr int kMaxCallDepth = 128;
// Statements (output, text, set, if, for bodies, ...) one render may run: real chat templates run
// a few tens per message.
inline constexpr int kMaxRenderStatements = 200'000;

// `variables` is a dict of the template's variables. `now` gives the local time that
// strftime_now formats. Errors: INVALID_ARGUMENT; raise_exception's message comes back as is,
// other messages start with "line N: ".
absl::StatusOr<std::string> Render(const Body& body, const Value& variables,
                                   const std::function<std::tm()>& now);

}  // namespace tandem::jinja
