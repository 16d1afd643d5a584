// Constrained decoding's costs on a real vocabulary: a schema's compile time and the time of one
// step's token mask along a generation that follows the schema (the first allowed token of each
// mask, preferring multi-byte tokens so that the walk passes through strings, numbers and keys).
//   tandem-structured-mask-bench <tokenizer.json or model folder> [steps]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "common/structured/grammar_cache.h"
#include "common/structured/token_mask.h"
#include "common/tokenizer.h"

namespace {

constexpr char kSchema[] = R"({"type":"object","properties":{
  "name":{"type":"string","maxLength":40},
  "age":{"type":"integer"},
  "tags":{"type":"array","items":{"type":"string"},"maxItems":4},
  "address":{"type":"object","properties":{"city":{"type":"string"},"zip":{"type":"string","pattern":"^[0-9]{5}$"}},"required":["city"]},
  "kind":{"enum":["person","robot","other"]},
  "score":{"type":"number"}},
  "required":["name","age","tags","kind"]})";

double Ms(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <tokenizer.json or model folder> [steps]\n", argv[0]);
    return 2;
  }
  const std::filesystem::path path = argv[1];
  const int steps = argc > 2 ? std::atoi(argv[2]) : 64;
  auto tokenizer = std::filesystem::is_directory(path) ? tandem::Tokenizer::FromDir(path)
                                                       : tandem::Tokenizer::FromTokenizerJson(path);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "%s\n", std::string(tokenizer.status().message()).c_str());
    return 1;
  }
  auto t0 = std::chrono::steady_clock::now();
  auto vocab = tandem::structured::VocabularyFromTokenizer(**tokenizer, {});
  if (!vocab.ok()) return 1;
  tandem::structured::TokenMasker masker(std::move(*vocab));
  auto t1 = std::chrono::steady_clock::now();
  tandem::structured::Constraint c{tandem::structured::Constraint::kJsonSchema, kSchema, {}};
  auto grammar = tandem::structured::CompileCached(c);
  auto t2 = std::chrono::steady_clock::now();
  if (!grammar.ok()) {
    std::fprintf(stderr, "%s\n", std::string(grammar.status().message()).c_str());
    return 1;
  }
  std::printf("vocabulary: %d tokens, trie built in %.1f ms\n", masker.vocab().size(), Ms(t1 - t0));
  std::printf("schema compile: %.3f ms\n", Ms(t2 - t1));
  // Twice: the first generation walks the trie at each new matcher state; the second, as a later
  // request with the same schema, finds the states' masks kept (token_mask.h).
  for (const char* pass : {"first generation", "second generation"}) {
    tandem::structured::Matcher m(*grammar);
    std::vector<double> times;
    std::string text;
    for (int i = 0; i < steps && !m.Finished(); ++i) {
      auto a = std::chrono::steady_clock::now();
      const tandem::structured::TokenBitmask mask = masker.Mask(m);
      times.push_back(Ms(std::chrono::steady_clock::now() - a));
      // Pick an allowed token deterministically: the longest among a stride of candidates.
      int32_t pick = -1;
      size_t best = 0;
      for (int32_t id = (i * 7919) % masker.vocab().size(), n = 0; n < masker.vocab().size();
           ++n, id = (id + 1) % masker.vocab().size()) {
        if (!tandem::structured::Allowed(mask, id) || masker.vocab().special[id]) continue;
        const size_t len = masker.vocab().token_bytes[id].size();
        if (pick < 0 || (len > best && len <= 4)) {
          pick = id;
          best = len;
        }
        if (n > 4096 && pick >= 0) break;
      }
      if (pick < 0) break;
      masker.Accept(m, pick);
      text += masker.vocab().token_bytes[pick];
    }
    std::sort(times.begin(), times.end());
    double sum = 0;
    for (double t : times) sum += t;
    if (!times.empty()) {
      std::printf("%s: mask per step over %zu steps: mean %.3f ms, median %.3f ms, max %.3f ms\n",
                  pass, times.size(), sum / times.size(), times[times.size() / 2], times.back());
    }
    if (pass[0] == 'f') std::printf("text: %s\n", text.c_str());
  }
  std::printf("trie walks: %lld\n", static_cast<long long>(masker.walks()));
  return 0;
}
