// The BPE model of tokenizer.json (and of GPT-2's vocab.json + merges.txt): a vocabulary, a ranked
// list of merges, and the options Hugging Face's BPE has.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::tokenizer {

struct BpeOptions {
  std::optional<std::string> unk_token;  // the token for characters the vocabulary lacks
  bool fuse_unk = false;                 // consecutive unknown characters give one unk token
  bool byte_fallback = false;            // unknown characters become <0xXX> tokens if all exist
  bool ignore_merges = false;            // a piece that is itself a token is that token
  std::string continuing_subword_prefix;  // "" when none
  std::string end_of_word_suffix;         // "" when none
  // GPT-2's encoder.py order: all occurrences of the best-ranked pair merge before any pair they
  // form (instead of Hugging Face's one merge at a time). Only GPT-2's own files use it.
  bool merge_rank_at_once = false;
};

struct VocabEntry {
  std::string text;
  int32_t id;
};

struct MergeEntry {
  std::string left, right;
  std::string where;  // "line 7", "model.merges[5]"
};

// A JSON object of token -> id (tokenizer.json's model.vocab, GPT-2's vocab.json).
absl::StatusOr<std::vector<VocabEntry>> ParseVocabObject(const nlohmann::json& vocab,
                                                         const std::string& file,
                                                         const std::string& field);

class BpeModel {
 public:
  // tokenizer.json's "model" object; `file` names it in errors.
  static absl::StatusOr<std::unique_ptr<BpeModel>> FromJson(const nlohmann::json& model,
                                                            const std::string& file);
  static absl::StatusOr<std::unique_ptr<BpeModel>> Build(const std::string& vocab_file,
                                                         const std::vector<VocabEntry>& vocab,
                                                         const std::string& merges_file,
                                                         const std::vector<MergeEntry>& merges,
                                                         BpeOptions options);

  // Appends the ids of one piece.
  void Tokenize(std::string_view piece, std::vector<int32_t>& out) const;

  std::optional<int32_t> TokenToId(std::string_view token) const;
  // nullptr for an id no token has.
  const std::string* IdToToken(int32_t id) const;
  // Highest id + 1.
  int32_t size() const { return static_cast<int32_t>(id_to_token_.size()); }

 private:
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
  };
  struct PairHash {
    size_t operator()(uint64_t key) const {
      return std::hash<uint64_t>()(key * 0x9E3779B97F4A7C15ull);
    }
  };
  struct MergeResult {
    int32_t rank;
    int32_t merged_id;
  };
  using Vocab = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

  BpeModel() = default;
  std::vector<int32_t> MergeWord(std::string_view word) const;
  const MergeResult* FindMerge(int32_t left, int32_t right) const;

  BpeOptions options_;
  Vocab vocab_;
  std::vector<std::optional<std::string>> id_to_token_;
  std::unordered_map<uint64_t, MergeResult, PairHash> merges_;
  std::optional<int32_t> unk_id_;
  std::array<int32_t, 256> byte_fallback_id_{};  // id of <0xXX>, -1 when absent

  mutable std::shared_mutex cache_mutex_;
  mutable Vocab cache_index_;  // piece -> index into cache_values_
  mutable std::vector<std::vector<int32_t>> cache_values_;
};

}  // namespace tandem::tokenizer
