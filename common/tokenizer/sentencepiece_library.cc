// Opens libtandem_sentencepiece at run time (see sentencepiece_model.h).
#include <dlfcn.h>

#include "common/tokenizer/sentencepiece_model.h"

namespace tandem::tokenizer {

std::unique_ptr<SentencePieceModel> SentencePieceModel::Load(const std::string& path,
                                                             std::string& error) {
  using LoadFn = SentencePieceModel* (*)(const std::string*, std::string*);
  // Opened once for the process and never closed (models made by it live until exit).
  static void* const library = dlopen(TANDEM_SENTENCEPIECE_LIBRARY,
                                      RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
  if (library == nullptr) {
    const char* why = dlerror();
    error = std::string("cannot open ") + TANDEM_SENTENCEPIECE_LIBRARY + ": " +
            (why != nullptr ? why : "unknown error");
    return nullptr;
  }
  auto load = reinterpret_cast<LoadFn>(dlsym(library, "TandemLoadSentencePiece"));
  if (load == nullptr) {
    error = std::string(TANDEM_SENTENCEPIECE_LIBRARY) + " has no TandemLoadSentencePiece";
    return nullptr;
  }
  return std::unique_ptr<SentencePieceModel>(load(&path, &error));
}

}  // namespace tandem::tokenizer
