// Compares our tokenizer, loaded from GPT-2's encoder.json + vocab.bpe, with the ids GPT-2's
// JavaScript encoder produced for every corpus line and for blocks of lines (written by
// tokenizer_gpt2_expected.js), and checks Decode(Encode(x)) == x for each and for random bytes.
// Run by tokenizer_gpt2_test.sh; exit status 0 when everything matches, 1 otherwise.
// Usage: tokenizer_gpt2_compare <encoder.json> <vocab.bpe> <corpus.txt> <expected.json>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

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

// The expected ids; a null (the JavaScript encoder's undefined) becomes -1 so it never matches.
std::vector<int32_t> ToIds(const nlohmann::json& j) {
  std::vector<int32_t> ids;
  for (const auto& v : j) ids.push_back(v.is_number_integer() ? v.get<int32_t>() : -1);
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s <encoder.json> <vocab.bpe> <corpus.txt> <expected.json>\n",
                 argv[0]);
    return 2;
  }
  auto tok = tandem::Tokenizer::FromVocabAndMerges(argv[1], argv[2]);
  if (!tok.ok()) {
    std::fprintf(stderr, "loading GPT-2's files failed: %s\n", tok.status().ToString().c_str());
    return 1;
  }
  const std::string corpus = ReadAll(argv[3]);
  nlohmann::json expected;
  try {
    expected = nlohmann::json::parse(ReadAll(argv[4]));
  } catch (const nlohmann::json::exception& e) {
    std::fprintf(stderr, "%s: %s\n", argv[4], e.what());
    return 1;
  }

  // The same lines the script encoded: split on '\n', no final empty line.
  std::vector<std::string> lines;
  for (size_t begin = 0; begin < corpus.size();) {
    size_t end = corpus.find('\n', begin);
    if (end == std::string::npos) end = corpus.size();
    lines.push_back(corpus.substr(begin, end - begin));
    begin = end + 1;
  }
  if (lines.size() != expected["lines"].size()) {
    std::fprintf(stderr, "corpus has %zu lines but %s has %zu\n", lines.size(), argv[4],
                 expected["lines"].size());
    return 1;
  }

  int failures = 0;
  auto check = [&](const std::string& what, const std::string& text,
                   const std::vector<int32_t>& want) {
    const std::vector<int32_t> got = (*tok)->Encode(text).value();
    auto decoded = (*tok)->Decode(got);
    const bool ids_ok = got == want;
    const bool round_trip_ok = decoded.ok() && *decoded == text;
    if (ids_ok && round_trip_ok) return;
    if (++failures <= 20) {
      std::fprintf(
          stderr, "%s differs: %s\n  text:      %s\n  gpt-3-encoder: %s\n  ours:      %s\n",
          what.c_str(), ids_ok ? "round trip" : "ids", text.substr(0, 300).c_str(),
          IdsToString(want).substr(0, 600).c_str(), IdsToString(got).substr(0, 600).c_str());
    }
  };
  for (size_t i = 0; i < lines.size(); ++i) {
    check("line " + std::to_string(i + 1), lines[i], ToIds(expected["lines"][i]));
  }
  // Blocks of consecutive lines, each line with its "\n", as the script made them.
  const size_t block_lines = expected.value("block_lines", size_t{0});
  const size_t n_blocks = block_lines == 0 ? 0 : (lines.size() + block_lines - 1) / block_lines;
  if (block_lines == 0 || expected["blocks"].size() != n_blocks) {
    std::fprintf(stderr, "%s: expected %zu blocks of %zu lines\n", argv[4], n_blocks, block_lines);
    return 1;
  }
  for (size_t b = 0; b < n_blocks; ++b) {
    std::string text;
    for (size_t i = b * block_lines; i < std::min(lines.size(), (b + 1) * block_lines); ++i) {
      text += lines[i] + "\n";
    }
    check("block of lines " + std::to_string(b * block_lines + 1) + "..", text,
          ToIds(expected["blocks"][b]));
  }

  // Byte strings that are mostly not UTF-8 (the JavaScript encoder cannot take them): round trip
  // only.
  uint32_t state = 2024;
  int round_trip_failures = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::string text(trial % 200, '\0');
    for (char& c : text) {
      state = state * 1664525u + 1013904223u;
      c = static_cast<char>(state >> 24);
    }
    auto decoded = (*tok)->Decode((*tok)->Encode(text).value());
    if (!decoded.ok() || *decoded != text) ++round_trip_failures;
  }
  if (round_trip_failures > 0) {
    std::fprintf(stderr, "%d random byte strings did not round trip\n", round_trip_failures);
    failures += round_trip_failures;
  }

  // Not a pass/fail criterion: how long ~1 MB of this text takes a freshly loaded tokenizer
  // (empty per-word cache).
  std::string mb;
  while (mb.size() < (1u << 20)) mb += corpus;
  auto fresh = tandem::Tokenizer::FromVocabAndMerges(argv[1], argv[2]);
  if (!fresh.ok()) return 1;
  const auto start = std::chrono::steady_clock::now();
  const size_t n_tokens = (*fresh)->Encode(mb).value().size();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::printf(
      "compared %zu lines and %zu blocks of %zu lines (%zu bytes) with gpt-3-encoder %s, and "
      "round-tripped 2000 random byte strings: %d differ\n",
      lines.size(), n_blocks, block_lines, corpus.size(),
      expected.value("package_version", "?").c_str(), failures);
  std::printf("encoded %zu bytes into %zu tokens in %.3f s\n", mb.size(), n_tokens, seconds);
  return failures == 0 ? 0 : 1;
}
