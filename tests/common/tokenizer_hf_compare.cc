// Compares our tokenizer.json reader with Hugging Face's tokenizers on every corpus line and on
// blocks of lines (as written by tokenizer_hf_expected.js): ids with and without special tokens,
// and the decoded text of the ids with special tokens, keeping and skipping them; and the text of
// the ids with special tokens as a generation streams it (common/decode_stream.h, id by id), which
// must equal the whole decode at every id and the reference's at the last. Our tokenizer
// gets the raw bytes of each line (the reference got them as text, ill-formed bytes replaced).
// Run by tokenizer_hf_test.sh; exit status 0 when everything matches, 1 otherwise.
// Usage: tokenizer_hf_compare <tokenizer.json> <expected.json> <corpus>...
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common/decode_stream.h"
#include "common/tokenizer.h"
#include "nlohmann/json.hpp"

namespace {

std::string ReadAll(const char* path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string IdsToString(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

std::vector<int32_t> ToIds(const nlohmann::json& j) {
  std::vector<int32_t> ids;
  for (const auto& v : j) ids.push_back(v.get<int32_t>());
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s <tokenizer.json> <expected.json> <corpus>...\n", argv[0]);
    return 2;
  }
  auto tok = tandem::Tokenizer::FromTokenizerJson(argv[1]);
  if (!tok.ok()) {
    std::fprintf(stderr, "loading %s failed: %s\n", argv[1], tok.status().ToString().c_str());
    return 1;
  }
  nlohmann::json expected;
  try {
    expected = nlohmann::json::parse(ReadAll(argv[2]));
  } catch (const nlohmann::json::exception& e) {
    std::fprintf(stderr, "%s: %s\n", argv[2], e.what());
    return 1;
  }
  std::vector<std::string> lines;
  for (int f = 3; f < argc; ++f) {
    const std::string corpus = ReadAll(argv[f]);
    for (size_t begin = 0; begin < corpus.size();) {
      size_t end = corpus.find('\n', begin);
      if (end == std::string::npos) end = corpus.size();
      lines.push_back(corpus.substr(begin, end - begin));
      begin = end + 1;
    }
  }
  const size_t block_lines = expected.value("block_lines", size_t{0});
  std::vector<std::string> blocks;
  for (size_t i = 0; block_lines > 0 && i < lines.size(); i += block_lines) {
    std::string text;
    for (size_t j = i; j < std::min(lines.size(), i + block_lines); ++j) text += lines[j] + "\n";
    blocks.push_back(std::move(text));
  }
  if (lines.size() != expected["lines"].size() || blocks.size() != expected["blocks"].size()) {
    std::fprintf(stderr, "corpus has %zu lines and %zu blocks but %s has %zu and %zu\n",
                 lines.size(), blocks.size(), argv[2], expected["lines"].size(),
                 expected["blocks"].size());
    return 1;
  }

  int failures = 0;
  size_t checks = 0;
  auto check = [&](const std::string& what, const std::string& text, const nlohmann::json& want) {
    const std::vector<int32_t> with = (*tok)->Encode(text, true).value();
    const std::vector<int32_t> without = (*tok)->Encode(text, false).value();
    auto kept = (*tok)->Decode(with, false);
    auto skipped = (*tok)->Decode(with, true);
    const std::vector<int32_t> want_with = ToIds(want["a"]);
    const std::vector<int32_t> want_without = ToIds(want["n"]);
    const std::string want_kept = want["d"].get<std::string>();
    const std::string want_skipped = want["s"].get<std::string>();
    checks += 4;
    auto report = [&](const char* aspect, const std::string& theirs, const std::string& ours) {
      if (++failures <= 20) {
        std::fprintf(stderr, "%s: %s differ\n  text:       %s\n  reference:  %s\n  ours:       %s\n",
                     what.c_str(), aspect, text.substr(0, 300).c_str(),
                     theirs.substr(0, 600).c_str(), ours.substr(0, 600).c_str());
      }
    };
    if (with != want_with)
      report("ids with special tokens", IdsToString(want_with), IdsToString(with));
    if (without != want_without) {
      report("ids without special tokens", IdsToString(want_without), IdsToString(without));
    }
    if (!kept.ok() || *kept != want_kept) {
      report("decoded texts", want_kept, kept.ok() ? *kept : kept.status().ToString());
    }
    if (!skipped.ok() || *skipped != want_skipped) {
      report("decoded texts skipping special tokens", want_skipped,
             skipped.ok() ? *skipped : skipped.status().ToString());
    }
    for (bool skip : {false, true}) {
      tandem::DecodeStream stream([&](std::span<const int32_t> ids) {
        return (*tok)->Decode(ids, skip);
      });
      const std::string& want_last = skip ? want_skipped : want_kept;
      ++checks;
      for (size_t k = 1; k <= with.size(); ++k) {
        const std::span<const int32_t> ids(with.data(), k);
        auto streamed = stream.Text(ids);
        auto whole = (*tok)->Decode(ids, skip);
        const std::string got = streamed.ok() ? std::string(*streamed) : streamed.status().ToString();
        const std::string want_k = k == with.size() ? want_last : whole.ok() ? *whole : "?";
        if (got != want_k) {
          report(skip ? "streamed texts skipping special tokens" : "streamed texts",
                 want_k + " (after " + std::to_string(k) + " ids)", got);
          break;
        }
      }
    }
  };
  for (size_t i = 0; i < lines.size(); ++i) {
    check("line " + std::to_string(i + 1), lines[i], expected["lines"][i]);
  }
  for (size_t b = 0; b < blocks.size(); ++b) {
    check("block of lines " + std::to_string(b * block_lines + 1) + "..", blocks[b],
          expected["blocks"][b]);
  }
  std::printf("%s: %zu lines and %zu blocks, %zu comparisons with tokenizers %s: %d differ\n",
              argv[1], lines.size(), blocks.size(), checks,
              expected.value("version", "?").c_str(), failures);
  return failures == 0 ? 0 : 1;
}
