// tandem::Tokenizer: picks the implementation for a folder's files and forwards to it.
#include "common/tokenizer.h"

#include <fstream>
#include <sstream>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/bounded_json.h"
#include "common/status_macros.h"
#include "common/tokenizer/backend.h"
#include "common/tokenizer/hf_tokenizer.h"
#include "common/tokenizer/sentencepiece_tokenizer.h"
#include "nlohmann/json.hpp"

namespace tandem {

Tokenizer::Tokenizer(std::unique_ptr<tokenizer::Backend> backend) : backend_(std::move(backend)) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromTokenizerJson(
    const std::filesystem::path& path) {
  ASSIGN_OR_RETURN(std::unique_ptr<tokenizer::Backend> backend, tokenizer::LoadTokenizerJson(path));
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(backend)));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromVocabAndMerges(
    const std::filesystem::path& vocab_json, const std::filesystem::path& merges_txt) {
  ASSIGN_OR_RETURN(std::unique_ptr<tokenizer::Backend> backend,
                   tokenizer::LoadVocabAndMerges(vocab_json, merges_txt));
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(backend)));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromSentencePiece(
    const std::filesystem::path& model, bool add_bos, bool add_eos) {
  ASSIGN_OR_RETURN(std::unique_ptr<tokenizer::Backend> backend,
                   tokenizer::LoadSentencePiece(model, add_bos, add_eos));
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(backend)));
}

namespace {

// tokenizer_config.json's add_bos_token / add_eos_token for a SentencePiece folder; absent keys
// keep Hugging Face's LlamaTokenizer defaults (true / false).
absl::Status ReadSentencePieceFlags(const std::filesystem::path& dir, bool& add_bos,
                                    bool& add_eos) {
  const std::filesystem::path path = dir / "tokenizer_config.json";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return absl::OkStatus();
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  ASSIGN_OR_RETURN(nlohmann::json config, ParseBoundedJson(text.str(), path.string()));
  for (auto [key, flag] : {std::pair{"add_bos_token", &add_bos}, {"add_eos_token", &add_eos}}) {
    if (!config.is_object() || !config.contains(key) || config[key].is_null()) continue;
    if (!config[key].is_boolean()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path.string(), ": ", key, " must be true or false"));
    }
    *flag = config[key].get<bool>();
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromDir(const std::filesystem::path& dir) {
  std::error_code ec;
  if (std::filesystem::exists(dir / "tokenizer.json", ec)) {
    return FromTokenizerJson(dir / "tokenizer.json");
  }
  if (std::filesystem::exists(dir / "tokenizer.model", ec)) {
    bool add_bos = true, add_eos = false;
    RETURN_IF_ERROR(ReadSentencePieceFlags(dir, add_bos, add_eos));
    return FromSentencePiece(dir / "tokenizer.model", add_bos, add_eos);
  }
  if (std::filesystem::exists(dir / "vocab.json", ec) &&
      std::filesystem::exists(dir / "merges.txt", ec)) {
    return FromVocabAndMerges(dir / "vocab.json", dir / "merges.txt");
  }
  return absl::NotFoundError(absl::StrCat(
      dir.string(), ": neither tokenizer.json, tokenizer.model nor vocab.json + merges.txt"));
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text,
                                                       bool add_special_tokens) const {
  return backend_->Encode(text, add_special_tokens);
}

absl::StatusOr<std::string> Tokenizer::Decode(std::span<const int32_t> ids,
                                              bool skip_special_tokens) const {
  return backend_->Decode(ids, skip_special_tokens);
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  return backend_->TokenToId(token);
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  return backend_->IdToToken(id);
}

int Tokenizer::vocab_size() const { return backend_->vocab_size(); }

}  // namespace tandem
