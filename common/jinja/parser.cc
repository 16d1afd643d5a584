#include "common/jinja/parser.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/jinja/filters.h"
#include "common/jinja/lexer.h"
#include "common/jinja/tests.h"
#include "common/status_macros.h"

namespace tandem::jinja {
namespace {

using TK = Token::Kind;

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  absl::StatusOr<Body> Run() {
    std::string end;
    ASSIGN_OR_RETURN(Body body, ParseBody({}, &end));
    return body;
  }

 private:
  const Token& Current() const { return tokens_[pos_]; }
  const Token& Peek(size_t ahead = 1) const {
    return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)];
  }
  void Next() {
    if (pos_ + 1 < tokens_.size()) ++pos_;
  }
  bool IsOp(std::string_view op) const {
    return Current().kind == TK::kOperator && Current().text == op;
  }
  bool IsName(std::string_view name) const {
    return Current().kind == TK::kName && Current().text == name;
  }
  bool SkipOp(std::string_view op) {
    if (!IsOp(op)) return false;
    Next();
    return true;
  }
  bool SkipName(std::string_view name) {
    if (!IsName(name)) return false;
    Next();
    return true;
  }

  absl::Status Error(const std::string& message) const {
    return absl::InvalidArgumentError(absl::StrFormat("line %d: %s", Current().line, message));
  }

  static std::string Describe(const Token& token) {
    switch (token.kind) {
      case TK::kName:
        return absl::StrCat("'", token.text, "'");
      case TK::kOperator:
        return absl::StrCat("'", token.text, "'");
      case TK::kString:
        return "a string";
      case TK::kInteger:
      case TK::kFloat:
        return "a number";
      case TK::kVariableEnd:
        return "'}}'";
      case TK::kBlockEnd:
        return "'%}'";
      case TK::kEnd:
        return "the end of the template";
      default:
        return "text";
    }
  }

  absl::Status ExpectOp(std::string_view op) {
    if (!SkipOp(op)) {
      return Error(absl::StrCat("expected '", std::string(op), "', found ", Describe(Current())));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> ExpectName() {
    if (Current().kind != TK::kName) {
      return Error(absl::StrCat("expected a name, found ", Describe(Current())));
    }
    std::string name = Current().text;
    Next();
    return name;
  }

  absl::Status ExpectBlockEnd() {
    if (Current().kind != TK::kBlockEnd) {
      return Error(absl::StrCat("expected '%}', found ", Describe(Current())));
    }
    Next();
    return absl::OkStatus();
  }

  // One level of the parser's recursion (blocks in blocks, parentheses, brackets, `not not`, ...),
  // counted so that a hostile template fails with an error instead of overflowing the stack.
  class Nested {
   public:
    explicit Nested(int& depth) : depth_(depth) { ++depth_; }
    ~Nested() { --depth_; }
    Nested(const Nested&) = delete;
    Nested& operator=(const Nested&) = delete;

   private:
    int& depth_;
  };
  absl::Status CheckNesting() const {
    if (nesting_ <= kMaxTemplateNesting) return absl::OkStatus();
    return Error(absl::StrCat("the template nests blocks and expressions deeper than ",
                              kMaxTemplateNesting, " levels"));
  }

  ExprPtr MakeExpr(Expr::Kind kind, int line) {
    auto expr = std::make_unique<Expr>();
    expr->kind = kind;
    expr->line = line;
    return expr;
  }

  // Statements and text up to `{% end %}` for an `end` in `ends`; leaves the current token at that
  // name and stores it in `*found`. With no `ends`, runs to the end of the template.
  absl::StatusOr<Body> ParseBody(const std::set<std::string>& ends, std::string* found) {
    Body body;
    while (true) {
      const Token& token = Current();
      switch (token.kind) {
        case TK::kEnd:
          if (!ends.empty()) {
            std::string closing = *ends.begin();
            for (const std::string& end : ends) {
              if (end.rfind("end", 0) == 0) closing = end;
            }
            return Error(
                absl::StrCat("unexpected end of template; expected '{% ", closing, " %}'"));
          }
          return body;
        case TK::kData: {
          auto node = std::make_unique<Node>();
          node->kind = Node::Kind::kData;
          node->line = token.line;
          node->text = token.text;
          body.push_back(std::move(node));
          Next();
          break;
        }
        case TK::kVariableBegin: {
          auto node = std::make_unique<Node>();
          node->kind = Node::Kind::kOutput;
          node->line = token.line;
          Next();
          ASSIGN_OR_RETURN(node->expr, ParseTuple(true, {}));
          if (Current().kind != TK::kVariableEnd) {
            return Error(absl::StrCat("expected '}}', found ", Describe(Current())));
          }
          Next();
          body.push_back(std::move(node));
          break;
        }
        case TK::kBlockBegin: {
          Next();
          if (Current().kind == TK::kName && ends.count(Current().text)) {
            *found = Current().text;
            return body;
          }
          ASSIGN_OR_RETURN(NodePtr node, ParseStatement());
          body.push_back(std::move(node));
          break;
        }
        default:
          return Error(absl::StrCat("unexpected ", Describe(token)));
      }
    }
  }

  absl::StatusOr<NodePtr> ParseStatement() {
    Nested level(nesting_);
    RETURN_IF_ERROR(CheckNesting());
    if (Current().kind != TK::kName) {
      return Error(absl::StrCat("expected a statement name, found ", Describe(Current())));
    }
    const std::string keyword = Current().text;
    const int line = Current().line;
    auto node = std::make_unique<Node>();
    node->line = line;
    Next();
    if (keyword == "if") RETURN_IF_ERROR(ParseIf(*node));
    else if (keyword == "for") RETURN_IF_ERROR(ParseFor(*node));
    else if (keyword == "set") RETURN_IF_ERROR(ParseSet(*node));
    else if (keyword == "macro") RETURN_IF_ERROR(ParseMacro(*node));
    else if (keyword == "break" || keyword == "continue") {
      if (loop_depth_ == 0) {
        return Error(absl::StrCat("'", keyword, "' outside a for loop"));
      }
      node->kind = keyword == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      RETURN_IF_ERROR(ExpectBlockEnd());
    } else if (keyword == "filter") {
      node->kind = Node::Kind::kFilterBlock;
      ASSIGN_OR_RETURN(node->filter, ParseFilter(nullptr, true));
      RETURN_IF_ERROR(ExpectBlockEnd());
      RETURN_IF_ERROR(ParseBodyUntil("endfilter", *node));
    } else if (keyword == "generation") {
      // Hugging Face's extension marking assistant text; it writes its body unchanged.
      node->kind = Node::Kind::kPlain;
      RETURN_IF_ERROR(ExpectBlockEnd());
      RETURN_IF_ERROR(ParseBodyUntil("endgeneration", *node));
    } else {
      return absl::InvalidArgumentError(absl::StrFormat(
          "line %d: the '{%% %s %%}' statement is not supported", line, keyword));
    }
    return node;
  }

  // A body up to `{% end %}` (consumed, with its block end), appended to node's bodies.
  absl::Status ParseBodyUntil(const std::string& end, Node& node) {
    std::string found;
    ASSIGN_OR_RETURN(Body body, ParseBody({end}, &found));
    node.bodies.push_back(std::move(body));
    Next();
    return ExpectBlockEnd();
  }

  // `{% if %}` ... `{% elif %}` ... `{% else %}` ... `{% endif %}`, after the keyword.
  absl::Status ParseIf(Node& node) {
    node.kind = Node::Kind::kIf;
    std::string end;
    while (true) {
      ASSIGN_OR_RETURN(ExprPtr condition, ParseTuple(false, {}));
      node.conditions.push_back(std::move(condition));
      RETURN_IF_ERROR(ExpectBlockEnd());
      ASSIGN_OR_RETURN(Body body, ParseBody({"elif", "else", "endif"}, &end));
      node.bodies.push_back(std::move(body));
      Next();
      if (end == "elif") continue;
      if (end == "else") {
        RETURN_IF_ERROR(ExpectBlockEnd());
        return ParseBodyUntil("endif", node);
      }
      return ExpectBlockEnd();
    }
  }

  // `{% for targets in expr [if filter] %}` ... [`{% else %}` ...] `{% endfor %}`.
  absl::Status ParseFor(Node& node) {
    node.kind = Node::Kind::kFor;
    ASSIGN_OR_RETURN(node.targets, ParseTargets());
    if (!SkipName("in")) return Error("expected 'in' in a for statement");
    ASSIGN_OR_RETURN(node.expr, ParseTuple(false, {"recursive"}));
    if (SkipName("if")) {
      ASSIGN_OR_RETURN(node.filter, ParseExpression(true));
    }
    if (IsName("recursive")) return Error("recursive for loops are not supported");
    RETURN_IF_ERROR(ExpectBlockEnd());
    std::string end;
    ++loop_depth_;
    absl::StatusOr<Body> body = ParseBody({"endfor", "else"}, &end);
    --loop_depth_;
    if (!body.ok()) return body.status();
    node.bodies.push_back(*std::move(body));
    Next();
    if (end == "else") {
      RETURN_IF_ERROR(ExpectBlockEnd());
      return ParseBodyUntil("endfor", node);
    }
    return ExpectBlockEnd();
  }

  // `{% set name[.attr] = expr %}` or the block form `{% set name [| filter] %}` ... `{% endset %}`.
  absl::Status ParseSet(Node& node) {
    ASSIGN_OR_RETURN(std::string target, ExpectName());
    node.targets.push_back(target);
    if (SkipOp(".")) {
      ASSIGN_OR_RETURN(node.attribute, ExpectName());
    } else if (IsOp(",")) {
      return Error("'{% set %}' of several names is not supported");
    }
    if (SkipOp("=")) {
      node.kind = Node::Kind::kSet;
      ASSIGN_OR_RETURN(node.expr, ParseTuple(true, {}));
      return ExpectBlockEnd();
    }
    if (!node.attribute.empty()) return Error("expected '=' after a namespace attribute");
    node.kind = Node::Kind::kSetBlock;
    if (IsOp("|")) {
      ASSIGN_OR_RETURN(node.filter, ParseFilter(nullptr, false));
    }
    RETURN_IF_ERROR(ExpectBlockEnd());
    return ParseBodyUntil("endset", node);
  }

  // `{% macro name(param[=default], ...) %}` ... `{% endmacro [name] %}`.
  absl::Status ParseMacro(Node& node) {
    node.kind = Node::Kind::kMacro;
    ASSIGN_OR_RETURN(node.text, ExpectName());
    RETURN_IF_ERROR(ExpectOp("("));
    while (!IsOp(")")) {
      if (!node.params.empty()) RETURN_IF_ERROR(ExpectOp(","));
      if (IsOp(")")) break;
      MacroParam param;
      ASSIGN_OR_RETURN(param.name, ExpectName());
      if (SkipOp("=")) {
        ASSIGN_OR_RETURN(param.default_value, ParseExpression(true));
      }
      node.params.push_back(std::move(param));
    }
    Next();
    RETURN_IF_ERROR(ExpectBlockEnd());
    std::string end;
    ASSIGN_OR_RETURN(Body body, ParseBody({"endmacro"}, &end));
    node.bodies.push_back(std::move(body));
    Next();
    if (Current().kind == TK::kName) Next();  // {% endmacro name %}
    return ExpectBlockEnd();
  }

  // Loop and assignment targets: `name` or `a, b`.
  absl::StatusOr<std::vector<std::string>> ParseTargets() {
    std::vector<std::string> names;
    bool parens = SkipOp("(");
    while (true) {
      ASSIGN_OR_RETURN(std::string name, ExpectName());
      names.push_back(name);
      if (!SkipOp(",")) break;
      if (IsName("in") || IsOp(")")) break;
    }
    if (parens) RETURN_IF_ERROR(ExpectOp(")"));
    return names;
  }

  // Jinja2's parse_tuple: `a, b` is a tuple; a single expression stays itself.
  absl::StatusOr<ExprPtr> ParseTuple(bool with_condition, const std::set<std::string>& end_names,
                                     bool explicit_parens = false) {
    Nested level(nesting_);
    RETURN_IF_ERROR(CheckNesting());
    const int line = Current().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) RETURN_IF_ERROR(ExpectOp(","));
      if (Current().kind == TK::kVariableEnd || Current().kind == TK::kBlockEnd || IsOp(")") ||
          (Current().kind == TK::kName && end_names.count(Current().text))) {
        break;
      }
      ASSIGN_OR_RETURN(ExprPtr item, ParseExpression(with_condition));
      items.push_back(std::move(item));
      if (IsOp(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) {
        return Error(absl::StrCat("expected an expression, found ", Describe(Current())));
      }
    }
    ExprPtr tuple = MakeExpr(Expr::Kind::kTuple, line);
    tuple->args = std::move(items);
    return tuple;
  }

  absl::StatusOr<ExprPtr> ParseExpression(bool with_condition) {
    Nested level(nesting_);
    RETURN_IF_ERROR(CheckNesting());
    if (!with_condition) return ParseOr();
    ASSIGN_OR_RETURN(ExprPtr expr, ParseOr());
    while (IsName("if")) {
      const int line = Current().line;
      Next();
      ExprPtr node = MakeExpr(Expr::Kind::kCondition, line);
      ASSIGN_OR_RETURN(ExprPtr test, ParseOr());
      ExprPtr otherwise;
      if (SkipName("else")) {
        ASSIGN_OR_RETURN(otherwise, ParseExpression(true));
      }
      node->args.push_back(std::move(test));
      node->args.push_back(std::move(expr));
      node->args.push_back(std::move(otherwise));
      expr = std::move(node);
    }
    return expr;
  }

  absl::StatusOr<ExprPtr> ParseOr() {
    ASSIGN_OR_RETURN(ExprPtr left, ParseAnd());
    while (IsName("or")) {
      const int line = Current().line;
      Next();
      ASSIGN_OR_RETURN(ExprPtr right, ParseAnd());
      left = Binary(Expr::Kind::kOr, "or", std::move(left), std::move(right), line);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseAnd() {
    ASSIGN_OR_RETURN(ExprPtr left, ParseNot());
    while (IsName("and")) {
      const int line = Current().line;
      Next();
      ASSIGN_OR_RETURN(ExprPtr right, ParseNot());
      left = Binary(Expr::Kind::kAnd, "and", std::move(left), std::move(right), line);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseNot() {
    Nested level(nesting_);
    RETURN_IF_ERROR(CheckNesting());
    if (IsName("not")) {
      const int line = Current().line;
      Next();
      ExprPtr node = MakeExpr(Expr::Kind::kNot, line);
      ASSIGN_OR_RETURN(ExprPtr operand, ParseNot());
      node->args.push_back(std::move(operand));
      return node;
    }
    return ParseCompare();
  }

  absl::StatusOr<ExprPtr> ParseCompare() {
    const int line = Current().line;
    ASSIGN_OR_RETURN(ExprPtr first, ParseMath1());
    ExprPtr node;
    while (true) {
      std::string op;
      if (Current().kind == TK::kOperator &&
          (Current().text == "==" || Current().text == "!=" || Current().text == "<" ||
           Current().text == "<=" || Current().text == ">" || Current().text == ">=")) {
        op = Current().text;
        Next();
      } else if (IsName("in")) {
        op = "in";
        Next();
      } else if (IsName("not") && Peek().kind == TK::kName && Peek().text == "in") {
        op = "notin";
        Next();
        Next();
      } else {
        break;
      }
      if (!node) {
        node = MakeExpr(Expr::Kind::kCompare, line);
        node->args.push_back(std::move(first));
      }
      ASSIGN_OR_RETURN(ExprPtr operand, ParseMath1());
      node->ops.push_back(op);
      node->args.push_back(std::move(operand));
    }
    return node ? std::move(node) : std::move(first);
  }

  ExprPtr Binary(Expr::Kind kind, std::string op, ExprPtr left, ExprPtr right, int line) {
    ExprPtr node = MakeExpr(kind, line);
    node->name = std::move(op);
    node->args.push_back(std::move(left));
    node->args.push_back(std::move(right));
    return node;
  }

  absl::StatusOr<ExprPtr> ParseMath1() {
    ASSIGN_OR_RETURN(ExprPtr left, ParseConcat());
    while (IsOp("+") || IsOp("-")) {
      std::string op = Current().text;
      const int line = Current().line;
      Next();
      ASSIGN_OR_RETURN(ExprPtr right, ParseConcat());
      left = Binary(Expr::Kind::kBinary, op, std::move(left), std::move(right), line);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseConcat() {
    ASSIGN_OR_RETURN(ExprPtr left, ParseMath2());
    while (IsOp("~")) {
      const int line = Current().line;
      Next();
      ASSIGN_OR_RETURN(ExprPtr right, ParseMath2());
      left = Binary(Expr::Kind::kBinary, "~", std::move(left), std::move(right), line);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseMath2() {
    ASSIGN_OR_RETURN(ExprPtr left, ParsePow());
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      std::string op = Current().text;
      const int line = Current().line;
      Next();
      ASSIGN_OR_RETURN(ExprPtr right, ParsePow());
      left = Binary(Expr::Kind::kBinary, op, std::move(left), std::move(right), line);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParsePow() {
    ASSIGN_OR_RETURN(ExprPtr left, ParseUnary(true));
    while (IsOp("**")) {
      const int line = Current().line;
      Next();
      ASSIGN_OR_RETURN(ExprPtr right, ParseUnary(true));
      left = Binary(Expr::Kind::kBinary, "**", std::move(left), std::move(right), line);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseUnary(bool with_filter) {
    Nested level(nesting_);
    RETURN_IF_ERROR(CheckNesting());
    const int line = Current().line;
    ExprPtr node;
    if (IsOp("-") || IsOp("+")) {
      node = MakeExpr(IsOp("-") ? Expr::Kind::kNeg : Expr::Kind::kPos, line);
      Next();
      ASSIGN_OR_RETURN(ExprPtr operand, ParseUnary(false));
      node->args.push_back(std::move(operand));
    } else {
      ASSIGN_OR_RETURN(node, ParsePrimary());
    }
    ASSIGN_OR_RETURN(node, ParsePostfix(std::move(node)));
    if (with_filter) {
      ASSIGN_OR_RETURN(node, ParseFilterExpr(std::move(node)));
    }
    return node;
  }

  absl::StatusOr<ExprPtr> ParsePrimary() {
    const Token& token = Current();
    const int line = token.line;
    if (token.kind == TK::kName) {
      ExprPtr node = MakeExpr(Expr::Kind::kConst, line);
      if (token.text == "true" || token.text == "True") {
        node->constant = Value(true);
      } else if (token.text == "false" || token.text == "False") {
        node->constant = Value(false);
      } else if (token.text == "none" || token.text == "None") {
        node->constant = Value::None();
      } else {
        node->kind = Expr::Kind::kName;
        node->name = token.text;
      }
      Next();
      return node;
    }
    if (token.kind == TK::kString) {
      std::string text;
      while (Current().kind == TK::kString) {  // adjacent literals join, as in Python
        text += Current().text;
        Next();
      }
      ExprPtr node = MakeExpr(Expr::Kind::kConst, line);
      node->constant = Value(std::move(text));
      return node;
    }
    if (token.kind == TK::kInteger || token.kind == TK::kFloat) {
      ExprPtr node = MakeExpr(Expr::Kind::kConst, line);
      try {
        node->constant = token.kind == TK::kInteger
                             ? Value(static_cast<int64_t>(std::stoll(token.text)))
                             : Value(std::stod(token.text));
      } catch (const std::exception&) {
        return Error(absl::StrCat("number out of range: ", token.text));
      }
      Next();
      return node;
    }
    if (IsOp("(")) {
      Next();
      ASSIGN_OR_RETURN(ExprPtr inner, ParseTuple(true, {}, true));
      RETURN_IF_ERROR(ExpectOp(")"));
      return inner;
    }
    if (IsOp("[")) {
      Next();
      ExprPtr node = MakeExpr(Expr::Kind::kList, line);
      while (!IsOp("]")) {
        if (!node->args.empty()) RETURN_IF_ERROR(ExpectOp(","));
        if (IsOp("]")) break;
        ASSIGN_OR_RETURN(ExprPtr item, ParseExpression(true));
        node->args.push_back(std::move(item));
      }
      Next();
      return node;
    }
    if (IsOp("{")) {
      Next();
      ExprPtr node = MakeExpr(Expr::Kind::kDict, line);
      while (!IsOp("}")) {
        if (!node->args.empty()) RETURN_IF_ERROR(ExpectOp(","));
        if (IsOp("}")) break;
        ASSIGN_OR_RETURN(ExprPtr key, ParseExpression(true));
        RETURN_IF_ERROR(ExpectOp(":"));
        ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        node->args.push_back(std::move(key));
        node->args.push_back(std::move(value));
      }
      Next();
      return node;
    }
    return Error(absl::StrCat("unexpected ", Describe(token)));
  }

  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr node) {
    while (true) {
      if (IsOp(".") || IsOp("[")) {
        ASSIGN_OR_RETURN(node, ParseSubscript(std::move(node)));
      } else if (IsOp("(")) {
        ASSIGN_OR_RETURN(node, ParseCall(std::move(node)));
      } else {
        return node;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseFilterExpr(ExprPtr node) {
    while (true) {
      if (IsOp("|")) {
        ASSIGN_OR_RETURN(node, ParseFilter(std::move(node), false));
      } else if (IsName("is")) {
        ASSIGN_OR_RETURN(node, ParseTest(std::move(node)));
      } else if (IsOp("(")) {
        ASSIGN_OR_RETURN(node, ParseCall(std::move(node)));
      } else {
        return node;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseSubscript(ExprPtr node) {
    const int line = Current().line;
    if (SkipOp(".")) {
      if (Current().kind == TK::kName) {
        ExprPtr attr = MakeExpr(Expr::Kind::kGetAttr, line);
        attr->name = Current().text;
        attr->args.push_back(std::move(node));
        Next();
        return attr;
      }
      if (Current().kind == TK::kInteger) {
        ExprPtr item = MakeExpr(Expr::Kind::kGetItem, line);
        ExprPtr index = MakeExpr(Expr::Kind::kConst, line);
        index->constant = Value(static_cast<int64_t>(std::stoll(Current().text)));
        item->args.push_back(std::move(node));
        item->args.push_back(std::move(index));
        Next();
        return item;
      }
      return Error(absl::StrCat("expected a name after '.', found ", Describe(Current())));
    }
    RETURN_IF_ERROR(ExpectOp("["));
    std::vector<ExprPtr> subscripts;
    while (!IsOp("]")) {
      if (!subscripts.empty()) RETURN_IF_ERROR(ExpectOp(","));
      ASSIGN_OR_RETURN(ExprPtr subscript, ParseSubscribed());
      subscripts.push_back(std::move(subscript));
    }
    Next();
    if (subscripts.size() != 1) return Error("subscripts with several indices are not supported");
    if (subscripts[0]->kind == Expr::Kind::kSlice) {
      subscripts[0]->args.insert(subscripts[0]->args.begin(), std::move(node));
      return std::move(subscripts[0]);
    }
    ExprPtr item = MakeExpr(Expr::Kind::kGetItem, line);
    item->args.push_back(std::move(node));
    item->args.push_back(std::move(subscripts[0]));
    return item;
  }

  // An index, or a slice `start:stop:step` with any part left out.
  absl::StatusOr<ExprPtr> ParseSubscribed() {
    const int line = Current().line;
    std::vector<ExprPtr> parts(1);
    if (!IsOp(":")) {
      ASSIGN_OR_RETURN(parts[0], ParseExpression(true));
      if (!IsOp(":")) return std::move(parts[0]);
    }
    while (SkipOp(":")) {
      parts.emplace_back();
      if (!IsOp(":") && !IsOp("]") && !IsOp(",")) {
        ASSIGN_OR_RETURN(parts.back(), ParseExpression(true));
      }
    }
    if (parts.size() > 3) return Error("a slice has at most three parts");
    parts.resize(3);
    ExprPtr slice = MakeExpr(Expr::Kind::kSlice, line);
    slice->args = std::move(parts);
    return slice;
  }

  // `(args, name=value)` into `node`'s args (after those it has) and kwargs.
  absl::Status ParseCallArgs(Expr& node) {
    RETURN_IF_ERROR(ExpectOp("("));
    bool first = true;
    while (!IsOp(")")) {
      if (!first) RETURN_IF_ERROR(ExpectOp(","));
      first = false;
      if (IsOp(")")) break;
      if (IsOp("*") || IsOp("**")) return Error("'*' and '**' arguments are not supported");
      if (Current().kind == TK::kName && Peek().kind == TK::kOperator && Peek().text == "=") {
        std::string key = Current().text;
        Next();
        Next();
        ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        node.kwargs.emplace_back(std::move(key), std::move(value));
      } else {
        if (!node.kwargs.empty()) return Error("a positional argument follows a keyword argument");
        ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        node.args.push_back(std::move(value));
      }
    }
    Next();
    return absl::OkStatus();
  }

  absl::StatusOr<ExprPtr> ParseCall(ExprPtr callee) {
    ExprPtr call = MakeExpr(Expr::Kind::kCall, Current().line);
    call->args.push_back(std::move(callee));
    RETURN_IF_ERROR(ParseCallArgs(*call));
    return call;
  }

  // `| name(args)` (repeated); `inline_start` when the first filter has no `|` (filter blocks).
  absl::StatusOr<ExprPtr> ParseFilter(ExprPtr node, bool inline_start) {
    while (IsOp("|") || inline_start) {
      if (!inline_start) Next();
      inline_start = false;
      const int line = Current().line;
      ASSIGN_OR_RETURN(std::string name, ExpectName());
      if (!IsFilter(name)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("line %d: the filter '%s' is not supported", line, name));
      }
      ExprPtr filter = MakeExpr(Expr::Kind::kFilter, line);
      filter->name = name;
      filter->args.push_back(std::move(node));
      if (IsOp("(")) RETURN_IF_ERROR(ParseCallArgs(*filter));
      node = std::move(filter);
    }
    return node;
  }

  absl::StatusOr<ExprPtr> ParseTest(ExprPtr node) {
    const int line = Current().line;
    Next();  // is
    bool negated = SkipName("not");
    ASSIGN_OR_RETURN(std::string name, ExpectName());
    if (!IsTest(name)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("line %d: the test '%s' is not supported", line, name));
    }
    ExprPtr test = MakeExpr(Expr::Kind::kTest, line);
    test->name = name;
    test->args.push_back(std::move(node));
    if (IsOp("(")) {
      RETURN_IF_ERROR(ParseCallArgs(*test));
    } else if ((Current().kind == TK::kName || Current().kind == TK::kString ||
                Current().kind == TK::kInteger || Current().kind == TK::kFloat || IsOp("[") ||
                IsOp("{")) &&
               !IsName("else") && !IsName("or") && !IsName("and")) {
      // `is divisibleby 3`: one argument without parentheses.
      if (IsName("is")) return Error("tests cannot be chained with 'is'");
      ASSIGN_OR_RETURN(ExprPtr arg, ParsePrimary());
      ASSIGN_OR_RETURN(arg, ParsePostfix(std::move(arg)));
      test->args.push_back(std::move(arg));
    }
    if (!negated) return test;
    ExprPtr negation = MakeExpr(Expr::Kind::kNot, line);
    negation->args.push_back(std::move(test));
    return negation;
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int loop_depth_ = 0;
  int nesting_ = 0;
};

}  // namespace

absl::StatusOr<Body> ParseTemplate(std::string_view source) {
  ASSIGN_OR_RETURN(std::vector<Token> tokens, Tokenize(source));
  ASSIGN_OR_RETURN(Body body, Parser(std::move(tokens)).Run());
  RETURN_IF_ERROR(CheckExpressionDepth(body, kMaxExpressionDepth));
  return body;
}

}  // namespace tandem::jinja
