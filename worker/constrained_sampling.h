// Constrained decoding on the last stage: each constrained sequence's grammar matcher lives here,
// keyed by its KV slot, and is advanced by the tokens this stage samples. The coordinator sends a
// one-stage pipeline's next step before the token that feeds it is known
// (worker/service/step_runner.h), so a mask made by the coordinator would lag a step; the stage
// that samples knows each token first. The constraint comes with every sampling row
// (SequenceStep::constraint) and is compiled once per text (common/structured/grammar_cache.h).
//
// Per step: Prepare(step) checks and positions each constrained row's matcher (a new one at
// sample_index 0); Mask(row, logits) sets the tokens the grammar refuses to -inf before the
// sampling rule (worker/sampling.h); Advance(row, token) feeds the sampled token. A matcher only
// exists where its sequence sampled: a constrained sequence that continues on another worker
// (KV move, recompute) is refused with FAILED_PRECONDITION rather than generated unconstrained.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <unordered_map>

#include "absl/status/status.h"
#include "common/step.h"
#include "common/structured/grammar.h"
#include "common/structured/token_mask.h"

namespace tandem {

class ConstrainedSampling {
 public:
  // The vocabulary is read from `model_dir`'s tokenizer files on the first constrained step; a
  // finished grammar ends with `eos_ids` or any EOS id of the folder's text settings
  // (common/text_config.h: generation_config.json's list too), as the coordinator stops at.
  ConstrainedSampling(std::filesystem::path model_dir, std::vector<int32_t> eos_ids);
  // With a vocabulary given (tests).
  explicit ConstrainedSampling(structured::Vocabulary vocab);

  // FAILED_PRECONDITION when a row is constrained and the model has no tokenizer to build the
  // vocabulary from, or when a row's matcher is not at the row's sample_index.
  absl::Status Prepare(const StepDescriptor& step);
  // `logits` (vocab) of a row Prepare accepted; rows without a constraint are left alone.
  void Mask(const SequenceStep& row, std::span<float> logits) const;
  void Advance(const SequenceStep& row, int32_t token);

  // Whether any sampling row of `step` is constrained.
  static bool Constrains(const StepDescriptor& step);
  // The allow-bitmasks of a step's constrained sampled rows, packed for a device that masks its
  // own logits (worker/cuda/constrained_mask.h). `sample_seqs[j]` is the index in step.seqs of
  // the sequence whose logits are row j; each row j whose sequence is constrained is appended to
  // `rows`, and its bits (bit id % 32 of word id / 32, vocabulary ids past the tokenizer's
  // clear) to the next `words` words of `masks`. A grammar that no token continues allows the
  // EOS ids, so that the text ends. `rows` holds sample_seqs.size() entries and `masks` that
  // many times `words`. Returns how many rows it packed.
  int PackMasks(const StepDescriptor& step, std::span<const int> sample_seqs, int words,
                std::span<uint32_t> masks, std::span<int32_t> rows) const;

 private:
  struct SlotMatcher {
    const structured::Constraint* constraint = nullptr;  // the row's, for identity
    std::string key;                                      // the constraint's text
    uint64_t next_index = 0;                              // the sample_index it is at
    std::unique_ptr<structured::Matcher> matcher;
  };
  absl::Status LoadVocabulary();

  std::filesystem::path model_dir_;
  std::vector<int32_t> eos_ids_;
  std::unique_ptr<structured::TokenMasker> masker_;
  std::unordered_map<int32_t, SlotMatcher> slots_;
};

}  // namespace tandem
