// Byte-level BPE training and tokenizer.json output; see byte_level_bpe.h.
#include "tools/byte_level_bpe.h"

#include <array>
#include <cstdint>
#include <map>

#include "common/utf8.h"
#include "nlohmann/json.hpp"

namespace tandem {
namespace {

// GPT-2's order of the 256 bytes: the printable ones ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for
// themselves and come first; the other 68 follow, mapped to U+0100 onwards.
struct ByteAlphabet {
  std::array<unsigned char, 256> order;  // id -> byte
  std::array<std::string, 256> text;     // byte -> UTF-8 of its character
};

const ByteAlphabet& Alphabet() {
  static const ByteAlphabet alphabet = [] {
    ByteAlphabet a;
    std::array<bool, 256> printable{};
    int id = 0;
    for (int b = 0; b < 256; ++b) {
      printable[b] = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      if (printable[b]) {
        a.order[id++] = static_cast<unsigned char>(b);
        AppendUtf8(static_cast<char32_t>(b), a.text[b]);
      }
    }
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      if (!printable[b]) {
        a.order[id++] = static_cast<unsigned char>(b);
        AppendUtf8(next++, a.text[b]);
      }
    }
    return a;
  }();
  return alphabet;
}

bool IsSpace(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
bool IsLetter(unsigned char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80;
}
bool IsDigit(unsigned char c) { return c >= '0' && c <= '9'; }
bool IsOther(unsigned char c) { return !IsSpace(c) && !IsLetter(c) && !IsDigit(c); }

}  // namespace

std::string ByteToUnicode(unsigned char b) { return Alphabet().text[b]; }

std::vector<std::string> PreTokenize(std::string_view text) {
  std::vector<std::string> out;
  const size_t n = text.size();
  auto at = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  size_t i = 0;
  while (i < n) {
    const size_t start = i;
    if (at(i) == '\'') {
      bool matched = false;
      for (std::string_view c : {"s", "t", "re", "ve", "m", "ll", "d"}) {
        if (text.substr(i + 1, c.size()) == c) {
          i += 1 + c.size();
          matched = true;
          break;
        }
      }
      if (matched) {
        out.emplace_back(text.substr(start, i - start));
        continue;
      }
    }
    // " ?X+" for each class X, tried in the regex's order: letters, digits, other symbols.
    const size_t body = (at(i) == ' ' && i + 1 < n) ? i + 1 : i;
    bool (*classes[])(unsigned char) = {IsLetter, IsDigit, IsOther};
    bool matched = false;
    for (auto cls : classes) {
      if (!cls(at(body))) continue;
      i = body;
      while (i < n && cls(at(i))) ++i;
      matched = true;
      break;
    }
    if (!matched) {
      // Whitespace: a run followed by a word leaves its last character to the word.
      while (i < n && IsSpace(at(i))) ++i;
      if (i < n && i - start >= 2) --i;
    }
    out.emplace_back(text.substr(start, i - start));
  }
  return out;
}

BpeVocab TrainByteLevelBpe(std::string_view corpus, int max_tokens) {
  const ByteAlphabet& alphabet = Alphabet();
  BpeVocab vocab;
  std::map<std::string, int> known;
  for (int id = 0; id < 256; ++id) {
    vocab.tokens.push_back(alphabet.text[alphabet.order[id]]);
    known.emplace(vocab.tokens.back(), id);
  }

  // Distinct words (as symbol sequences) with their counts.
  std::map<std::string, int64_t> word_counts;
  for (const std::string& w : PreTokenize(corpus)) ++word_counts[w];
  std::vector<std::vector<std::string>> words;
  std::vector<int64_t> counts;
  for (const auto& [w, count] : word_counts) {
    std::vector<std::string> symbols;
    for (char ch : w) symbols.push_back(alphabet.text[static_cast<unsigned char>(ch)]);
    words.push_back(std::move(symbols));
    counts.push_back(count);
  }

  while (static_cast<int>(vocab.tokens.size()) < max_tokens) {
    std::map<std::pair<std::string, std::string>, int64_t> pairs;
    for (size_t w = 0; w < words.size(); ++w) {
      for (size_t k = 0; k + 1 < words[w].size(); ++k) {
        pairs[{words[w][k], words[w][k + 1]}] += counts[w];
      }
    }
    // std::map iterates in (left, right) byte order, so the first maximum is the smallest pair.
    const std::pair<std::string, std::string>* best = nullptr;
    int64_t best_count = 1;
    for (const auto& [pair, count] : pairs) {
      if (count > best_count) {
        best = &pair;
        best_count = count;
      }
    }
    if (best == nullptr) break;  // no pair occurs twice
    const auto [left, right] = *best;
    const std::string merged = left + right;
    vocab.merges.emplace_back(left, right);
    if (known.emplace(merged, static_cast<int>(vocab.tokens.size())).second) {
      vocab.tokens.push_back(merged);
    }
    for (std::vector<std::string>& symbols : words) {
      std::vector<std::string> next;
      next.reserve(symbols.size());
      for (size_t k = 0; k < symbols.size(); ++k) {
        if (k + 1 < symbols.size() && symbols[k] == left && symbols[k + 1] == right) {
          next.push_back(merged);
          ++k;
        } else {
          next.push_back(std::move(symbols[k]));
        }
      }
      symbols = std::move(next);
    }
  }
  return vocab;
}

std::string TokenizerJson(const BpeVocab& vocab, const std::string& special, int special_id) {
  using json = nlohmann::ordered_json;
  json byte_level = {{"type", "ByteLevel"},
                     {"add_prefix_space", false},
                     {"trim_offsets", true},
                     {"use_regex", true}};
  json model_vocab = json::object();
  for (size_t id = 0; id < vocab.tokens.size(); ++id) {
    model_vocab[vocab.tokens[id]] = static_cast<int>(id);
  }
  // GPT-2's own tokenizer.json also lists <|endoftext|> in the model's vocabulary, so that HF
  // tokenizers gives the added token the same id.
  model_vocab[special] = special_id;
  json merges = json::array();
  for (const auto& [l, r] : vocab.merges) merges.push_back(l + " " + r);

  json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = json::array({{{"id", special_id},
                                    {"content", special},
                                    {"single_word", false},
                                    {"lstrip", false},
                                    {"rstrip", false},
                                    {"normalized", true},
                                    {"special", true}}});
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = byte_level;
  j["post_processor"] = byte_level;
  j["decoder"] = byte_level;
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", ""},
                {"end_of_word_suffix", ""},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"vocab", model_vocab},
                {"merges", merges}};
  return j.dump(2) + "\n";
}

}  // namespace tandem
