// Normalizers as Hugging Face's tokenizers applies them to a piece of text:
// - Replace substitutes every non-overlapping match, left to right.
// - Prepend adds its string in front of a non-empty piece only.
// - NFC/NFD/NFKC/NFKD are ICU's Normalizer2 (so Unicode's tables as of the linked ICU).
// - Lowercase maps each character on its own by Unicode's full lowercase mapping (Rust's
//   char::to_lowercase: "İ" becomes "i̇", a final "Σ" still becomes "σ").
// - Strip removes White_Space characters at the chosen ends.
#include "common/tokenizer/normalizer.h"

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/ustring.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tokenizer/json_fields.h"
#include "common/utf8.h"

namespace tandem::tokenizer {

bool IsWhiteSpace(char32_t cp) {
  return cp != kInvalidCodePoint && u_hasBinaryProperty(static_cast<UChar32>(cp), UCHAR_WHITE_SPACE);
}

absl::Status Normalizer::Parse(const nlohmann::json& json, const std::string& where,
                               std::vector<Step>& steps) {
  ASSIGN_OR_RETURN(std::string type, ComponentType(json, where));
  const std::string here = absl::StrCat(where, " (", type, ")");
  if (type == "Sequence") {
    RETURN_IF_ERROR(CheckKeys(json, {"type", "normalizers"}, here));
    auto list = json.find("normalizers");
    if (list == json.end() || !list->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(here, ": no \"normalizers\" array"));
    }
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(Parse((*list)[i], absl::StrCat(where, ".normalizers[", i, "]"), steps));
    }
    return absl::OkStatus();
  }
  Step step;
  if (type == "Replace") {
    RETURN_IF_ERROR(CheckKeys(json, {"type", "pattern", "content"}, here));
    step.kind = Kind::kReplace;
    ASSIGN_OR_RETURN(step.pattern, PatternField(json, "pattern", here));
    ASSIGN_OR_RETURN(step.content, StringField(json, "content", here));
  } else if (type == "Prepend") {
    RETURN_IF_ERROR(CheckKeys(json, {"type", "prepend"}, here));
    step.kind = Kind::kPrepend;
    ASSIGN_OR_RETURN(step.content, StringField(json, "prepend", here));
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD" ||
             type == "Lowercase") {
    RETURN_IF_ERROR(CheckKeys(json, {"type"}, here));
    step.kind = type == "NFC"    ? Kind::kNfc
                : type == "NFD"  ? Kind::kNfd
                : type == "NFKC" ? Kind::kNfkc
                : type == "NFKD" ? Kind::kNfkd
                                 : Kind::kLowercase;
  } else if (type == "Strip") {
    RETURN_IF_ERROR(CheckKeys(json, {"type", "strip_left", "strip_right"}, here));
    step.kind = Kind::kStrip;
    ASSIGN_OR_RETURN(step.left, BoolField(json, "strip_left", here, std::nullopt));
    ASSIGN_OR_RETURN(step.right, BoolField(json, "strip_right", here, std::nullopt));
  } else {
    return Unsupported(where, absl::StrCat("normalizer type \"", type, "\""));
  }
  steps.push_back(std::move(step));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Normalizer>> Normalizer::FromJson(const nlohmann::json& json,
                                                                 const std::string& where) {
  auto n = std::unique_ptr<Normalizer>(new Normalizer());
  RETURN_IF_ERROR(Parse(json, where, n->steps_));
  return n;
}

namespace {

void IcuNormalize(const icu::Normalizer2* norm, std::string& text) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::UnicodeString in = icu::UnicodeString::fromUTF8(text);
  if (norm->isNormalized(in, status) && U_SUCCESS(status)) return;
  status = U_ZERO_ERROR;
  const icu::UnicodeString out = norm->normalize(in, status);
  if (U_FAILURE(status)) return;
  text.clear();
  out.toUTF8String(text);
}

void Lowercase(std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const auto [cp, len] = DecodeUtf8(std::string_view(text).substr(i));
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp >= 'A' && cp <= 'Z' ? cp + 32 : cp));
    } else {
      UChar src[2];
      int32_t src_len = 0;
      U16_APPEND_UNSAFE(src, src_len, static_cast<UChar32>(cp));
      UChar dst[8];
      UErrorCode status = U_ZERO_ERROR;
      const int32_t n = u_strToLower(dst, 8, src, src_len, "", &status);
      if (U_FAILURE(status)) {
        out.append(text, i, len);
      } else {
        icu::UnicodeString(dst, n).toUTF8String(out);
      }
    }
    i += len;
  }
  text = std::move(out);
}

void Strip(std::string& text, bool left, bool right) {
  size_t begin = 0, end = text.size();
  if (left) {
    while (begin < end) {
      const auto [cp, len] = DecodeUtf8(std::string_view(text).substr(begin));
      if (!IsWhiteSpace(cp)) break;
      begin += len;
    }
  }
  if (right) {
    while (end > begin) {
      size_t start = end - 1;
      while (start > begin && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
      const auto [cp, len] = DecodeUtf8(std::string_view(text).substr(start, end - start));
      if (!IsWhiteSpace(cp)) break;
      end = start;
    }
  }
  text = text.substr(begin, end - begin);
}

}  // namespace

absl::Status Normalizer::Apply(std::string& text, RegexBudget& budget) const {
  UErrorCode status = U_ZERO_ERROR;
  for (const Step& step : steps_) {
    switch (step.kind) {
      case Kind::kReplace: {
        std::string out;
        ASSIGN_OR_RETURN(const std::vector<MatchSpan> spans,
                         step.pattern->FindMatches(text, budget));
        for (const MatchSpan& m : spans) {
          if (m.match) {
            out.append(step.content);
          } else {
            out.append(text, m.begin, m.end - m.begin);
          }
        }
        text = std::move(out);
        break;
      }
      case Kind::kPrepend:
        if (!text.empty()) text.insert(0, step.content);
        break;
      case Kind::kNfc:
        IcuNormalize(icu::Normalizer2::getNFCInstance(status), text);
        break;
      case Kind::kNfd:
        IcuNormalize(icu::Normalizer2::getNFDInstance(status), text);
        break;
      case Kind::kNfkc:
        IcuNormalize(icu::Normalizer2::getNFKCInstance(status), text);
        break;
      case Kind::kNfkd:
        IcuNormalize(icu::Normalizer2::getNFKDInstance(status), text);
        break;
      case Kind::kLowercase:
        Lowercase(text);
        break;
      case Kind::kStrip:
        Strip(text, step.left, step.right);
        break;
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::tokenizer
