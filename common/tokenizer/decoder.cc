// Decoders as Hugging Face's decode_chain runs them, each mapping the list of token strings to a
// new list, joined at the end:
// - ByteLevel: every token's characters back to bytes through GPT-2's alphabet (a token with a
//   character outside it keeps its own UTF-8), all tokens' bytes as one string, ill-formed UTF-8
//   replaced by U+FFFD.
// - Metaspace: the replacement character becomes ' ', except that in the first token it is
//   dropped unless prepend_scheme is "never".
// - Replace: the pattern's matches in each token become the content.
// - ByteFallback: runs of <0xXX> tokens become their bytes when those are UTF-8, else one U+FFFD
//   per byte.
// - Fuse: all tokens joined into one. Strip: up to `start` leading and `stop` trailing copies of
//   the character removed from each token.
#include "common/tokenizer/decoder.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tokenizer/byte_alphabet.h"
#include "common/tokenizer/json_fields.h"
#include "common/utf8.h"

namespace tandem::tokenizer {

absl::Status Decoder::Parse(const nlohmann::json& json, const std::string& where,
                            std::vector<Step>& steps) {
  ASSIGN_OR_RETURN(std::string type, ComponentType(json, where));
  const std::string here = absl::StrCat(where, " (", type, ")");
  if (type == "Sequence") {
    RETURN_IF_ERROR(CheckKeys(json, {"type", "decoders"}, here));
    auto list = json.find("decoders");
    if (list == json.end() || !list->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(here, ": no \"decoders\" array"));
    }
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(Parse((*list)[i], absl::StrCat(where, ".decoders[", i, "]"), steps));
    }
    return absl::OkStatus();
  }
  Step step;
  if (type == "ByteLevel") {
    RETURN_IF_ERROR(CheckKeys(json, {"type", "add_prefix_space", "trim_offsets", "use_regex"}, here));
    step.kind = Kind::kByteLevel;
  } else if (type == "Metaspace") {
    RETURN_IF_ERROR(CheckKeys(
        json, {"type", "replacement", "add_prefix_space", "prepend_scheme", "split", "str_rep"},
        here));
    step.kind = Kind::kMetaspace;
    ASSIGN_OR_RETURN(step.text, CharField(json, "replacement", here));
    ASSIGN_OR_RETURN(std::string scheme, StringField(json, "prepend_scheme", here, "always"));
    if (scheme != "always" && scheme != "never" && scheme != "first") {
      return Unsupported(here, absl::StrCat("prepend_scheme \"", scheme, "\""));
    }
    step.prepend = scheme != "never";
    if (auto aps = json.find("add_prefix_space");
        aps != json.end() && aps->is_boolean() && !aps->get<bool>()) {
      step.prepend = false;
    }
  } else if (type == "Replace") {
    RETURN_IF_ERROR(CheckKeys(json, {"type", "pattern", "content"}, here));
    step.kind = Kind::kReplace;
    ASSIGN_OR_RETURN(step.pattern, PatternField(json, "pattern", here));
    ASSIGN_OR_RETURN(step.text, StringField(json, "content", here));
  } else if (type == "ByteFallback" || type == "Fuse") {
    RETURN_IF_ERROR(CheckKeys(json, {"type"}, here));
    step.kind = type == "Fuse" ? Kind::kFuse : Kind::kByteFallback;
  } else if (type == "Strip") {
    RETURN_IF_ERROR(CheckKeys(json, {"type", "content", "start", "stop"}, here));
    step.kind = Kind::kStrip;
    ASSIGN_OR_RETURN(step.text, CharField(json, "content", here));
    ASSIGN_OR_RETURN(int64_t start, IntField(json, "start", here, std::nullopt));
    ASSIGN_OR_RETURN(int64_t stop, IntField(json, "stop", here, std::nullopt));
    if (start < 0 || stop < 0) {
      return absl::InvalidArgumentError(absl::StrCat(here, ": start and stop must be >= 0"));
    }
    step.start = static_cast<size_t>(start);
    step.stop = static_cast<size_t>(stop);
  } else {
    return Unsupported(where, absl::StrCat("decoder type \"", type, "\""));
  }
  steps.push_back(std::move(step));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Decoder>> Decoder::FromJson(const nlohmann::json& json,
                                                           const std::string& where) {
  auto d = std::unique_ptr<Decoder>(new Decoder());
  RETURN_IF_ERROR(Parse(json, where, d->steps_));
  return d;
}

std::unique_ptr<Decoder> Decoder::RawByteLevel() {
  auto d = std::unique_ptr<Decoder>(new Decoder());
  Step step;
  step.kind = Kind::kRawByteLevel;
  d->steps_.push_back(std::move(step));
  return d;
}

namespace {

std::string ByteLevelBytes(const std::vector<std::string>& tokens) {
  const ByteAlphabet& a = GetByteAlphabet();
  std::string bytes;
  std::string token_bytes;
  for (const std::string& token : tokens) {
    token_bytes.clear();
    bool all = true;
    for (size_t i = 0; i < token.size() && all;) {
      const auto [cp, len] = DecodeUtf8(std::string_view(token).substr(i));
      if (cp < a.cp_to_byte.size() && a.cp_to_byte[cp] >= 0) {
        token_bytes.push_back(static_cast<char>(a.cp_to_byte[cp]));
      } else {
        all = false;
      }
      i += len;
    }
    bytes.append(all ? token_bytes : token);
  }
  return bytes;
}

// The characters of well-formed UTF-8 `s`, each as its own string.
std::vector<std::string_view> Chars(std::string_view s) {
  std::vector<std::string_view> chars;
  for (size_t i = 0; i < s.size();) {
    const int len = DecodeUtf8(s.substr(i)).second;
    chars.push_back(s.substr(i, len));
    i += len;
  }
  return chars;
}

// "<0xXX>" -> XX, else -1.
int ByteToken(const std::string& token) {
  if (token.size() != 6 || !token.starts_with("<0x") || token[5] != '>') return -1;
  int value = 0;
  for (int i = 3; i < 5; ++i) {
    const char c = token[i];
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'A' && c <= 'F') {
      digit = c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else {
      return -1;
    }
    value = value * 16 + digit;
  }
  return value;
}

}  // namespace

absl::StatusOr<std::string> Decoder::Decode(std::vector<std::string> tokens) const {
  size_t bytes = 0;
  for (const std::string& token : tokens) bytes += token.size();
  RegexBudget budget = RegexBudget::ForText(bytes);
  for (const Step& step : steps_) {
    switch (step.kind) {
      case Kind::kByteLevel:
        tokens = {ToValidUtf8(ByteLevelBytes(tokens))};
        break;
      case Kind::kRawByteLevel:
        tokens = {ByteLevelBytes(tokens)};
        break;
      case Kind::kMetaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          std::string out;
          for (std::string_view c : Chars(tokens[i])) {
            if (c == step.text) {
              if (i == 0 && step.prepend) continue;
              out.push_back(' ');
            } else {
              out.append(c);
            }
          }
          tokens[i] = std::move(out);
        }
        break;
      case Kind::kReplace:
        for (std::string& token : tokens) {
          std::string out;
          ASSIGN_OR_RETURN(const std::vector<MatchSpan> spans,
                           step.pattern->FindMatches(token, budget));
          for (const MatchSpan& m : spans) {
            if (m.match) {
              out.append(step.text);
            } else {
              out.append(token, m.begin, m.end - m.begin);
            }
          }
          token = std::move(out);
        }
        break;
      case Kind::kByteFallback: {
        std::vector<std::string> out;
        std::string pending;
        auto flush = [&] {
          if (pending.empty()) return;
          if (IsValidUtf8(pending)) {
            out.push_back(pending);
          } else {
            for (size_t i = 0; i < pending.size(); ++i) out.push_back("\xEF\xBF\xBD");
          }
          pending.clear();
        };
        for (std::string& token : tokens) {
          const int byte = ByteToken(token);
          if (byte >= 0) {
            pending.push_back(static_cast<char>(byte));
          } else {
            flush();
            out.push_back(std::move(token));
          }
        }
        flush();
        tokens = std::move(out);
        break;
      }
      case Kind::kFuse: {
        std::string joined;
        for (const std::string& token : tokens) joined += token;
        tokens = {std::move(joined)};
        break;
      }
      case Kind::kStrip:
        for (std::string& token : tokens) {
          const std::vector<std::string_view> chars = Chars(token);
          size_t begin = 0, end = chars.size();
          for (size_t i = 0; i < step.start && i < chars.size() && chars[i] == step.text; ++i) {
            begin = i + 1;
          }
          for (size_t i = 0; i < step.stop && i < chars.size(); ++i) {
            const size_t index = chars.size() - i - 1;
            if (chars[index] != step.text) break;
            end = index;
          }
          std::string out;
          for (size_t i = begin; i < end; ++i) out.append(chars[i]);
          token = std::move(out);
        }
        break;
    }
  }
  std::string text;
  for (const std::string& token : tokens) text += token;
  return text;
}

}  // namespace tandem::tokenizer
