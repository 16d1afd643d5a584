// tokenizer.json's "pre_tokenizer": splits normalized text into the pieces the model encodes one
// by one (Hugging Face's pre-tokenizers, without offsets).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/tokenizer/regex.h"
#include "nlohmann/json.hpp"

namespace tandem::tokenizer {

// One piece of text on its way to the model.
struct Piece {
  std::string text;
  // The piece begins where the input text begins (Hugging Face: offsets_original().0 == 0);
  // Metaspace's prepend_scheme "first" prepends only there.
  bool at_start = false;
};

// What a split does with the matched parts (Hugging Face's SplitDelimiterBehavior).
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

class PreTokenizer {
 public:
  // ByteLevel, Split, Metaspace, Digits, Whitespace, WhitespaceSplit, Punctuation and Sequence of
  // them; any other type or field value is refused with its name.
  static absl::StatusOr<std::unique_ptr<PreTokenizer>> FromJson(const nlohmann::json& json,
                                                                 const std::string& where);
  // GPT-2's own pre-tokenization for vocab.json + merges.txt: GPT-2's pattern with JavaScript's
  // \s (as GPT-2's JavaScript encoder), then the byte alphabet; bytes that are not UTF-8 pass.
  static std::unique_ptr<PreTokenizer> Gpt2JavaScript();

  // Splits every piece in turn; empty pieces are dropped.
  // Split's and ByteLevel's regexes spend `budget`; their errors (regex.h) come back, `pieces`
  // then unspecified.
  absl::Status Apply(std::vector<Piece>& pieces, RegexBudget& budget) const;

 private:
  enum class Kind {
    kByteLevel,
    kSplit,
    kMetaspace,
    kDigits,
    kWhitespace,
    kWhitespaceSplit,
    kPunctuation,
    kGpt2JavaScript
  };
  struct Step {
    Kind kind;
    std::shared_ptr<const Pattern> pattern;  // kSplit, kWhitespace, kByteLevel with its regex
    SplitBehavior behavior = SplitBehavior::kIsolated;
    bool invert = false;            // kSplit
    bool add_prefix_space = false;  // kByteLevel
    std::string replacement;        // kMetaspace: one character
    enum class Prepend { kAlways, kNever, kFirst } prepend = Prepend::kAlways;  // kMetaspace
    bool split = true;              // kMetaspace
    bool individual_digits = false;  // kDigits
  };
  static absl::Status Parse(const nlohmann::json& json, const std::string& where,
                            std::vector<Step>& steps);
  absl::Status ApplyStep(const Step& step, std::vector<Piece>& pieces, RegexBudget& budget) const;
  std::vector<Step> steps_;
};

// Cuts `piece` at `spans` (which tile its text) as `behavior` says and appends the non-empty
// parts to `out`.
void SplitPiece(const Piece& piece, const std::vector<MatchSpan>& spans, SplitBehavior behavior,
                std::vector<Piece>& out);

}  // namespace tandem::tokenizer
