// A folder's tokenizer.model encoded by SentencePiece itself (the library, not a re-implementation).
#pragma once

#include <filesystem>
#include <memory>

#include "absl/status/statusor.h"
#include "common/tokenizer/backend.h"

namespace tandem::tokenizer {

// With special tokens asked for, Encode puts the model's BOS first when `add_bos` and its EOS
// last when `add_eos` (Hugging Face's LlamaTokenizer: add_bos_token defaults to true,
// add_eos_token to false).
absl::StatusOr<std::unique_ptr<Backend>> LoadSentencePiece(const std::filesystem::path& model,
                                                           bool add_bos, bool add_eos);

}  // namespace tandem::tokenizer
