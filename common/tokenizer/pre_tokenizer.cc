// Pre-tokenizers as Hugging Face's tokenizers runs them, piece by piece:
// - ByteLevel: with add_prefix_space every piece not starting with ' ' gets one; with use_regex
//   pieces are split by GPT-2's pattern (Oniguruma's \s, i.e. White_Space); then every byte of
//   the piece becomes its character in GPT-2's byte alphabet.
// - Split: the pattern's matches (inverted when `invert`) cut the piece as `behavior` says.
// - Metaspace: ' ' becomes the replacement character, which is prepended as prepend_scheme says
//   (always; never; first: only to the piece that begins the text), and with `split` each
//   replacement character begins a new piece.
// - Digits: runs of numeric characters (Nd, Nl, No) apart, or each one when individual_digits.
// - Whitespace: \w+ and [^\w\s]+ runs, whitespace dropped. WhitespaceSplit: whitespace dropped.
// - Punctuation: punctuation characters (ASCII punctuation and P*) as `behavior` says.
#include "common/tokenizer/pre_tokenizer.h"

#include <unicode/uchar.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tokenizer/byte_alphabet.h"
#include "common/tokenizer/json_fields.h"
#include "common/tokenizer/normalizer.h"
#include "common/utf8.h"

namespace tandem::tokenizer {
namespace {

constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

absl::StatusOr<SplitBehavior> ParseBehavior(const nlohmann::json& obj, const std::string& where,
                                            std::optional<std::string> fallback) {
  ASSIGN_OR_RETURN(std::string b, StringField(obj, "behavior", where, fallback));
  if (b == "Removed") return SplitBehavior::kRemoved;
  if (b == "Isolated") return SplitBehavior::kIsolated;
  if (b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (b == "Contiguous") return SplitBehavior::kContiguous;
  return Unsupported(where, absl::StrCat("behavior \"", b, "\""));
}

bool IsNumeric(char32_t cp) {
  if (cp == kInvalidCodePoint) return false;
  const int8_t t = u_charType(static_cast<UChar32>(cp));
  return t == U_DECIMAL_DIGIT_NUMBER || t == U_LETTER_NUMBER || t == U_OTHER_NUMBER;
}

bool IsPunctuation(char32_t cp) {
  if (cp < 0x80) {
    return (cp >= '!' && cp <= '/') || (cp >= ':' && cp <= '@') || (cp >= '[' && cp <= '`') ||
           (cp >= '{' && cp <= '~');
  }
  if (cp == kInvalidCodePoint) return false;
  return (U_GET_GC_MASK(static_cast<UChar32>(cp)) & U_GC_P_MASK) != 0;
}

// Hugging Face's Pattern for Fn(char) -> bool: each matching character is a match of its own.
template <typename Pred>
std::vector<MatchSpan> CharSpans(std::string_view text, Pred pred) {
  std::vector<MatchSpan> spans;
  if (text.empty()) {
    spans.push_back({0, 0, false});
    return spans;
  }
  size_t last = 0;
  for (size_t i = 0; i < text.size();) {
    const auto [cp, len] = DecodeUtf8(text.substr(i));
    if (pred(cp)) {
      if (last < i) spans.push_back({last, i, false});
      spans.push_back({i, i + len, true});
      last = i + len;
    }
    i += len;
  }
  if (last < text.size()) spans.push_back({last, text.size(), false});
  return spans;
}

// GPT-2's pattern over JavaScript's \s, as a scanner (see PreTokenizer::Gpt2JavaScript).
enum class CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

bool IsJsSpace(char32_t cp) {
  switch (cp) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x20:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
    case 0xFEFF:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

CharClass Classify(char32_t cp) {
  if (cp == kInvalidCodePoint) return CharClass::kOther;
  if (cp < 0x80) {
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return CharClass::kLetter;
    if (cp >= '0' && cp <= '9') return CharClass::kNumber;
    return IsJsSpace(cp) ? CharClass::kSpace : CharClass::kOther;
  }
  if (IsJsSpace(cp)) return CharClass::kSpace;
  switch (u_charType(static_cast<UChar32>(cp))) {
    case U_UPPERCASE_LETTER:
    case U_LOWERCASE_LETTER:
    case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER:
    case U_OTHER_LETTER:
      return CharClass::kLetter;
    case U_DECIMAL_DIGIT_NUMBER:
    case U_LETTER_NUMBER:
    case U_OTHER_NUMBER:
      return CharClass::kNumber;
    default:
      return CharClass::kOther;
  }
}

// Spans of GPT-2's pattern with JavaScript's \s; bytes that are not UTF-8 are each a character
// that is neither letter, number nor space.
std::vector<MatchSpan> Gpt2JavaScriptSpans(std::string_view text) {
  struct Unit {
    size_t offset;
    char32_t cp;
    CharClass cls;
  };
  std::vector<Unit> units;
  for (size_t i = 0; i < text.size();) {
    auto [cp, len] = DecodeUtf8(text.substr(i));
    if (cp == kInvalidCodePoint) len = 1;  // each stray byte on its own
    units.push_back({i, cp, Classify(cp)});
    i += len;
  }
  const size_t n = units.size();
  auto offset = [&](size_t u) { return u < n ? units[u].offset : text.size(); };
  auto run_end = [&](size_t u, CharClass cls) {
    while (u < n && units[u].cls == cls) ++u;
    return u;
  };
  std::vector<MatchSpan> spans;
  size_t u = 0;
  while (u < n) {
    const Unit& c = units[u];
    size_t end = 0;
    // 's|'t|'re|'ve|'m|'ll|'d (case-sensitive, ASCII apostrophe only)
    if (c.cp == '\'' && u + 1 < n) {
      const char32_t c1 = units[u + 1].cp;
      const char32_t c2 = u + 2 < n ? units[u + 2].cp : 0;
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
        end = u + 2;
      } else if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
        end = u + 3;
      }
    }
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional U+0020 and then a run of one class.
    if (end == 0) {
      const size_t start =
          (c.cp == ' ' && u + 1 < n && units[u + 1].cls != CharClass::kSpace) ? u + 1 : u;
      if (units[start].cls != CharClass::kSpace) end = run_end(start, units[start].cls);
    }
    // `\s+(?!\S)|\s+`: a whitespace run before a non-space gives up its last character unless it
    // is only one character long.
    if (end == 0) {
      end = run_end(u, CharClass::kSpace);
      if (end < n && end - u >= 2) --end;
    }
    spans.push_back({offset(u), offset(end), true});
    u = end;
  }
  if (spans.empty()) spans.push_back({0, 0, false});
  return spans;
}

void ToByteAlphabet(std::string& text) {
  const ByteAlphabet& a = GetByteAlphabet();
  std::string out;
  out.reserve(text.size() * 2);
  for (unsigned char b : text) out.append(a.byte_to_utf8[b]);
  text = std::move(out);
}

}  // namespace

void SplitPiece(const Piece& piece, const std::vector<MatchSpan>& spans, SplitBehavior behavior,
                std::vector<Piece>& out) {
  // (begin, end, remove) per part, as Hugging Face's NormalizedString::split folds them.
  struct Part {
    size_t begin, end;
    bool remove;
  };
  std::vector<Part> parts;
  parts.reserve(spans.size());
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const MatchSpan& m : spans) parts.push_back({m.begin, m.end, false});
      break;
    case SplitBehavior::kRemoved:
      for (const MatchSpan& m : spans) parts.push_back({m.begin, m.end, m.match});
      break;
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const MatchSpan& m : spans) {
        if (m.match == previous_match && !parts.empty()) {
          parts.back().end = m.end;
        } else {
          parts.push_back({m.begin, m.end, false});
        }
        previous_match = m.match;
      }
      break;
    }
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const MatchSpan& m : spans) {
        if (m.match && !previous_match && !parts.empty()) {
          parts.back().end = m.end;
        } else {
          parts.push_back({m.begin, m.end, false});
        }
        previous_match = m.match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !previous_match && !parts.empty()) {
          parts.back().begin = it->begin;
        } else {
          parts.push_back({it->begin, it->end, false});
        }
        previous_match = it->match;
      }
      std::reverse(parts.begin(), parts.end());
      break;
    }
  }
  for (const Part& p : parts) {
    if (p.remove || p.end == p.begin) continue;
    out.push_back({piece.text.substr(p.begin, p.end - p.begin), piece.at_start && p.begin == 0});
  }
}

absl::Status PreTokenizer::Parse(const nlohmann::json& json, const std::string& where,
                                 std::vector<Step>& steps) {
  ASSIGN_OR_RETURN(std::string type, ComponentType(json, where));
  const std::string here = absl::StrCat(where, " (", type, ")");
  if (type == "Sequence") {
    RETURN_IF_ERROR(CheckKeys(json, {"type", "pretokenizers"}, here));
    auto list = json.find("pretokenizers");
    if (list == json.end() || !list->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(here, ": no \"pretokenizers\" array"));
    }
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(Parse((*list)[i], absl::StrCat(where, ".pretokenizers[", i, "]"), steps));
    }
    return absl::OkStatus();
  }
  Step step;
  if (type == "ByteLevel") {
    // trim_offsets only moves offsets.
    RETURN_IF_ERROR(CheckKeys(json, {"type", "add_prefix_space", "trim_offsets", "use_regex"}, here));
    step.kind = Kind::kByteLevel;
    ASSIGN_OR_RETURN(step.add_prefix_space, BoolField(json, "add_prefix_space", here, true));
    ASSIGN_OR_RETURN(bool use_regex, BoolField(json, "use_regex", here, true));
    if (use_regex) {
      static const auto* gpt2 = new std::shared_ptr<const Pattern>(
          *Pattern::Regex(kGpt2Pattern, "ByteLevel's pattern"));
      step.pattern = *gpt2;
    }
  } else if (type == "Split") {
    RETURN_IF_ERROR(CheckKeys(json, {"type", "pattern", "behavior", "invert"}, here));
    step.kind = Kind::kSplit;
    ASSIGN_OR_RETURN(step.pattern, PatternField(json, "pattern", here));
    ASSIGN_OR_RETURN(step.behavior, ParseBehavior(json, here, std::nullopt));
    ASSIGN_OR_RETURN(step.invert, BoolField(json, "invert", here, std::nullopt));
  } else if (type == "Metaspace") {
    RETURN_IF_ERROR(CheckKeys(
        json, {"type", "replacement", "add_prefix_space", "prepend_scheme", "split", "str_rep"},
        here));
    step.kind = Kind::kMetaspace;
    ASSIGN_OR_RETURN(step.replacement, CharField(json, "replacement", here));
    ASSIGN_OR_RETURN(std::string scheme, StringField(json, "prepend_scheme", here, "always"));
    if (scheme == "always") {
      step.prepend = Step::Prepend::kAlways;
    } else if (scheme == "never") {
      step.prepend = Step::Prepend::kNever;
    } else if (scheme == "first") {
      step.prepend = Step::Prepend::kFirst;
    } else {
      return Unsupported(here, absl::StrCat("prepend_scheme \"", scheme, "\""));
    }
    // The older add_prefix_space: false means prepend_scheme "never" (and must not contradict it).
    if (auto aps = json.find("add_prefix_space"); aps != json.end() && aps->is_boolean() &&
                                                  !aps->get<bool>()) {
      if (step.prepend != Step::Prepend::kNever && json.contains("prepend_scheme")) {
        return absl::InvalidArgumentError(
            absl::StrCat(here, ": add_prefix_space false contradicts prepend_scheme ", scheme));
      }
      step.prepend = Step::Prepend::kNever;
    }
    ASSIGN_OR_RETURN(step.split, BoolField(json, "split", here, true));
  } else if (type == "Digits") {
    RETURN_IF_ERROR(CheckKeys(json, {"type", "individual_digits"}, here));
    step.kind = Kind::kDigits;
    ASSIGN_OR_RETURN(step.individual_digits, BoolField(json, "individual_digits", here, false));
  } else if (type == "Whitespace") {
    RETURN_IF_ERROR(CheckKeys(json, {"type"}, here));
    step.kind = Kind::kWhitespace;
    static const auto* words = new std::shared_ptr<const Pattern>(
        *Pattern::Regex(R"(\w+|[^\w\s]+)", "Whitespace's pattern"));
    step.pattern = *words;
  } else if (type == "WhitespaceSplit") {
    RETURN_IF_ERROR(CheckKeys(json, {"type"}, here));
    step.kind = Kind::kWhitespaceSplit;
  } else if (type == "Punctuation") {
    RETURN_IF_ERROR(CheckKeys(json, {"type", "behavior"}, here));
    step.kind = Kind::kPunctuation;
    ASSIGN_OR_RETURN(step.behavior, ParseBehavior(json, here, "Isolated"));
  } else {
    return Unsupported(where, absl::StrCat("pre_tokenizer type \"", type, "\""));
  }
  steps.push_back(std::move(step));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PreTokenizer>> PreTokenizer::FromJson(const nlohmann::json& json,
                                                                     const std::string& where) {
  auto p = std::unique_ptr<PreTokenizer>(new PreTokenizer());
  RETURN_IF_ERROR(Parse(json, where, p->steps_));
  return p;
}

std::unique_ptr<PreTokenizer> PreTokenizer::Gpt2JavaScript() {
  auto p = std::unique_ptr<PreTokenizer>(new PreTokenizer());
  Step step;
  step.kind = Kind::kGpt2JavaScript;
  p->steps_.push_back(std::move(step));
  return p;
}

absl::Status PreTokenizer::ApplyStep(const Step& step, std::vector<Piece>& pieces,
                                     RegexBudget& budget) const {
  std::vector<Piece> out;
  out.reserve(pieces.size() * 2);
  for (Piece& piece : pieces) {
    switch (step.kind) {
      case Kind::kByteLevel: {
        if (step.add_prefix_space && piece.text[0] != ' ') piece.text.insert(0, " ");
        const size_t first = out.size();
        if (step.pattern != nullptr) {
          ASSIGN_OR_RETURN(const std::vector<MatchSpan> spans,
                           step.pattern->FindMatches(piece.text, budget));
          SplitPiece(piece, spans, SplitBehavior::kIsolated, out);
        } else {
          out.push_back(std::move(piece));
        }
        for (size_t i = first; i < out.size(); ++i) ToByteAlphabet(out[i].text);
        break;
      }
      case Kind::kGpt2JavaScript: {
        const size_t first = out.size();
        SplitPiece(piece, Gpt2JavaScriptSpans(piece.text), SplitBehavior::kIsolated, out);
        for (size_t i = first; i < out.size(); ++i) ToByteAlphabet(out[i].text);
        break;
      }
      case Kind::kSplit: {
        ASSIGN_OR_RETURN(std::vector<MatchSpan> spans,
                         step.pattern->FindMatches(piece.text, budget));
        if (step.invert) {
          for (MatchSpan& m : spans) m.match = !m.match;
        }
        SplitPiece(piece, spans, step.behavior, out);
        break;
      }
      case Kind::kMetaspace: {
        std::string text;
        text.reserve(piece.text.size() + 3);
        for (char c : piece.text) {
          if (c == ' ') {
            text.append(step.replacement);
          } else {
            text.push_back(c);
          }
        }
        const bool prepend =
            step.prepend == Step::Prepend::kAlways ||
            (step.prepend == Step::Prepend::kFirst && piece.at_start);
        if (prepend && !text.starts_with(step.replacement)) text.insert(0, step.replacement);
        Piece replaced{std::move(text), piece.at_start};
        if (step.split) {
          const auto [rep, rep_len] = DecodeUtf8(step.replacement);
          SplitPiece(replaced,
                     CharSpans(replaced.text, [rep = rep](char32_t cp) { return cp == rep; }),
                     SplitBehavior::kMergedWithNext, out);
        } else {
          out.push_back(std::move(replaced));
        }
        break;
      }
      case Kind::kDigits:
        SplitPiece(piece, CharSpans(piece.text, IsNumeric),
                   step.individual_digits ? SplitBehavior::kIsolated : SplitBehavior::kContiguous,
                   out);
        break;
      case Kind::kWhitespace: {
        ASSIGN_OR_RETURN(std::vector<MatchSpan> spans,
                         step.pattern->FindMatches(piece.text, budget));
        for (MatchSpan& m : spans) m.match = !m.match;
        SplitPiece(piece, spans, SplitBehavior::kRemoved, out);
        break;
      }
      case Kind::kWhitespaceSplit:
        SplitPiece(piece, CharSpans(piece.text, IsWhiteSpace), SplitBehavior::kRemoved, out);
        break;
      case Kind::kPunctuation:
        SplitPiece(piece, CharSpans(piece.text, IsPunctuation), step.behavior, out);
        break;
    }
  }
  pieces = std::move(out);
  return absl::OkStatus();
}

absl::Status PreTokenizer::Apply(std::vector<Piece>& pieces, RegexBudget& budget) const {
  for (const Step& step : steps_) RETURN_IF_ERROR(ApplyStep(step, pieces, budget));
  return absl::OkStatus();
}

}  // namespace tandem::tokenizer
