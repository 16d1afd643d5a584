// What the fuzz targets share: an input as a file (readers that take a path read it from memory,
// not from disk), an input as a protobuf message, and the byte-level BPE tokenizer that generated
// checkpoints come with.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

#include "common/tokenizer.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/message.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/text_format.h"
#include "tools/byte_level_bpe.h"

namespace tandem::fuzz {

// A file in memory (memfd) holding `bytes`, open as long as the object lives; path() names it for
// readers that open files themselves.
class MemoryFile {
 public:
  explicit MemoryFile(std::string_view bytes) : fd_(memfd_create("fuzz-input", MFD_CLOEXEC)) {
    if (fd_ < 0) std::abort();
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = write(fd_, bytes.data() + done, bytes.size() - done);
      if (n <= 0) std::abort();
      done += static_cast<size_t>(n);
    }
  }
  ~MemoryFile() { close(fd_); }
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;
  std::filesystem::path path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_;
};

// Reads `bytes` into `message` as protobuf's text format (what the committed seeds are written
// in), or else as its binary wire format; false when neither parses. Parse errors are not logged.
inline bool ParseTextOrBinary(std::string_view bytes, google::protobuf::Message& message) {
  class Quiet : public google::protobuf::io::ErrorCollector {
    void AddError(int, int, const std::string&) override {}
  } quiet;
  google::protobuf::LogSilencer silence;  // the wire format logs strings that are not UTF-8
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&quiet);
  const std::string text(bytes);
  return parser.ParseFromString(text, &message) || message.ParseFromString(text);
}

// The tokenizer.json of a byte-level BPE of 400 tokens learned from the generator's corpus, with
// <|endoftext|> as its special token (id 400).
inline std::string GeneratedTokenizerJson() {
  const BpeVocab vocab = TrainByteLevelBpe(TokenizerCorpus(), 400);
  return TokenizerJson(vocab, "<|endoftext|>", static_cast<int>(vocab.tokens.size()));
}

// That tokenizer, loaded once; aborts if it does not load (the fuzz target cannot run without it).
inline const Tokenizer& GeneratedTokenizer() {
  static const Tokenizer* const tokenizer = [] {
    MemoryFile file(GeneratedTokenizerJson());
    auto loaded = Tokenizer::FromTokenizerJson(file.path());
    if (!loaded.ok()) std::abort();
    return loaded->release();
  }();
  return *tokenizer;
}

}  // namespace tandem::fuzz
