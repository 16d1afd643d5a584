// Constraints compiled once: a bounded, least-recently-used cache of grammars keyed by the
// constraint's text, shared by every request (thread-safe).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/structured/grammar.h"

namespace tandem::structured {

// What the generated text must be (proto OutputConstraint without the proto).
struct Constraint {
  enum Kind { kNone, kJsonObject, kJsonSchema, kRegex, kChoice };
  Kind kind = kNone;
  std::string text;                  // kJsonSchema: the schema's JSON; kRegex: the pattern
  std::vector<std::string> options;  // kChoice
};

// Grammars kept at most (each is small: a schema's nodes and its patterns' DFAs).
inline constexpr int kGrammarCacheEntries = 256;

// The compiled grammar of `c` (kind != kNone), from the cache when it was compiled before; the
// compile error as INVALID_ARGUMENT otherwise (errors are not cached).
absl::StatusOr<std::shared_ptr<const Grammar>> CompileCached(const Constraint& c);

}  // namespace tandem::structured
