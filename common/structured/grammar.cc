// JSON Schema -> SchemaNode graph, and the matcher that walks it byte by byte.
#include "common/structured/grammar.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace tandem::structured {
namespace {

using json = nlohmann::ordered_json;  // properties keep the schema's order

// Keywords that describe rather than constrain: accepted and ignored.
const std::set<std::string>& AnnotationKeywords() {
  static const std::set<std::string> k = {"title", "description", "default", "examples",
                                          "$schema", "$id", "$comment", "deprecated",
                                          "readOnly", "writeOnly", "strict", "name"};
  return k;
}

const std::set<std::string>& SupportedKeywords() {
  static const std::set<std::string> k = {
      "type", "properties", "required", "additionalProperties", "enum", "const", "items",
      "minItems", "maxItems", "anyOf", "oneOf", "$ref", "$defs", "definitions", "minLength",
      "maxLength", "pattern"};
  return k;
}

class SchemaCompiler {
 public:
  explicit SchemaCompiler(const json& root) : root_(root) {}

  absl::StatusOr<Grammar> Run() {
    any_ = AnyJson(g_);
    auto r = Compile(root_, "#", 0);
    if (!r.ok()) return r.status();
    g_.root = *r;
    return std::move(g_);
  }

  // The any-JSON node (and its parts), appended to `g`; returns its id.
  static int AnyJson(Grammar& g) {
    auto add = [&g](SchemaNode n) {
      g.nodes.push_back(std::move(n));
      return static_cast<int>(g.nodes.size()) - 1;
    };
    const int any = add(SchemaNode{});
    std::vector<int> alts;
    for (const char* lit : {"null", "true", "false"}) {
      SchemaNode n;
      n.kind = SchemaNode::kLiteral;
      n.literal = lit;
      alts.push_back(add(std::move(n)));
    }
    SchemaNode num;
    num.kind = SchemaNode::kNumber;
    alts.push_back(add(std::move(num)));
    SchemaNode str;
    str.kind = SchemaNode::kString;
    alts.push_back(add(std::move(str)));
    SchemaNode arr;
    arr.kind = SchemaNode::kArray;
    arr.items = any;
    alts.push_back(add(std::move(arr)));
    SchemaNode obj;
    obj.kind = SchemaNode::kObject;
    obj.map_values = any;
    alts.push_back(add(std::move(obj)));
    g.nodes[any].alternatives = std::move(alts);
    return any;
  }

 private:
  absl::Status Error(const std::string& where, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("json_schema at ", where, ": ", what));
  }

  int Add(SchemaNode n) {
    g_.nodes.push_back(std::move(n));
    return static_cast<int>(g_.nodes.size()) - 1;
  }

  absl::StatusOr<int> Count(const json& s, const char* key, const std::string& where) {
    const json& v = s[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 100000) {
      return Error(where, absl::StrCat("'", key, "' must be a non-negative integer"));
    }
    return static_cast<int>(v.get<int64_t>());
  }

  absl::StatusOr<int> Literal(const json& value) {
    SchemaNode n;
    n.kind = SchemaNode::kLiteral;
    n.literal = value.dump(-1, ' ', false, json::error_handler_t::replace);
    return Add(std::move(n));
  }

  absl::StatusOr<int> Ref(const std::string& ref, const std::string& where, int depth) {
    if (auto it = refs_.find(ref); it != refs_.end()) return it->second;
    if (ref.rfind("#", 0) != 0) {
      return Error(where, absl::StrCat("'$ref' ", ref, " is not local; only '#/...' refs are supported"));
    }
    const json* target = &root_;
    if (ref != "#") {
      json::json_pointer ptr;
      try {
        ptr = json::json_pointer(ref.substr(1));
      } catch (const json::exception&) {
        return Error(where, absl::StrCat("'$ref' ", ref, " is not a JSON pointer"));
      }
      if (!root_.contains(ptr)) return Error(where, absl::StrCat("'$ref' ", ref, " points nowhere"));
      target = &root_.at(ptr);
    }
    // A placeholder first, so that a recursive schema refers to itself.
    const int id = Add(SchemaNode{});
    refs_[ref] = id;
    auto body = Compile(*target, ref, depth + 1);
    if (!body.ok()) return body.status();
    g_.nodes[id].alternatives = {*body};
    return id;
  }

  absl::StatusOr<int> Compile(const json& s, const std::string& where, int depth) {
    if (depth > kMaxSchemaDepth) return Error(where, "nests deeper than 32 levels");
    if (g_.nodes.size() > kMaxSchemaNodes) return Error(where, "has more than 4096 subschemas");
    if (s.is_boolean()) {
      if (s.get<bool>()) return any_;
      return Error(where, "the schema 'false' accepts nothing");
    }
    if (!s.is_object()) return Error(where, "a schema must be an object or a boolean");
    for (const auto& [key, value] : s.items()) {
      if (!SupportedKeywords().count(key) && !AnnotationKeywords().count(key)) {
        return Error(where, absl::StrCat("the keyword '", key, "' is not supported"));
      }
    }
    if (s.contains("$ref")) {
      if (!s["$ref"].is_string()) return Error(where, "'$ref' must be a string");
      return Ref(s["$ref"].get<std::string>(), where, depth);
    }
    if (s.contains("const")) return Literal(s["const"]);
    if (s.contains("enum")) {
      const json& e = s["enum"];
      if (!e.is_array() || e.empty()) return Error(where, "'enum' must be a non-empty list");
      SchemaNode any;
      for (const json& v : e) {
        auto lit = Literal(v);
        if (!lit.ok()) return lit;
        any.alternatives.push_back(*lit);
      }
      return Add(std::move(any));
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (!s.contains(key)) continue;
      const json& list = s[key];
      if (!list.is_array() || list.empty()) {
        return Error(where, absl::StrCat("'", key, "' must be a non-empty list of schemas"));
      }
      for (const auto& [k, v] : s.items()) {
        if (k != key && SupportedKeywords().count(k) && k != "$defs" && k != "definitions") {
          return Error(where, absl::StrCat("'", k, "' beside '", key,
                                           "' is not supported; move it into each alternative"));
        }
      }
      SchemaNode any;
      for (size_t i = 0; i < list.size(); ++i) {
        auto alt = Compile(list[i], absl::StrCat(where, "/", key, "/", i), depth + 1);
        if (!alt.ok()) return alt;
        any.alternatives.push_back(*alt);
      }
      return Add(std::move(any));
    }
    std::vector<std::string> types;
    if (s.contains("type")) {
      const json& t = s["type"];
      if (t.is_string()) {
        types.push_back(t.get<std::string>());
      } else if (t.is_array() && !t.empty()) {
        for (const json& x : t) {
          if (!x.is_string()) return Error(where, "'type' must be a string or a list of strings");
          types.push_back(x.get<std::string>());
        }
      } else {
        return Error(where, "'type' must be a string or a list of strings");
      }
    } else if (s.contains("properties") || s.contains("additionalProperties") ||
               s.contains("required")) {
      types.push_back("object");
    } else if (s.contains("items") || s.contains("minItems") || s.contains("maxItems")) {
      types.push_back("array");
    } else if (s.contains("minLength") || s.contains("maxLength") || s.contains("pattern")) {
      types.push_back("string");
    } else {
      return any_;
    }
    SchemaNode any;
    for (const std::string& type : types) {
      auto node = Typed(s, type, where, depth);
      if (!node.ok()) return node;
      any.alternatives.push_back(*node);
    }
    if (any.alternatives.size() == 1) return any.alternatives[0];
    return Add(std::move(any));
  }

  absl::StatusOr<int> Typed(const json& s, const std::string& type, const std::string& where,
                            int depth) {
    SchemaNode n;
    if (type == "null" || type == "boolean") {
      if (type == "null") return Literal(nullptr);
      SchemaNode any;
      any.alternatives = {*Literal(true), *Literal(false)};
      return Add(std::move(any));
    }
    if (type == "integer" || type == "number") {
      n.kind = SchemaNode::kNumber;
      n.integer = type == "integer";
      return Add(std::move(n));
    }
    if (type == "string") {
      n.kind = SchemaNode::kString;
      if (s.contains("minLength")) {
        auto v = Count(s, "minLength", where);
        if (!v.ok()) return v.status();
        n.min_length = *v;
      }
      if (s.contains("maxLength")) {
        auto v = Count(s, "maxLength", where);
        if (!v.ok()) return v.status();
        n.max_length = *v;
      }
      if (n.max_length >= 0 && n.max_length < n.min_length) {
        return Error(where, "'maxLength' is less than 'minLength'");
      }
      if (s.contains("pattern")) {
        if (!s["pattern"].is_string()) return Error(where, "'pattern' must be a string");
        std::string p = s["pattern"].get<std::string>();
        // JSON Schema patterns match anywhere unless anchored.
        if (p.empty() || p.front() != '^') p = ".*(?:" + p + ")";
        else p = "(?:" + p.substr(1) + ")";
        if (p.size() < 2 || p[p.size() - 2] != '$' || p[p.size() - 3] == '\\') {
          p += ".*";
        } else {
          p.erase(p.size() - 2, 1);
        }
        auto dfa = RegexDfa::Compile(p);
        if (!dfa.ok()) return Error(where, absl::StrCat("'pattern': ", dfa.status().message()));
        g_.dfas.push_back(std::move(*dfa));
        n.pattern = static_cast<int>(g_.dfas.size()) - 1;
      }
      return Add(std::move(n));
    }
    if (type == "array") {
      n.kind = SchemaNode::kArray;
      n.items = any_;
      if (s.contains("items")) {
        auto items = Compile(s["items"], where + "/items", depth + 1);
        if (!items.ok()) return items;
        n.items = *items;
      }
      if (s.contains("minItems")) {
        auto v = Count(s, "minItems", where);
        if (!v.ok()) return v.status();
        n.min_items = *v;
      }
      if (s.contains("maxItems")) {
        auto v = Count(s, "maxItems", where);
        if (!v.ok()) return v.status();
        n.max_items = *v;
      }
      if (n.max_items >= 0 && n.max_items < n.min_items) {
        return Error(where, "'maxItems' is less than 'minItems'");
      }
      return Add(std::move(n));
    }
    if (type == "object") {
      n.kind = SchemaNode::kObject;
      std::set<std::string> required;
      if (s.contains("required")) {
        if (!s["required"].is_array()) return Error(where, "'required' must be a list of names");
        for (const json& r : s["required"]) {
          if (!r.is_string()) return Error(where, "'required' must be a list of names");
          required.insert(r.get<std::string>());
        }
      }
      const json* props = s.contains("properties") ? &s["properties"] : nullptr;
      if (props != nullptr && !props->is_object()) {
        return Error(where, "'properties' must be an object");
      }
      if (props != nullptr && !props->empty()) {
        for (const std::string& r : required) {
          if (!props->contains(r)) {
            return Error(where, absl::StrCat("'required' names '", r,
                                             "', which 'properties' does not define"));
          }
        }
        for (const auto& [key, sub] : props->items()) {
          auto value = Compile(sub, absl::StrCat(where, "/properties/", key), depth + 1);
          if (!value.ok()) return value;
          n.properties.push_back({json(key).dump(-1, ' ', false, json::error_handler_t::replace),
                                  *value, required.count(key) > 0});
        }
        if (s.contains("additionalProperties") && !s["additionalProperties"].is_boolean()) {
          return Error(where, "'additionalProperties' with a schema beside 'properties' is not "
                              "supported; use true or false");
        }
        return Add(std::move(n));
      }
      if (!required.empty()) {
        return Error(where, "'required' without 'properties' is not supported");
      }
      n.map_values = any_;
      if (s.contains("additionalProperties")) {
        const json& ap = s["additionalProperties"];
        if (ap.is_boolean() && !ap.get<bool>()) {
          n.map_values = -1;  // only {}
        } else {
          auto values = Compile(ap, where + "/additionalProperties", depth + 1);
          if (!values.ok()) return values;
          n.map_values = *values;
        }
      }
      return Add(std::move(n));
    }
    return Error(where, absl::StrCat("unknown type '", type, "'"));
  }

  const json& root_;
  Grammar g_;
  int any_ = 0;
  std::map<std::string, int> refs_;
};

// Node 0 of every JSON grammar is any-JSON; the free string used for map keys is its string.
int FreeStringNode(const Grammar& g) { return g.nodes[0].alternatives[4]; }

enum NumberPhase { kStart, kMinus, kIntDigits, kZero, kDot, kFrac, kExp, kExpSign, kExpDigits };
bool NumberCanEnd(int phase) {
  return phase == kIntDigits || phase == kZero || phase == kFrac || phase == kExpDigits;
}
bool IsDigit(uint8_t b) { return b >= '0' && b <= '9'; }

}  // namespace

absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchema(std::string_view schema_json) {
  if (schema_json.size() > kMaxSchemaBytes) {
    return absl::InvalidArgumentError("json_schema: longer than 64 KiB");
  }
  json schema;
  try {
    schema = json::parse(schema_json);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("json_schema: not valid JSON: ", e.what()));
  }
  SchemaCompiler compiler(schema);
  auto g = compiler.Run();
  if (!g.ok()) return g.status();
  return std::make_shared<const Grammar>(std::move(*g));
}

std::shared_ptr<const Grammar> JsonObjectGrammar() {
  Grammar g;
  const int any = SchemaCompiler::AnyJson(g);
  g.root = g.nodes[any].alternatives[6];
  return std::make_shared<const Grammar>(std::move(g));
}

absl::StatusOr<std::shared_ptr<const Grammar>> CompileRegex(std::string_view pattern) {
  auto dfa = RegexDfa::Compile(pattern);
  if (!dfa.ok()) return dfa.status();
  Grammar g;
  g.dfas.push_back(std::move(*dfa));
  SchemaNode n;
  n.kind = SchemaNode::kRegex;
  n.dfa = 0;
  g.nodes.push_back(std::move(n));
  return std::make_shared<const Grammar>(std::move(g));
}

absl::StatusOr<std::shared_ptr<const Grammar>> CompileChoice(const std::vector<std::string>& options) {
  auto dfa = RegexDfa::Choice(options);
  if (!dfa.ok()) return dfa.status();
  Grammar g;
  g.dfas.push_back(std::move(*dfa));
  SchemaNode n;
  n.kind = SchemaNode::kRegex;
  n.dfa = 0;
  g.nodes.push_back(std::move(n));
  return std::make_shared<const Grammar>(std::move(g));
}

Matcher::Matcher(std::shared_ptr<const Grammar> grammar) : grammar_(std::move(grammar)) {
  Push({}, grammar_->root, threads_);
}

void Matcher::Push(Stack s, int node, std::vector<Stack>& out) const {
  if (s.size() >= static_cast<size_t>(kMaxValueDepth)) return;
  // anyOf fans out; nested anyOf (and $ref placeholders) are followed a bounded number of times.
  std::vector<int> pending = {node};
  for (int guard = 0; !pending.empty() && guard < 256; ++guard) {
    const int id = pending.back();
    pending.pop_back();
    const SchemaNode& n = grammar_->nodes[id];
    if (n.kind == SchemaNode::kAnyOf) {
      for (auto it = n.alternatives.rbegin(); it != n.alternatives.rend(); ++it) pending.push_back(*it);
      continue;
    }
    Stack t = s;
    t.push_back(Frame{id, 0, 0, 0, 0});
    out.push_back(std::move(t));
  }
}

void Matcher::Feed(Stack s, uint8_t byte, std::vector<Stack>& out) const {
  if (s.empty()) return;
  Frame& f = s.back();
  const SchemaNode& n = grammar_->nodes[f.node];
  switch (n.kind) {
    case SchemaNode::kAnyOf:
      return;
    case SchemaNode::kRegex: {
      const int32_t next = grammar_->dfas[n.dfa].Next(f.c, byte);
      if (next == RegexDfa::kDead) return;
      f.c = next;
      out.push_back(std::move(s));
      return;
    }
    case SchemaNode::kLiteral: {
      if (static_cast<uint8_t>(n.literal[f.a]) != byte) return;
      if (++f.a == static_cast<int>(n.literal.size())) s.pop_back();
      out.push_back(std::move(s));
      return;
    }
    case SchemaNode::kNumber:
      return FeedNumber(std::move(s), byte, out);
    case SchemaNode::kString:
      return FeedString(std::move(s), byte, out);
    case SchemaNode::kArray:
      return FeedArray(std::move(s), byte, out);
    case SchemaNode::kObject:
      return FeedObject(std::move(s), byte, out);
  }
}

// A JSON number, one phase per byte (kStart .. kExpDigits); a: digits in the phase.
void Matcher::FeedNumber(Stack s, uint8_t byte, std::vector<Stack>& out) const {
  if (s.empty()) return;
  Frame& f = s.back();
  const SchemaNode& n = grammar_->nodes[f.node];
  int next = -1;
  switch (f.phase) {
    case kStart:
      if (byte == '-') next = kMinus;
      else if (byte == '0') next = kZero;
      else if (IsDigit(byte)) next = kIntDigits;
      break;
    case kMinus:
      if (byte == '0') next = kZero;
      else if (IsDigit(byte)) next = kIntDigits;
      break;
    case kIntDigits:
      if (IsDigit(byte) && f.a < kMaxNumberDigits) next = kIntDigits;
      [[fallthrough]];
    case kZero:
      if (next < 0 && !n.integer && byte == '.') next = kDot;
      if (next < 0 && !n.integer && (byte == 'e' || byte == 'E')) next = kExp;
      break;
    case kDot:
      if (IsDigit(byte)) next = kFrac;
      break;
    case kFrac:
      if (IsDigit(byte) && f.a < kMaxNumberDigits) next = kFrac;
      else if (byte == 'e' || byte == 'E') next = kExp;
      break;
    case kExp:
      if (byte == '+' || byte == '-') next = kExpSign;
      else if (IsDigit(byte)) next = kExpDigits;
      break;
    case kExpSign:
      if (IsDigit(byte)) next = kExpDigits;
      break;
    case kExpDigits:
      if (IsDigit(byte) && f.a < kMaxExponentDigits) next = kExpDigits;
      break;
  }
  if (next >= 0) {
    f.a = next == f.phase ? f.a + 1 : 1;
    f.phase = next;
    out.push_back(std::move(s));
    return;
  }
  if (!NumberCanEnd(f.phase)) return;
  s.pop_back();
  return Feed(std::move(s), byte, out);
}

// A JSON string of the node's length bounds, valid UTF-8 and pattern.
void Matcher::FeedString(Stack s, uint8_t byte, std::vector<Stack>& out) const {
  if (s.empty()) return;
  Frame& f = s.back();
  const SchemaNode& n = grammar_->nodes[f.node];
  // phase 0: before the opening quote; 1: in the body; 2: after a backslash; 3..6: \u digits.
  // a: code points so far; b: continuation bytes still due; c: the pattern's DFA state.
  if (f.phase == 0) {
    if (byte != '"') return;
    f.phase = 1;
    out.push_back(std::move(s));
    return;
  }
  if (f.phase == 2) {
    if (byte == 'u') {
      f.phase = 3;
    } else if (std::string_view("\"\\/bfnrt").find(static_cast<char>(byte)) != std::string_view::npos) {
      f.phase = 1;
    } else {
      return;
    }
    out.push_back(std::move(s));
    return;
  }
  if (f.phase >= 3) {
    if (!std::isxdigit(byte)) return;
    f.phase = f.phase == 6 ? 1 : f.phase + 1;
    out.push_back(std::move(s));
    return;
  }
  if (f.b > 0) {
    // b: continuation bytes due (low two bits) and, for the first of them, the narrower range
    // that keeps the character valid UTF-8 (bits above): no overlong forms, no surrogates,
    // nothing past U+10FFFF. A decoder shows invalid bytes as U+FFFD each, which would break
    // maxLength and patterns.
    static constexpr uint8_t kLow[] = {0x80, 0xA0, 0x80, 0x90, 0x80};
    static constexpr uint8_t kHigh[] = {0xBF, 0xBF, 0x9F, 0xBF, 0x8F};
    const int range = f.b >> 2;
    if (byte < kLow[range] || byte > kHigh[range]) return;
    f.b = (f.b & 3) - 1;
  } else {
    if (byte == '"') {
      if (f.a < n.min_length) return;
      if (n.pattern >= 0 && !grammar_->dfas[n.pattern].Accepting(f.c)) return;
      s.pop_back();
      out.push_back(std::move(s));
      return;
    }
    if (byte < 0x20) return;
    if (n.max_length >= 0 && f.a >= n.max_length) return;
    if (byte == '\\') {
      if (n.pattern >= 0) return;  // a patterned string is generated without escapes
      ++f.a;
      f.phase = 2;
      out.push_back(std::move(s));
      return;
    }
    if (byte >= 0x80) {
      if (byte >= 0xC2 && byte <= 0xDF) f.b = 1;
      else if (byte == 0xE0) f.b = (1 << 2) | 2;  // then A0..BF: not overlong
      else if (byte == 0xED) f.b = (2 << 2) | 2;  // then 80..9F: not a surrogate
      else if (byte >= 0xE1 && byte <= 0xEF) f.b = 2;
      else if (byte == 0xF0) f.b = (3 << 2) | 3;  // then 90..BF: not overlong
      else if (byte == 0xF4) f.b = (4 << 2) | 3;  // then 80..8F: at most U+10FFFF
      else if (byte >= 0xF1 && byte <= 0xF3) f.b = 3;
      else return;
    }
    ++f.a;
  }
  if (n.pattern >= 0) {
    f.c = grammar_->dfas[n.pattern].Next(f.c, byte);
    if (f.c == RegexDfa::kDead) return;
  }
  out.push_back(std::move(s));
  return;
}

// A JSON array of the node's items.
void Matcher::FeedArray(Stack s, uint8_t byte, std::vector<Stack>& out) const {
  if (s.empty()) return;
  Frame& f = s.back();
  const SchemaNode& n = grammar_->nodes[f.node];
  // phase 0: before '['; 1: after '['; 2: after an item. a: items begun.
  if (f.phase == 0) {
    if (byte != '[') return;
    f.phase = 1;
    out.push_back(std::move(s));
    return;
  }
  if (byte == ']' && f.a >= n.min_items) {
    s.pop_back();
    out.push_back(std::move(s));
    return;
  }
  const int items = n.items;
  if (f.phase == 1) {
    if (n.max_items == 0) return;
    f.phase = 2;
    f.a = 1;
    std::vector<Stack> pushed;
    Push(std::move(s), items, pushed);
    for (Stack& t : pushed) Feed(std::move(t), byte, out);
    return;
  }
  if (byte != ',' || (n.max_items >= 0 && f.a >= n.max_items)) return;
  ++f.a;
  Push(std::move(s), items, out);
  return;
}

// A JSON object: a map of one value kind, or declared properties in order.
void Matcher::FeedObject(Stack s, uint8_t byte, std::vector<Stack>& out) const {
  if (s.empty()) return;
  Frame& f = s.back();
  const SchemaNode& n = grammar_->nodes[f.node];
  if (f.phase == 0) {
    if (byte != '{') return;
    f.phase = 1;
    out.push_back(std::move(s));
    return;
  }
  if (n.properties.empty()) {
    // A map. phase 1: after '{'; 2: after a key; 4: after a value; 5: after ','.
    if (f.phase == 1 && byte == '}') {
      s.pop_back();
      out.push_back(std::move(s));
      return;
    }
    if (n.map_values < 0) return;
    if ((f.phase == 1 || f.phase == 5) && byte == '"') {
      f.phase = 2;
      s.push_back(Frame{FreeStringNode(*grammar_), 1, 0, 0, 0});
      out.push_back(std::move(s));
      return;
    }
    if (f.phase == 2 && byte == ':') {
      f.phase = 4;
      Push(std::move(s), n.map_values, out);
      return;
    }
    if (f.phase == 4 && byte == ',') {
      f.phase = 5;
      out.push_back(std::move(s));
      return;
    }
    if (f.phase == 4 && byte == '}') {
      s.pop_back();
      out.push_back(std::move(s));
    }
    return;
  }
  // Declared properties in order. a: the next property that may come; in a key (phase 2),
  // b: the candidate property and c: the key bytes matched. phase 1: after '{'; 3: after a
  // key; 4: after a value; 5: after ','.
  const int count = static_cast<int>(n.properties.size());
  int limit = f.a;  // the last property that may come next: up to the first required one
  while (limit < count && !n.properties[limit].required) ++limit;
  const bool may_close = limit == count;
  if (limit == count) limit = count - 1;
  if ((f.phase == 1 || f.phase == 4) && byte == '}') {
    if (!may_close) return;
    s.pop_back();
    out.push_back(std::move(s));
    return;
  }
  if (f.phase == 4) {
    if (byte != ',' || f.a >= count) return;
    f.phase = 5;
    out.push_back(std::move(s));
    return;
  }
  if (f.phase == 1 || f.phase == 5) {
    if (byte != '"' || f.a >= count) return;
    f.phase = 2;
    f.b = f.a;
    f.c = 1;
    out.push_back(std::move(s));
    return;
  }
  if (f.phase == 2) {
    const std::string& current = n.properties[f.b].key;
    for (int j = f.b; j <= limit; ++j) {
      const std::string& key = n.properties[j].key;
      if (key.size() > static_cast<size_t>(f.c) &&
          key.compare(0, f.c, current, 0, f.c) == 0 && static_cast<uint8_t>(key[f.c]) == byte) {
        f.b = j;
        if (++f.c == static_cast<int>(key.size())) f.phase = 3;
        out.push_back(std::move(s));
        return;
      }
    }
    return;
  }
  if (f.phase == 3 && byte == ':') {
    f.phase = 4;
    f.a = f.b + 1;
    Push(std::move(s), n.properties[f.b].value, out);
  }
  return;
}

bool Matcher::StepInto(std::vector<Stack>& threads, uint8_t byte) const {
  std::vector<Stack> next;
  for (const Stack& s : threads) Feed(s, byte, next);
  if (next.empty()) return false;
  std::vector<Stack> unique;
  for (Stack& s : next) {
    if (std::find(unique.begin(), unique.end(), s) == unique.end()) unique.push_back(std::move(s));
  }
  threads = std::move(unique);
  return true;
}

bool Matcher::Advance(uint8_t byte) { return StepInto(threads_, byte); }

bool Matcher::Advance(std::string_view bytes) {
  std::vector<Stack> threads = threads_;
  for (char c : bytes) {
    if (!StepInto(threads, static_cast<uint8_t>(c))) return false;
  }
  threads_ = std::move(threads);
  return true;
}

namespace {
bool ThreadAccepting(const Grammar& g, const Matcher::Stack& s) {
  if (s.empty()) return true;
  if (s.size() != 1) return false;
  const SchemaNode& n = g.nodes[s[0].node];
  if (n.kind == SchemaNode::kNumber) return NumberCanEnd(s[0].phase);
  if (n.kind == SchemaNode::kRegex) return g.dfas[n.dfa].Accepting(s[0].c);
  return false;
}
bool ThreadFinished(const Grammar& g, const Matcher::Stack& s) {
  if (s.empty()) return true;
  const SchemaNode& n = g.nodes[s[0].node];
  return s.size() == 1 && n.kind == SchemaNode::kRegex && g.dfas[n.dfa].Accepting(s[0].c) &&
         g.dfas[n.dfa].Final(s[0].c);
}
}  // namespace

bool Matcher::Accepting() const {
  return std::any_of(threads_.begin(), threads_.end(),
                     [&](const Stack& s) { return ThreadAccepting(*grammar_, s); });
}

bool Matcher::Finished() const {
  return std::all_of(threads_.begin(), threads_.end(),
                     [&](const Stack& s) { return ThreadFinished(*grammar_, s); });
}

}  // namespace tandem::structured
