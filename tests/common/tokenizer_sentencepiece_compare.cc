// Compares our Tokenizer on a folder holding only tokenizer.model with SentencePiece's command
// line tools (written by tokenizer_sentencepiece_test.sh): each corpus line's ids without special
// tokens equal spm_encode's, with special tokens they are BOS + those, and decoding spm_encode's
// ids gives spm_decode's text, also when they are streamed one by one (common/decode_stream.h:
// the whole decode at every id, spm_decode's at the last). Exit status 0 when everything
// matches, 1 otherwise.
// Usage: tokenizer_sentencepiece_compare <model dir> <corpus> <ids.txt> <decoded.txt>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/decode_stream.h"
#include "common/tokenizer.h"

namespace {

std::vector<std::string> Lines(const char* path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string IdsToString(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s <model dir> <corpus> <ids.txt> <decoded.txt>\n", argv[0]);
    return 2;
  }
  auto tok = tandem::Tokenizer::FromDir(argv[1]);
  if (!tok.ok()) {
    std::fprintf(stderr, "loading %s failed: %s\n", argv[1], tok.status().ToString().c_str());
    return 1;
  }
  const std::vector<std::string> corpus = Lines(argv[2]);
  const std::vector<std::string> ids = Lines(argv[3]);
  const std::vector<std::string> decoded = Lines(argv[4]);
  if (corpus.size() != ids.size() || corpus.size() != decoded.size()) {
    std::fprintf(stderr, "%zu corpus lines, %zu id lines, %zu decoded lines\n", corpus.size(),
                 ids.size(), decoded.size());
    return 1;
  }
  const std::optional<int32_t> bos = (*tok)->TokenToId("<s>");
  if (!bos) {
    std::fprintf(stderr, "the model has no <s>\n");
    return 1;
  }
  int failures = 0;
  for (size_t i = 0; i < corpus.size(); ++i) {
    std::vector<int32_t> want;
    std::istringstream in(ids[i]);
    for (int32_t id; in >> id;) want.push_back(id);
    const std::vector<int32_t> got = (*tok)->Encode(corpus[i], false).value();
    std::vector<int32_t> want_special = {*bos};
    want_special.insert(want_special.end(), want.begin(), want.end());
    auto text = (*tok)->Decode(want);
    bool streamed_ok = true;
    tandem::DecodeStream stream([&](std::span<const int32_t> v) { return (*tok)->Decode(v); });
    for (size_t k = 1; k <= want.size() && streamed_ok; ++k) {
      const std::span<const int32_t> prefix(want.data(), k);
      auto streamed = stream.Text(prefix);
      auto whole = k == want.size() ? absl::StatusOr<std::string>(decoded[i])
                                    : (*tok)->Decode(prefix);
      streamed_ok = streamed.ok() && whole.ok() && *streamed == *whole;
      if (!streamed_ok) std::fprintf(stderr, "line %zu: streamed text differs after %zu ids\n", i + 1, k);
    }
    const bool ok = got == want && (*tok)->Encode(corpus[i], true).value() == want_special &&
                    text.ok() && *text == decoded[i] && streamed_ok;
    if (!ok && ++failures <= 20) {
      std::fprintf(stderr, "line %zu differs\n  text: %s\n  spm_encode: %s\n  ours:       %s\n"
                   "  spm_decode: %s\n  ours:       %s\n",
                   i + 1, corpus[i].substr(0, 200).c_str(), ids[i].substr(0, 400).c_str(),
                   IdsToString(got).substr(0, 400).c_str(), decoded[i].substr(0, 200).c_str(),
                   text.ok() ? text->substr(0, 200).c_str() : text.status().ToString().c_str());
    }
  }
  std::printf("%s: %zu lines compared with spm_encode/spm_decode: %d differ\n", argv[1],
              corpus.size(), failures);
  return failures == 0 ? 0 : 1;
}
