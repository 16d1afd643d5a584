// Learns a small byte-level BPE (GPT-2's scheme) from text and writes it as a Hugging Face
// tokenizer.json, so that generated checkpoints come with a tokenizer that both tandem's
// Tokenizer and HF tokenizers read.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tandem {

// GPT-2's bytes_to_unicode: the printable character (as UTF-8) that stands for byte `b`.
std::string ByteToUnicode(unsigned char b);

// GPT-2's pre-tokenization for ASCII text: contractions ('s 't 're 've 'm 'll 'd), an optional
// space followed by letters, by digits, or by other symbols, and runs of whitespace (a run before
// a word leaves its last space to the word). Bytes >= 0x80 count as letters.
std::vector<std::string> PreTokenize(std::string_view text);

struct BpeVocab {
  // id -> token in the byte-to-unicode alphabet; ids 0..255 are the single bytes in GPT-2's order
  // (printable bytes first), then one token per merge that made a new string.
  std::vector<std::string> tokens;
  std::vector<std::pair<std::string, std::string>> merges;  // in priority order
};

// Counts adjacent token pairs over the pre-tokenized words of `corpus` (weighted by how often each
// word occurs), merges the most frequent pair, ties broken by the smallest (left, right) in byte
// order, and repeats until there are `max_tokens` tokens or no pair occurs at least twice.
BpeVocab TrainByteLevelBpe(std::string_view corpus, int max_tokens);

// tokenizer.json (format "1.0"): BPE model, ByteLevel pre-tokenizer (add_prefix_space false) and
// decoder, and `special` ("<|endoftext|>") as an added special token with id `special_id`, which
// must not be an id of `vocab`.
std::string TokenizerJson(const BpeVocab& vocab, const std::string& special, int special_id);

// A few KB of varied English prose that the generated tokenizers are learned from.
std::string_view TokenizerCorpus();

}  // namespace tandem
