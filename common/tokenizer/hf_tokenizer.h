// Hugging Face's tokenizer pipeline: added tokens, normalizer, pre-tokenizer, BPE model,
// post-processor and decoder, read from tokenizer.json (or GPT-2's vocab.json + merges.txt).
#pragma once

#include <filesystem>
#include <memory>

#include "absl/status/statusor.h"
#include "common/tokenizer/backend.h"

namespace tandem::tokenizer {

absl::StatusOr<std::unique_ptr<Backend>> LoadTokenizerJson(const std::filesystem::path& path);
absl::StatusOr<std::unique_ptr<Backend>> LoadVocabAndMerges(const std::filesystem::path& vocab_json,
                                                            const std::filesystem::path& merges_txt);

}  // namespace tandem::tokenizer
