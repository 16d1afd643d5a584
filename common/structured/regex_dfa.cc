// Parser (pattern -> syntax tree), Thompson construction (tree -> NFA) and subset construction
// (NFA -> DFA). Every piece is bounded so a hostile pattern costs little.
#include "common/structured/regex_dfa.h"

#include <algorithm>
#include <bitset>
#include <map>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tandem::structured {
namespace {

using ByteSet = std::bitset<256>;

constexpr int kMaxNfaStates = 20000;
constexpr int kMaxRepeat = 256;

struct Ast {
  enum Kind { kBytes, kSeq, kAlt, kRepeat } kind = kBytes;
  ByteSet bytes;
  std::vector<std::unique_ptr<Ast>> children;
  int min = 0, max = -1;  // kRepeat; max -1: unbounded
};
using AstPtr = std::unique_ptr<Ast>;

AstPtr Bytes(const ByteSet& set) {
  auto a = std::make_unique<Ast>();
  a->kind = Ast::kBytes;
  a->bytes = set;
  return a;
}
AstPtr Node(Ast::Kind kind) {
  auto a = std::make_unique<Ast>();
  a->kind = kind;
  return a;
}
ByteSet Range(int lo, int hi) {
  ByteSet s;
  for (int b = lo; b <= hi; ++b) s.set(b);
  return s;
}

// Any well-formed UTF-8 sequence of 2 to 4 bytes (overlong and surrogate forms not excluded).
AstPtr MultiByteChar() {
  AstPtr alt = Node(Ast::kAlt);
  const ByteSet cont = Range(0x80, 0xBF);
  const std::pair<int, int> leads[] = {{0xC2, 0xDF}, {0xE0, 0xEF}, {0xF0, 0xF4}};
  for (int n = 0; n < 3; ++n) {
    AstPtr seq = Node(Ast::kSeq);
    seq->children.push_back(Bytes(Range(leads[n].first, leads[n].second)));
    for (int i = 0; i <= n; ++i) seq->children.push_back(Bytes(cont));
    alt->children.push_back(std::move(seq));
  }
  return alt;
}

// An ASCII set, widened by every multi-byte character when `with_multibyte`.
AstPtr CharSet(const ByteSet& ascii, bool with_multibyte) {
  if (!with_multibyte) return Bytes(ascii);
  AstPtr alt = Node(Ast::kAlt);
  alt->children.push_back(Bytes(ascii));
  alt->children.push_back(MultiByteChar());
  return alt;
}

void AppendUtf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

AstPtr Literal(std::string_view bytes) {
  AstPtr seq = Node(Ast::kSeq);
  for (unsigned char c : bytes) {
    ByteSet s;
    s.set(c);
    seq->children.push_back(Bytes(s));
  }
  return seq;
}

class Parser {
 public:
  explicit Parser(std::string_view p) : p_(p) {}

  absl::StatusOr<AstPtr> Parse() {
    if (!p_.empty() && p_.front() == '^') ++i_;
    size_t end = p_.size();
    if (end > i_ && p_[end - 1] == '$' && (end < 2 || p_[end - 2] != '\\')) p_ = p_.substr(0, end - 1);
    auto ast = Alternation(0);
    if (!ast.ok()) return ast;
    if (i_ != p_.size()) return Error("unbalanced ')'");
    return ast;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("regular expression: ", what, " at offset ", i_,
                                                   "; supported: literals, ., classes, groups, |, "
                                                   "* + ? {m,n}, ^ and $ at the ends"));
  }
  bool More() const { return i_ < p_.size(); }
  char Peek() const { return p_[i_]; }

  absl::StatusOr<AstPtr> Alternation(int depth) {
    if (depth > 64) return Error("groups nest too deeply");
    AstPtr alt = Node(Ast::kAlt);
    while (true) {
      auto seq = Sequence(depth);
      if (!seq.ok()) return seq.status();
      alt->children.push_back(std::move(*seq));
      if (More() && Peek() == '|') {
        ++i_;
        continue;
      }
      break;
    }
    if (alt->children.size() == 1) return std::move(alt->children[0]);
    return alt;
  }

  absl::StatusOr<AstPtr> Sequence(int depth) {
    AstPtr seq = Node(Ast::kSeq);
    while (More() && Peek() != '|' && Peek() != ')') {
      auto atom = Atom(depth);
      if (!atom.ok()) return atom.status();
      AstPtr a = std::move(*atom);
      while (More() && (Peek() == '*' || Peek() == '+' || Peek() == '?' || Peek() == '{')) {
        int min = 0, max = -1;
        const char q = p_[i_++];
        if (q == '+') min = 1;
        if (q == '?') max = 1;
        if (q == '{') {
          auto read = [&](int& v) {
            v = 0;
            size_t start = i_;
            while (More() && Peek() >= '0' && Peek() <= '9' && v <= kMaxRepeat) v = v * 10 + (p_[i_++] - '0');
            return i_ > start;
          };
          if (!read(min)) return Error("expected a count after '{'");
          max = min;
          if (More() && Peek() == ',') {
            ++i_;
            if (!read(max)) max = -1;
          }
          if (!More() || Peek() != '}') return Error("expected '}'");
          ++i_;
          if (min > kMaxRepeat || max > kMaxRepeat) return Error("a count above 256");
          if (max >= 0 && max < min) return Error("a {m,n} with n < m");
        }
        if (More() && Peek() == '?') ++i_;  // lazy: the same set of texts
        AstPtr r = Node(Ast::kRepeat);
        r->min = min;
        r->max = max;
        r->children.push_back(std::move(a));
        a = std::move(r);
      }
      seq->children.push_back(std::move(a));
    }
    return seq;
  }

  absl::StatusOr<ByteSet> ClassEscape(char c, bool& is_set) {
    is_set = true;
    switch (c) {
      case 'd': return Range('0', '9');
      case 'D': return ~Range('0', '9') & Range(0, 0x7F);
      case 'w': return Range('0', '9') | Range('a', 'z') | Range('A', 'Z') | Range('_', '_');
      case 'W': return ~(Range('0', '9') | Range('a', 'z') | Range('A', 'Z') | Range('_', '_')) & Range(0, 0x7F);
      case 's': return Range(' ', ' ') | Range('\t', '\r');
      case 'S': return ~(Range(' ', ' ') | Range('\t', '\r')) & Range(0, 0x7F);
      default: break;
    }
    is_set = false;
    ByteSet s;
    switch (c) {
      case 'n': s.set('\n'); return s;
      case 't': s.set('\t'); return s;
      case 'r': s.set('\r'); return s;
      case 'f': s.set('\f'); return s;
      case 'v': s.set('\v'); return s;
      default: break;
    }
    if ((c >= '0' && c <= '9') || c == 'b' || c == 'B' || c == 'k') {
      return Error(absl::StrCat("backreferences and \\", std::string(1, c), " are not supported"));
    }
    if (static_cast<unsigned char>(c) >= 0x80 || std::isalnum(static_cast<unsigned char>(c))) {
      return Error(absl::StrCat("unknown escape \\", std::string(1, c)));
    }
    s.set(static_cast<unsigned char>(c));
    return s;
  }

  absl::StatusOr<uint32_t> Hex4() {
    if (i_ + 4 > p_.size()) return Error("\\u needs 4 hex digits");
    uint32_t cp = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = p_[i_++];
      cp <<= 4;
      if (h >= '0' && h <= '9') cp |= h - '0';
      else if (h >= 'a' && h <= 'f') cp |= h - 'a' + 10;
      else if (h >= 'A' && h <= 'F') cp |= h - 'A' + 10;
      else return Error("\\u needs 4 hex digits");
    }
    if (cp >= 0xD800 && cp <= 0xDFFF) return Error("\\u of a surrogate");
    return cp;
  }

  absl::StatusOr<AstPtr> Atom(int depth) {
    const char c = p_[i_++];
    switch (c) {
      case '(': {
        if (More() && Peek() == '?') {
          if (i_ + 1 < p_.size() && p_[i_ + 1] == ':') {
            i_ += 2;
          } else {
            return Error("lookaround and named groups are not supported");
          }
        }
        auto inner = Alternation(depth + 1);
        if (!inner.ok()) return inner;
        if (!More() || Peek() != ')') return Error("missing ')'");
        ++i_;
        return inner;
      }
      case '[': return Class();
      case '.': {
        ByteSet s = Range(0, 0x7F);
        s.reset('\n');
        return CharSet(s, true);
      }
      case '\\': {
        if (!More()) return Error("a trailing backslash");
        const char e = p_[i_++];
        if (e == 'u') {
          auto cp = Hex4();
          if (!cp.ok()) return cp.status();
          std::string bytes;
          AppendUtf8(*cp, bytes);
          return Literal(bytes);
        }
        bool is_set = false;
        auto set = ClassEscape(e, is_set);
        if (!set.ok()) return set.status();
        const bool negated = e == 'D' || e == 'W' || e == 'S';
        return CharSet(*set, negated);
      }
      case '*': case '+': case '?': case '{': return Error("a quantifier with nothing to repeat");
      case ')': return Error("unbalanced ')'");
      case '^': case '$': return Error("'^' and '$' are supported only at the ends");
      default: {
        ByteSet s;
        s.set(static_cast<unsigned char>(c));
        return Bytes(s);
      }
    }
  }

  absl::StatusOr<AstPtr> Class() {
    bool negated = false;
    if (More() && Peek() == '^') {
      negated = true;
      ++i_;
    }
    ByteSet set;
    bool first = true;
    while (More() && (Peek() != ']' || first)) {
      first = false;
      auto one = [&](bool& is_set) -> absl::StatusOr<ByteSet> {
        is_set = false;
        const char c = p_[i_++];
        if (static_cast<unsigned char>(c) >= 0x80) return Error("a non-ASCII character in a class");
        if (c != '\\') {
          ByteSet s;
          s.set(static_cast<unsigned char>(c));
          return s;
        }
        if (!More()) return Error("a trailing backslash");
        const char e = p_[i_++];
        if (e == 'u') {
          auto cp = Hex4();
          if (!cp.ok()) return cp.status();
          if (*cp >= 0x80) return Error("a non-ASCII character in a class");
          ByteSet s;
          s.set(*cp);
          return s;
        }
        return ClassEscape(e, is_set);
      };
      bool lo_set = false;
      auto lo = one(lo_set);
      if (!lo.ok()) return lo.status();
      if (!lo_set && i_ + 1 < p_.size() && Peek() == '-' && p_[i_ + 1] != ']') {
        ++i_;
        bool hi_set = false;
        auto hi = one(hi_set);
        if (!hi.ok()) return hi.status();
        if (hi_set) return Error("a range ending in a class escape");
        int a = 0, b = 0;
        for (int k = 0; k < 256; ++k) {
          if ((*lo)[k]) a = k;
          if ((*hi)[k]) b = k;
        }
        if (b < a) return Error("a range out of order");
        set |= Range(a, b);
      } else {
        set |= *lo;
      }
    }
    if (!More()) return Error("missing ']'");
    ++i_;
    if (negated) {
      ByteSet ascii = ~set & Range(0, 0x7F);
      ascii.reset('\n');
      return CharSet(ascii, true);
    }
    return Bytes(set);
  }

  std::string_view p_;
  size_t i_ = 0;
};

// Thompson NFA: each state has byte edges and epsilon edges.
struct Nfa {
  struct State {
    std::vector<std::pair<ByteSet, int>> edges;
    std::vector<int> eps;
  };
  std::vector<State> states;
  int Add() {
    states.emplace_back();
    return static_cast<int>(states.size()) - 1;
  }
};

struct Frag {
  int start, end;
};

absl::StatusOr<Frag> Build(const Ast& a, Nfa& nfa) {
  if (nfa.states.size() > kMaxNfaStates) {
    return absl::ResourceExhaustedError("regular expression: too large (more than 20000 NFA states)");
  }
  switch (a.kind) {
    case Ast::kBytes: {
      Frag f{nfa.Add(), nfa.Add()};
      nfa.states[f.start].edges.push_back({a.bytes, f.end});
      return f;
    }
    case Ast::kSeq: {
      Frag f{nfa.Add(), 0};
      f.end = f.start;
      for (const AstPtr& c : a.children) {
        auto g = Build(*c, nfa);
        if (!g.ok()) return g;
        nfa.states[f.end].eps.push_back(g->start);
        f.end = g->end;
      }
      return f;
    }
    case Ast::kAlt: {
      Frag f{nfa.Add(), nfa.Add()};
      for (const AstPtr& c : a.children) {
        auto g = Build(*c, nfa);
        if (!g.ok()) return g;
        nfa.states[f.start].eps.push_back(g->start);
        nfa.states[g->end].eps.push_back(f.end);
      }
      return f;
    }
    case Ast::kRepeat: {
      Frag f{nfa.Add(), 0};
      f.end = f.start;
      const Ast& body = *a.children[0];
      for (int k = 0; k < a.min; ++k) {
        auto g = Build(body, nfa);
        if (!g.ok()) return g;
        nfa.states[f.end].eps.push_back(g->start);
        f.end = g->end;
      }
      if (a.max < 0) {
        auto g = Build(body, nfa);
        if (!g.ok()) return g;
        const int out = nfa.Add();
        nfa.states[f.end].eps.push_back(g->start);
        nfa.states[f.end].eps.push_back(out);
        nfa.states[g->end].eps.push_back(g->start);
        nfa.states[g->end].eps.push_back(out);
        f.end = out;
      } else {
        const int out = nfa.Add();
        for (int k = a.min; k < a.max; ++k) {
          auto g = Build(body, nfa);
          if (!g.ok()) return g;
          nfa.states[f.end].eps.push_back(out);
          nfa.states[f.end].eps.push_back(g->start);
          f.end = g->end;
        }
        nfa.states[f.end].eps.push_back(out);
        f.end = out;
      }
      return f;
    }
  }
  return absl::InternalError("regular expression: unknown node");
}

}  // namespace

class DfaBuilder {
 public:
  static absl::StatusOr<RegexDfa> FromAst(const Ast& ast) {
    Nfa nfa;
    auto frag = Build(ast, nfa);
    if (!frag.ok()) return frag.status();
    const int n = static_cast<int>(nfa.states.size());
    auto closure = [&](std::vector<int> set) {
      std::vector<bool> seen(n, false);
      std::vector<int> stack = set;
      for (int s : set) seen[s] = true;
      while (!stack.empty()) {
        const int s = stack.back();
        stack.pop_back();
        for (int t : nfa.states[s].eps) {
          if (!seen[t]) {
            seen[t] = true;
            set.push_back(t);
            stack.push_back(t);
          }
        }
      }
      // Only states with byte edges and the accepting state distinguish a DFA state.
      std::vector<int> kept;
      for (int s : set) {
        if (!nfa.states[s].edges.empty() || s == frag->end) kept.push_back(s);
      }
      std::sort(kept.begin(), kept.end());
      return kept;
    };
    RegexDfa dfa;
    std::map<std::vector<int>, int32_t> ids;
    std::vector<std::vector<int>> sets;
    auto intern = [&](std::vector<int> set) -> absl::StatusOr<int32_t> {
      if (set.empty()) return RegexDfa::kDead;
      auto [it, inserted] = ids.emplace(set, static_cast<int32_t>(sets.size()));
      if (inserted) {
        if (sets.size() >= RegexDfa::kMaxStates) {
          return absl::ResourceExhaustedError(
              "regular expression: its automaton passes 4096 states; simplify the pattern");
        }
        sets.push_back(std::move(set));
      }
      return it->second;
    };
    if (auto s = intern(closure({frag->start})); !s.ok()) return s.status();
    for (size_t d = 0; d < sets.size(); ++d) {
      std::vector<int32_t> row(256, RegexDfa::kDead);
      bool any = false;
      for (int b = 0; b < 256; ++b) {
        std::vector<int> next;
        for (int s : sets[d]) {
          for (const auto& [bytes, to] : nfa.states[s].edges) {
            if (bytes[b]) next.push_back(to);
          }
        }
        if (next.empty()) continue;
        std::sort(next.begin(), next.end());
        next.erase(std::unique(next.begin(), next.end()), next.end());
        auto id = intern(closure(std::move(next)));
        if (!id.ok()) return id.status();
        row[b] = *id;
        any = true;
      }
      dfa.transitions_.insert(dfa.transitions_.end(), row.begin(), row.end());
      dfa.accepting_.push_back(std::binary_search(sets[d].begin(), sets[d].end(), frag->end));
      dfa.final_.push_back(!any);
    }
    return dfa;
  }
};

absl::StatusOr<RegexDfa> RegexDfa::Compile(std::string_view pattern) {
  if (pattern.size() > 4096) {
    return absl::InvalidArgumentError("regular expression: longer than 4096 bytes");
  }
  Parser parser(pattern);
  auto ast = parser.Parse();
  if (!ast.ok()) return ast.status();
  return DfaBuilder::FromAst(**ast);
}

absl::StatusOr<RegexDfa> RegexDfa::Choice(const std::vector<std::string>& options) {
  if (options.empty()) return absl::InvalidArgumentError("choice: needs at least one option");
  AstPtr alt = Node(Ast::kAlt);
  for (const std::string& o : options) alt->children.push_back(Literal(o));
  return DfaBuilder::FromAst(*alt);
}

std::string RegexEscape(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace tandem::structured
