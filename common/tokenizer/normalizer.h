// tokenizer.json's "normalizer": rewrites text before it is split (Hugging Face's normalizers,
// without the offset bookkeeping, which ids do not depend on).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/tokenizer/regex.h"
#include "nlohmann/json.hpp"

namespace tandem::tokenizer {

class Normalizer {
 public:
  // Replace, Prepend, NFC, NFD, NFKC, NFKD, Lowercase, Strip and Sequence of them; any other type
  // or field is refused with its name. `where` names the JSON field for errors.
  static absl::StatusOr<std::unique_ptr<Normalizer>> FromJson(const nlohmann::json& json,
                                                              const std::string& where);

  // `text` is well-formed UTF-8 and stays so. Replace's regexes spend `budget`; their errors
  // (regex.h) come back, `text` then unspecified.
  absl::Status Apply(std::string& text, RegexBudget& budget) const;

 private:
  enum class Kind { kReplace, kPrepend, kNfc, kNfd, kNfkc, kNfkd, kLowercase, kStrip };
  struct Step {
    Kind kind;
    std::shared_ptr<const Pattern> pattern;  // kReplace
    std::string content;                     // kReplace, kPrepend
    bool left = false, right = false;        // kStrip
  };
  static absl::Status Parse(const nlohmann::json& json, const std::string& where,
                            std::vector<Step>& steps);
  std::vector<Step> steps_;
};

// Unicode's White_Space property (Rust's char::is_whitespace).
bool IsWhiteSpace(char32_t cp);

}  // namespace tandem::tokenizer
