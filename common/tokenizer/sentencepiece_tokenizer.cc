// SentencePiece's processor behind the Backend interface. Decode hands the ids to SentencePiece
// (control tokens such as <s> decode to nothing there) after dropping control tokens when special
// tokens are to be skipped; an id outside the model is an error naming it.
#include "common/tokenizer/sentencepiece_tokenizer.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/tokenizer/sentencepiece_model.h"

namespace tandem::tokenizer {
namespace {

class SentencePieceTokenizer : public Backend {
 public:
  std::unique_ptr<SentencePieceModel> sp;
  bool add_bos = true, add_eos = false;

  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              bool add_special_tokens) const override {
    const std::vector<int> ids = sp->Encode(text);
    std::vector<int32_t> out;
    out.reserve(ids.size() + 2);
    if (add_special_tokens && add_bos && sp->bos_id() >= 0) out.push_back(sp->bos_id());
    out.insert(out.end(), ids.begin(), ids.end());
    if (add_special_tokens && add_eos && sp->eos_id() >= 0) out.push_back(sp->eos_id());
    return out;
  }

  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids,
                                     bool skip_special_tokens) const override {
    std::vector<int> kept;
    kept.reserve(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= sp->size()) {
        return absl::InvalidArgumentError(absl::StrCat("token id ", ids[i], " (at position ", i,
                                                       ") is not in the vocabulary of ",
                                                       sp->size(), " ids"));
      }
      if (skip_special_tokens && sp->IsControl(ids[i])) continue;
      kept.push_back(ids[i]);
    }
    std::string text, error;
    if (!sp->Decode(kept, text, error)) {
      return absl::InvalidArgumentError(absl::StrCat("SentencePiece decode: ", error));
    }
    return text;
  }

  std::optional<int32_t> TokenToId(std::string_view token) const override {
    const int id = sp->PieceToId(token);
    // PieceToId answers unk_id for unknown pieces; only the unknown piece itself maps to it.
    if (id == sp->unk_id() && sp->IdToPiece(id) != token) return std::nullopt;
    return id;
  }

  std::optional<std::string> IdToToken(int32_t id) const override {
    if (id < 0 || id >= sp->size()) return std::nullopt;
    return sp->IdToPiece(id);
  }

  int vocab_size() const override { return sp->size(); }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> LoadSentencePiece(const std::filesystem::path& model,
                                                           bool add_bos, bool add_eos) {
  auto tok = std::make_unique<SentencePieceTokenizer>();
  std::string error;
  tok->sp = SentencePieceModel::Load(model.string(), error);
  if (tok->sp == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(model.string(), ": not a SentencePiece model: ", error));
  }
  tok->add_bos = add_bos;
  tok->add_eos = add_eos;
  return std::unique_ptr<Backend>(std::move(tok));
}

}  // namespace tandem::tokenizer
