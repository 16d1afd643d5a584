// What a tokenizer implementation offers tandem::Tokenizer: Hugging Face's tokenizer.json
// pipeline (hf_tokenizer.h) or SentencePiece's own encoder (sentencepiece_tokenizer.h).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::tokenizer {

class Backend {
 public:
  virtual ~Backend() = default;
  // INVALID_ARGUMENT when the tokenizer cannot encode `text` (a regex past its budget, regex.h).
  virtual absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                                      bool add_special_tokens) const = 0;
  virtual absl::StatusOr<std::string> Decode(std::span<const int32_t> ids,
                                             bool skip_special_tokens) const = 0;
  virtual std::optional<int32_t> TokenToId(std::string_view token) const = 0;
  virtual std::optional<std::string> IdToToken(int32_t id) const = 0;
  // Highest id + 1.
  virtual int vocab_size() const = 0;
};

}  // namespace tandem::tokenizer
