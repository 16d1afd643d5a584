// Byte-level BPE tokenizer (GPT-2's scheme): reads Hugging Face tokenizer.json or GPT-2's
// vocab.json (encoder.json) + merges.txt (vocab.bpe).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem {

class Tokenizer {
 public:
  // A tokenizer.json whose model is BPE over GPT-2's byte-to-unicode alphabet.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromTokenizerJson(
      const std::filesystem::path& path);
  // GPT-2's own files: vocab.json / encoder.json (token -> id) and merges.txt / vocab.bpe.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromVocabAndMerges(
      const std::filesystem::path& vocab_json, const std::filesystem::path& merges_txt);
  // tokenizer.json in `dir`, else vocab.json + merges.txt there.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromDir(const std::filesystem::path& dir);

  ~Tokenizer();
  std::vector<int32_t> Encode(std::string_view text) const;
  // INVALID_ARGUMENT naming the id when an id is outside the vocabulary.
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids) const;
  int vocab_size() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem
