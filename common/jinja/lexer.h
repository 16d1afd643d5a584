// Splits a template into tokens the way Jinja2's lexer does with trim_blocks and lstrip_blocks on:
// text between tags, `{{ }}` and `{% %}` delimiters with the expression tokens between them;
// comments vanish. Whitespace control (`-`, `+`, the newline after a block tag, the indentation
// before one) is applied here, so the parser sees the text exactly as it will be written.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::jinja {

struct Token {
  enum class Kind {
    kData,           // text outside tags, written as is
    kVariableBegin,  // {{
    kVariableEnd,    // }}
    kBlockBegin,     // {%
    kBlockEnd,       // %}
    kName,
    kString,   // `text` holds the unescaped value
    kInteger,  // `text` holds the digits, underscores removed
    kFloat,
    kOperator,  // `text` holds the operator: + - * / // % ** ~ == != < <= > >= = . : | , ( ) [ ] {
                // }
    kEnd,       // end of the template
  };
  Kind kind;
  std::string text;
  int line;  // 1-based line of the template where the token starts
};

absl::StatusOr<std::vector<Token>> Tokenize(std::string_view source);

}  // namespace tandem::jinja
