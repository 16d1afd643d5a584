#include "common/jinja/lexer.h"

#include <algorithm>
#include <cctype>
#include <cstring>

#include "absl/strings/str_format.h"
#include "common/jinja/text.h"

namespace tandem::jinja {
namespace {

// Jinja2 reads \r\n and \r as \n, and drops one trailing newline (keep_trailing_newline=False).
std::string NormalizeNewlines(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

int CountNewlines(std::string_view s) {
  return static_cast<int>(std::count(s.begin(), s.end(), '\n'));
}

bool IsNameStart(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
bool IsNameChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }
bool IsDigit(char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; }

// Python's unicode-escape decoding of a string literal's body.
absl::StatusOr<std::string> Unescape(std::string_view body, int line) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    char c = body[i];
    if (c != '\\' || i + 1 == body.size()) {
      out += c;
      continue;
    }
    char e = body[++i];
    auto hex = [&](int digits) -> absl::StatusOr<char32_t> {
      if (i + digits >= body.size()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("line %d: truncated \\%c escape in a string", line, e));
      }
      char32_t value = 0;
      for (int k = 1; k <= digits; ++k) {
        char h = body[i + k];
        if (!std::isxdigit(static_cast<unsigned char>(h))) {
          return absl::InvalidArgumentError(
              absl::StrFormat("line %d: truncated \\%c escape in a string", line, e));
        }
        value = value * 16 + (IsDigit(h) ? h - '0' : (std::tolower(h) - 'a' + 10));
      }
      i += digits;
      return value;
    };
    switch (e) {
      case '\n':
        break;
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case 'a':
        out += '\a';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'v':
        out += '\v';
        break;
      case 'x':
      case 'u':
      case 'U': {
        absl::StatusOr<char32_t> cp = hex(e == 'x' ? 2 : (e == 'u' ? 4 : 8));
        if (!cp.ok()) return cp.status();
        out += Encode(std::u32string(1, *cp));
        break;
      }
      default:
        if (e >= '0' && e <= '7') {
          char32_t value = e - '0';
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7';
               ++k) {
            value = value * 8 + (body[++i] - '0');
          }
          out += Encode(std::u32string(1, value));
        } else {
          out += '\\';
          out += e;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) : src_(NormalizeNewlines(source)) {}

  absl::StatusOr<std::vector<Token>> Run() {
    while (pos_ < src_.size()) {
      size_t start = FindTagStart(pos_);
      if (start == std::string::npos) {
        Emit(Token::Kind::kData, src_.substr(pos_));
        break;
      }
      char kind = src_[start + 1];  // '{', '%' or '#'
      char sign = start + 2 < src_.size() ? src_[start + 2] : '\0';
      if (sign != '-' && sign != '+') sign = '\0';
      std::string text = src_.substr(pos_, start - pos_);
      int text_lines = CountNewlines(text);
      if (sign == '-') {
        text.resize(text.size() - TrailingSpaceBytes(text));
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: indentation alone on the line before a block or comment tag goes.
        size_t line_start = text.rfind('\n');
        line_start = line_start == std::string::npos ? 0 : line_start + 1;
        if ((line_start > 0 || line_starting_) && line_start < text.size() &&
            LeadingSpaceBytes(std::string_view(text).substr(line_start)) ==
                text.size() - line_start) {
          text.resize(line_start);
        }
      }
      Emit(Token::Kind::kData, text);
      line_ += text_lines;
      pos_ = start + 2 + (sign ? 1 : 0);
      absl::Status status;
      if (kind == '#') {
        status = Comment();
      } else {
        status = Tag(kind == '%');
      }
      if (!status.ok()) return status;
    }
    tokens_.push_back({Token::Kind::kEnd, "", line_});
    return std::move(tokens_);
  }

 private:
  size_t FindTagStart(size_t from) const {
    size_t pos = from;
    while ((pos = src_.find('{', pos)) != std::string::npos) {
      if (pos + 1 < src_.size() &&
          (src_[pos + 1] == '{' || src_[pos + 1] == '%' || src_[pos + 1] == '#')) {
        return pos;
      }
      ++pos;
    }
    return std::string::npos;
  }

  void Emit(Token::Kind kind, std::string text) {
    if (kind == Token::Kind::kData && text.empty()) return;
    tokens_.push_back({kind, std::move(text), line_});
  }

  // After a block or comment end: `+` keeps what follows, `-` eats all whitespace, plain eats one
  // newline (trim_blocks).
  void AfterBlockEnd(char sign) {
    size_t consumed_from = pos_;
    if (sign == '-') {
      pos_ += LeadingSpaceBytes(std::string_view(src_).substr(pos_));
    } else if (sign != '+' && pos_ < src_.size() && src_[pos_] == '\n') {
      ++pos_;
    }
    line_ += CountNewlines(std::string_view(src_).substr(consumed_from, pos_ - consumed_from));
  }

  absl::Status Comment() {
    size_t end = src_.find("#}", pos_);
    if (end == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrFormat("line %d: comment '{#' without '#}'", line_));
    }
    char sign = end > pos_ && (src_[end - 1] == '-' || src_[end - 1] == '+') ? src_[end - 1] : '\0';
    line_ += CountNewlines(std::string_view(src_).substr(pos_, end - pos_));
    pos_ = end + 2;
    AfterBlockEnd(sign);
    line_starting_ = src_[pos_ - 1] == '\n';
    return absl::OkStatus();
  }

  absl::Status Tag(bool block) {
    const int open_line = line_;
    tokens_.push_back({block ? Token::Kind::kBlockBegin : Token::Kind::kVariableBegin, "", line_});
    std::vector<char> balance;
    while (true) {
      if (pos_ >= src_.size()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "line %d: '%s' without '%s'", open_line, block ? "{%" : "{{", block ? "%}" : "}}"));
      }
      std::string_view rest = std::string_view(src_).substr(pos_);
      if (balance.empty()) {
        const std::string close = block ? "%}" : "}}";
        char sign = '\0';
        bool closes = false;
        if (rest.substr(0, 2) == close) {
          closes = true;
        } else if (rest.size() >= 3 && (rest[0] == '-' || (block && rest[0] == '+')) &&
                   rest.substr(1, 2) == close) {
          closes = true;
          sign = rest[0];
        }
        if (closes) {
          tokens_.push_back(
              {block ? Token::Kind::kBlockEnd : Token::Kind::kVariableEnd, "", line_});
          pos_ += sign ? 3 : 2;
          if (block) {
            AfterBlockEnd(sign);
          } else if (sign == '-') {
            AfterBlockEnd('-');
          }
          line_starting_ = src_[pos_ - 1] == '\n';
          return absl::OkStatus();
        }
      }
      char c = rest[0];
      if (size_t space = LeadingSpaceBytes(rest); space > 0) {
        line_ += CountNewlines(rest.substr(0, space));
        pos_ += space;
      } else if (IsDigit(c)) {
        LexNumber(rest);
      } else if (IsNameStart(c)) {
        size_t n = 1;
        while (n < rest.size() && IsNameChar(rest[n])) ++n;
        tokens_.push_back({Token::Kind::kName, std::string(rest.substr(0, n)), line_});
        pos_ += n;
      } else if (c == '\'' || c == '"') {
        size_t n = 1;
        while (n < rest.size() && rest[n] != c) n += rest[n] == '\\' ? 2 : 1;
        if (n >= rest.size()) {
          return absl::InvalidArgumentError(
              absl::StrFormat("line %d: unterminated string literal", line_));
        }
        absl::StatusOr<std::string> value = Unescape(rest.substr(1, n - 1), line_);
        if (!value.ok()) return value.status();
        tokens_.push_back({Token::Kind::kString, *std::move(value), line_});
        line_ += CountNewlines(rest.substr(0, n));
        pos_ += n + 1;
      } else {
        static const char* const kTwo[] = {"//", "**", "==", "!=", ">=", "<="};
        std::string op;
        for (const char* two : kTwo) {
          if (rest.substr(0, 2) == two) op = two;
        }
        if (op.empty()) {
          if (std::string_view("+-/*%~[](){}><=.:|,;").find(c) == std::string_view::npos) {
            return absl::InvalidArgumentError(
                absl::StrFormat("line %d: unexpected character '%c'", line_, c));
          }
          op = std::string(1, c);
        }
        if (op == "(" || op == "[" || op == "{") {
          balance.push_back(op == "(" ? ')' : (op == "[" ? ']' : '}'));
        } else if (op == ")" || op == "]" || op == "}") {
          if (balance.empty() || balance.back() != op[0]) {
            return absl::InvalidArgumentError(
                absl::StrFormat("line %d: unexpected '%s'", line_, op));
          }
          balance.pop_back();
        }
        tokens_.push_back({Token::Kind::kOperator, op, line_});
        pos_ += op.size();
      }
    }
  }

  // Integers (decimal, 0x, 0o, 0b, with `_` separators) and floats (fraction and/or exponent).
  void LexNumber(std::string_view rest) {
    auto digits = [&](size_t n, auto is_digit) {
      while (n < rest.size() && (is_digit(rest[n]) || (rest[n] == '_' && n + 1 < rest.size() &&
                                                       is_digit(rest[n + 1])))) {
        ++n;
      }
      return n;
    };
    auto dec = [](char ch) { return IsDigit(ch); };
    if (rest.size() > 2 && rest[0] == '0' && std::strchr("xXoObB", rest[1]) != nullptr) {
      char base = static_cast<char>(std::tolower(rest[1]));
      auto in_base = [base](char ch) {
        if (base == 'x') return std::isxdigit(static_cast<unsigned char>(ch)) != 0;
        if (base == 'o') return ch >= '0' && ch <= '7';
        return ch == '0' || ch == '1';
      };
      size_t n = digits(2, in_base);
      if (n > 2) {
        std::string text(rest.substr(0, n));
        text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
        tokens_.push_back({Token::Kind::kInteger,
                           std::to_string(std::stoll(text.substr(2), nullptr,
                                                     base == 'x' ? 16 : (base == 'o' ? 8 : 2))),
                           line_});
        pos_ += n;
        return;
      }
    }
    size_t n = digits(0, dec);
    bool is_float = false;
    if (n + 1 < rest.size() && rest[n] == '.' && IsDigit(rest[n + 1])) {
      n = digits(n + 1, dec);
      is_float = true;
    }
    if (n < rest.size() && (rest[n] == 'e' || rest[n] == 'E')) {
      size_t m = n + 1;
      if (m < rest.size() && (rest[m] == '+' || rest[m] == '-')) ++m;
      if (m < rest.size() && IsDigit(rest[m])) {
        n = digits(m, dec);
        is_float = true;
      }
    }
    std::string text(rest.substr(0, n));
    text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
    tokens_.push_back({is_float ? Token::Kind::kFloat : Token::Kind::kInteger, text, line_});
    pos_ += n;
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> tokens_;
};

}  // namespace

absl::StatusOr<std::vector<Token>> Tokenize(std::string_view source) { return Lexer(source).Run(); }

}  // namespace tandem::jinja
