// SentencePiece's processor behind plain standard-library types, in a shared library of its own
// (libtandem_sentencepiece) that is opened at run time only when a folder has tokenizer.model.
// Why apart: Debian's libsentencepiece carries its own copy of protobuf and exports it, so a
// process that links both it and protobuf (every gRPC program) crashes while starting; opened
// with RTLD_LOCAL | RTLD_DEEPBIND its copy stays its own. Its header also declares an
// absl::string_view that clashes with Abseil's, so only sentencepiece_model.cc includes it.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::tokenizer {

class SentencePieceModel {
 public:
  // nullptr and `error` set when the library cannot be opened or `path` is not a model.
  static std::unique_ptr<SentencePieceModel> Load(const std::string& path, std::string& error);
  virtual ~SentencePieceModel() = default;

  virtual std::vector<int> Encode(std::string_view text) const = 0;
  // false and `error` set when SentencePiece refuses.
  virtual bool Decode(const std::vector<int>& ids, std::string& text, std::string& error) const = 0;
  virtual int PieceToId(std::string_view piece) const = 0;
  virtual std::string IdToPiece(int id) const = 0;
  virtual bool IsControl(int id) const = 0;
  virtual int size() const = 0;
  virtual int bos_id() const = 0;
  virtual int eos_id() const = 0;
  virtual int unk_id() const = 0;
};

}  // namespace tandem::tokenizer

// The shared library's one entry point: a new model for `path`, or nullptr with `error` set.
extern "C" tandem::tokenizer::SentencePieceModel* TandemLoadSentencePiece(const std::string* path,
                                                                           std::string* error);
