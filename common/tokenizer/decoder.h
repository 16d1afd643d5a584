// tokenizer.json's "decoder": turns the tokens of ids back into text (Hugging Face's decoders).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/tokenizer/regex.h"
#include "nlohmann/json.hpp"

namespace tandem::tokenizer {

class Decoder {
 public:
  // ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip and Sequence of them; any other type
  // or field is refused with its name.
  static absl::StatusOr<std::unique_ptr<Decoder>> FromJson(const nlohmann::json& json,
                                                           const std::string& where);
  // ByteLevel that returns the bytes as they are (GPT-2's own files: Decode(Encode(x)) == x for
  // any bytes), where Hugging Face's replaces ill-formed UTF-8 with U+FFFD.
  static std::unique_ptr<Decoder> RawByteLevel();

  // The text of `tokens` (token strings in id order); Replace's regexes spend a budget for the
  // tokens' length, and their errors (regex.h) come back.
  absl::StatusOr<std::string> Decode(std::vector<std::string> tokens) const;

 private:
  enum class Kind { kByteLevel, kRawByteLevel, kMetaspace, kReplace, kByteFallback, kFuse, kStrip };
  struct Step {
    Kind kind;
    std::string text;                        // kMetaspace replacement, kReplace content, kStrip char
    std::shared_ptr<const Pattern> pattern;  // kReplace
    bool prepend = true;                     // kMetaspace: prepend_scheme is not "never"
    size_t start = 0, stop = 0;              // kStrip
  };
  static absl::Status Parse(const nlohmann::json& json, const std::string& where,
                            std::vector<Step>& steps);
  std::vector<Step> steps_;
};

}  // namespace tandem::tokenizer
