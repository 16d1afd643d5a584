// tokenizer.json's "post_processor": the special tokens wrapped around one encoded text when
// special tokens are asked for (Hugging Face's post-processors, single sequences only).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::tokenizer {

struct PostProcessor {
  std::vector<int32_t> prefix;  // ids before the text's ids
  std::vector<int32_t> suffix;  // ids after them

  // TemplateProcessing, ByteLevel, RobertaProcessing, BertProcessing and Sequence of them; any
  // other type or field is refused with its name.
  static absl::StatusOr<PostProcessor> FromJson(const nlohmann::json& json,
                                                const std::string& where);
};

}  // namespace tandem::tokenizer
