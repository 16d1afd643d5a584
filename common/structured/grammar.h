// A constraint on generated text compiled into a byte-level matcher: JSON Schema and "any JSON
// object" as a pushdown automaton over schema nodes, a regular expression or a choice among
// strings as a DFA (regex_dfa.h). A Grammar is immutable and shared; a Matcher is one sequence's
// position in it, advanced byte by byte (token_mask.h advances it by tokens).
//
// JSON is generated compact: no whitespace between tokens (JSON parsers accept it, and a model
// cannot wander into endless spaces). Object properties come in the schema's order; optional
// ones may be left out. `additionalProperties` absent or false allows no other keys (xgrammar's
// strict mode, as OpenAI's strict schemas); `true` is accepted and generates only the declared
// properties, which still validates. An object schema without `properties` is a map: any keys,
// values under `additionalProperties` (any JSON when absent or true).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/structured/regex_dfa.h"

namespace tandem::structured {

// Bounds on what a schema may ask for (INVALID_ARGUMENT beyond them).
inline constexpr int kMaxSchemaBytes = 64 * 1024;
inline constexpr int kMaxSchemaNodes = 4096;
inline constexpr int kMaxSchemaDepth = 32;
// The deepest nesting a generated value may reach (any-JSON values and recursive $refs).
inline constexpr int kMaxValueDepth = 24;
// Digits allowed in a number's integer part and fraction each.
inline constexpr int kMaxNumberDigits = 16;
// Digits allowed in a number's exponent: two keep every number a finite double (at most about
// 1e115), which a third would not (1e999 parses as Infinity, which JSON Schema validators refuse).
inline constexpr int kMaxExponentDigits = 2;

struct SchemaNode {
  enum Kind : uint8_t { kAnyOf, kLiteral, kNumber, kString, kObject, kArray, kRegex };
  Kind kind = kAnyOf;
  std::vector<int> alternatives;  // kAnyOf: node ids
  std::string literal;            // kLiteral: its exact compact JSON text
  bool integer = false;           // kNumber
  int min_length = 0;             // kString, in code points
  int max_length = -1;            // kString; -1: none
  int pattern = -1;               // kString: index into Grammar::dfas; -1: none
  struct Property {
    std::string key;  // as it appears in the output, with its quotes
    int value = 0;
    bool required = false;
  };
  std::vector<Property> properties;  // kObject
  int map_values = -1;               // kObject without properties: node of the values
  int items = -1;                    // kArray
  int min_items = 0, max_items = -1; // kArray
  int dfa = -1;                      // kRegex
};

struct Grammar {
  std::vector<SchemaNode> nodes;
  std::vector<RegexDfa> dfas;
  int root = 0;
};

// INVALID_ARGUMENT naming the JSON pointer and keyword when the schema is malformed, uses an
// unsupported keyword, or passes the bounds above.
absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchema(std::string_view schema_json);
// Any JSON object.
std::shared_ptr<const Grammar> JsonObjectGrammar();
absl::StatusOr<std::shared_ptr<const Grammar>> CompileRegex(std::string_view pattern);
absl::StatusOr<std::shared_ptr<const Grammar>> CompileChoice(const std::vector<std::string>& options);

// One sequence's position in a grammar: a set of stacks (anyOf can keep several alive).
class Matcher {
 public:
  explicit Matcher(std::shared_ptr<const Grammar> grammar);

  // False (and the matcher unchanged) when `byte` cannot follow.
  bool Advance(uint8_t byte);
  bool Advance(std::string_view bytes);
  // The text so far is a whole accepted text (end of sequence may come now).
  bool Accepting() const;
  // Accepting, and no byte can follow: generation should end.
  bool Finished() const;

  struct Frame {
    int32_t node;
    int32_t phase;
    int32_t a;
    int32_t b;
    int32_t c;
    bool operator==(const Frame&) const = default;
  };
  using Stack = std::vector<Frame>;

  const Grammar& grammar() const { return *grammar_; }

 private:
  friend class TokenMasker;
  void Feed(Stack s, uint8_t byte, std::vector<Stack>& out) const;
  void FeedNumber(Stack s, uint8_t byte, std::vector<Stack>& out) const;
  void FeedString(Stack s, uint8_t byte, std::vector<Stack>& out) const;
  void FeedArray(Stack s, uint8_t byte, std::vector<Stack>& out) const;
  void FeedObject(Stack s, uint8_t byte, std::vector<Stack>& out) const;
  void Push(Stack s, int node, std::vector<Stack>& out) const;
  bool StepInto(std::vector<Stack>& threads, uint8_t byte) const;

  std::shared_ptr<const Grammar> grammar_;
  std::vector<Stack> threads_;
};

}  // namespace tandem::structured
