// A model folder's tokenizer, with Hugging Face's semantics: tokenizer.json (BPE with its
// normalizer, pre-tokenizer, added tokens, post-processor and decoder; common/tokenizer/), a
// SentencePiece tokenizer.model, or GPT-2's vocab.json + merges.txt. A tokenizer.json component
// or option that is not implemented is refused at load with an error naming it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem {

namespace tokenizer {
class Backend;
}

class Tokenizer {
 public:
  // Hugging Face's tokenizer.json.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromTokenizerJson(
      const std::filesystem::path& path);
  // GPT-2's own files: vocab.json / encoder.json (token -> id) and merges.txt / vocab.bpe, with
  // GPT-2's encoder's semantics (JavaScript's \s, raw bytes round trip, no added tokens).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromVocabAndMerges(
      const std::filesystem::path& vocab_json, const std::filesystem::path& merges_txt);
  // A SentencePiece model; BOS/EOS added with special tokens as `add_bos`/`add_eos` say.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromSentencePiece(
      const std::filesystem::path& model, bool add_bos = true, bool add_eos = false);
  // tokenizer.json in `dir`, else tokenizer.model (with tokenizer_config.json's add_bos_token /
  // add_eos_token when present), else vocab.json + merges.txt.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromDir(const std::filesystem::path& dir);

  ~Tokenizer();
  // With add_special_tokens the post-processor's tokens (e.g. BOS) are added, as Hugging Face's
  // encode() does by default. Added tokens in the text are matched either way. INVALID_ARGUMENT
  // naming the tokenizer's file, field and pattern when a regex of the tokenizer runs past its
  // budget on this text (common/tokenizer/regex.h), so a hostile prompt cannot hold a core.
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              bool add_special_tokens = true) const;
  // INVALID_ARGUMENT naming the id when an id is outside the vocabulary.
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids,
                                     bool skip_special_tokens = false) const;
  std::optional<int32_t> TokenToId(std::string_view token) const;
  // The token string of `id` (an added token's content), or nullopt.
  std::optional<std::string> IdToToken(int32_t id) const;
  // Highest id + 1 over the model's vocabulary and the added tokens.
  int vocab_size() const;

 private:
  explicit Tokenizer(std::unique_ptr<tokenizer::Backend> backend);
  std::unique_ptr<tokenizer::Backend> backend_;
};

}  // namespace tandem
