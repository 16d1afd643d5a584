// libtandem_sentencepiece: SentencePieceModel over sentencepiece::SentencePieceProcessor (see
// common/tokenizer/sentencepiece_model.h for why this is a library of its own).
#include <sentencepiece_processor.h>

#include "common/tokenizer/sentencepiece_model.h"

namespace tandem::tokenizer {
namespace {

class Processor : public SentencePieceModel {
 public:
  sentencepiece::SentencePieceProcessor sp;

  std::vector<int> Encode(std::string_view text) const override {
    std::vector<int> ids;
    if (!sp.Encode(text, &ids).ok()) ids.clear();
    return ids;
  }
  bool Decode(const std::vector<int>& ids, std::string& text, std::string& error) const override {
    if (const auto status = sp.Decode(ids, &text); !status.ok()) {
      error = status.ToString();
      return false;
    }
    return true;
  }
  int PieceToId(std::string_view piece) const override { return sp.PieceToId(piece); }
  std::string IdToPiece(int id) const override { return sp.IdToPiece(id); }
  bool IsControl(int id) const override { return sp.IsControl(id); }
  int size() const override { return sp.GetPieceSize(); }
  int bos_id() const override { return sp.bos_id(); }
  int eos_id() const override { return sp.eos_id(); }
  int unk_id() const override { return sp.unk_id(); }
};

}  // namespace
}  // namespace tandem::tokenizer

extern "C" tandem::tokenizer::SentencePieceModel* TandemLoadSentencePiece(const std::string* path,
                                                                           std::string* error) {
  auto p = std::make_unique<tandem::tokenizer::Processor>();
  if (const auto status = p->sp.Load(*path); !status.ok()) {
    *error = status.ToString();
    return nullptr;
  }
  return p.release();
}
