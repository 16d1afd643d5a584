// Forwards to sentencepiece::SentencePieceProcessor (see sentencepiece_model.h for why this file
// stands apart).
#include "common/tokenizer/sentencepiece_model.h"

#include <sentencepiece_processor.h>

namespace tandem::tokenizer {

struct SentencePieceModel::Impl {
  sentencepiece::SentencePieceProcessor sp;
};

SentencePieceModel::SentencePieceModel() : impl_(std::make_unique<Impl>()) {}
SentencePieceModel::~SentencePieceModel() = default;

std::unique_ptr<SentencePieceModel> SentencePieceModel::Load(const std::string& path,
                                                             std::string& error) {
  std::unique_ptr<SentencePieceModel> m(new SentencePieceModel());
  if (const auto status = m->impl_->sp.Load(path); !status.ok()) {
    error = status.ToString();
    return nullptr;
  }
  return m;
}

std::vector<int> SentencePieceModel::Encode(std::string_view text) const {
  std::vector<int> ids;
  if (!impl_->sp.Encode(text, &ids).ok()) ids.clear();
  return ids;
}

bool SentencePieceModel::Decode(const std::vector<int>& ids, std::string& text,
                                std::string& error) const {
  if (const auto status = impl_->sp.Decode(ids, &text); !status.ok()) {
    error = status.ToString();
    return false;
  }
  return true;
}

int SentencePieceModel::PieceToId(std::string_view piece) const { return impl_->sp.PieceToId(piece); }
std::string SentencePieceModel::IdToPiece(int id) const { return impl_->sp.IdToPiece(id); }
bool SentencePieceModel::IsControl(int id) const { return impl_->sp.IsControl(id); }
int SentencePieceModel::size() const { return impl_->sp.GetPieceSize(); }
int SentencePieceModel::bos_id() const { return impl_->sp.bos_id(); }
int SentencePieceModel::eos_id() const { return impl_->sp.eos_id(); }
int SentencePieceModel::unk_id() const { return impl_->sp.unk_id(); }

}  // namespace tandem::tokenizer
