// SentencePiece's processor behind plain standard-library types. Its header declares its own
// absl::string_view, which clashes with Abseil's, so only sentencepiece_model.cc includes it and
// that file includes nothing of Abseil.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::tokenizer {

class SentencePieceModel {
 public:
  // nullptr and `error` set when `path` is not a SentencePiece model.
  static std::unique_ptr<SentencePieceModel> Load(const std::string& path, std::string& error);
  ~SentencePieceModel();

  std::vector<int> Encode(std::string_view text) const;
  // false and `error` set when SentencePiece refuses.
  bool Decode(const std::vector<int>& ids, std::string& text, std::string& error) const;
  int PieceToId(std::string_view piece) const;
  std::string IdToPiece(int id) const;
  bool IsControl(int id) const;
  int size() const;
  int bos_id() const;
  int eos_id() const;
  int unk_id() const;

 private:
  struct Impl;
  SentencePieceModel();
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::tokenizer
