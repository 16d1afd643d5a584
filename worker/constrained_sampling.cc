#include "worker/constrained_sampling.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/model_config.h"
#include "common/structured/grammar_cache.h"
#include "common/text_config.h"
#include "common/tokenizer.h"

namespace tandem {
namespace {

std::string KeyOf(const structured::Constraint& c) {
  std::string key = absl::StrCat(static_cast<int>(c.kind), ":", c.text);
  for (const std::string& o : c.options) absl::StrAppend(&key, "\n", o.size(), ":", o);
  return key;
}

}  // namespace

ConstrainedSampling::ConstrainedSampling(std::filesystem::path model_dir,
                                         std::vector<int32_t> eos_ids)
    : model_dir_(std::move(model_dir)), eos_ids_(std::move(eos_ids)) {}

ConstrainedSampling::ConstrainedSampling(structured::Vocabulary vocab)
    : masker_(std::make_unique<structured::TokenMasker>(std::move(vocab))) {}

absl::Status ConstrainedSampling::LoadVocabulary() {
  if (masker_ != nullptr) return absl::OkStatus();
  auto tokenizer = Tokenizer::FromDir(model_dir_);
  if (!tokenizer.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "constraint: this worker has no tokenizer to mask tokens with (", model_dir_.string(),
        ": ", tokenizer.status().message(), "); put the model's tokenizer files next to its "
        "weights, or send the request without response_format/guided fields"));
  }
  // Every EOS id the coordinator stops at (generation_config.json lists more than config.json's
  // one, e.g. Llama-3's end of turn), so that a finished grammar may end with any of them, and a
  // model whose config.json names none still has one.
  ModelConfig model;
  model.eos_token_id = eos_ids_.empty() ? -1 : eos_ids_.front();
  absl::StatusOr<TextConfig> text = LoadTextConfig(model_dir_, model, tokenizer->get());
  if (!text.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("constraint: the end-of-sequence ids: ", text.status().message()));
  }
  for (int32_t id : text->eos_token_ids) {
    if (std::find(eos_ids_.begin(), eos_ids_.end(), id) == eos_ids_.end()) eos_ids_.push_back(id);
  }
  auto vocab = structured::VocabularyFromTokenizer(**tokenizer, eos_ids_);
  if (!vocab.ok()) return vocab.status();
  masker_ = std::make_unique<structured::TokenMasker>(std::move(*vocab));
  return absl::OkStatus();
}

absl::Status ConstrainedSampling::Prepare(const StepDescriptor& step) {
  for (const SequenceStep& row : step.seqs) {
    if (!row.sample || row.constraint == nullptr) continue;
    if (absl::Status s = LoadVocabulary(); !s.ok()) return s;
    SlotMatcher& slot = slots_[row.slot];
    if (row.sample_index == 0) {
      auto grammar = structured::CompileCached(*row.constraint);
      if (!grammar.ok()) return grammar.status();
      slot.constraint = row.constraint.get();
      slot.key = KeyOf(*row.constraint);
      slot.next_index = 0;
      slot.matcher = std::make_unique<structured::Matcher>(*grammar);
      continue;
    }
    if (slot.matcher == nullptr || slot.next_index != row.sample_index ||
        (slot.constraint != row.constraint.get() && slot.key != KeyOf(*row.constraint))) {
      return absl::FailedPreconditionError(absl::StrCat(
          "constraint: the sequence in slot ", row.slot, " continues at token ", row.sample_index,
          " on a worker that did not sample its earlier tokens; a constrained sequence cannot "
          "move between workers"));
    }
  }
  return absl::OkStatus();
}

void ConstrainedSampling::Mask(const SequenceStep& row, std::span<float> logits) const {
  if (row.constraint == nullptr) return;
  const SlotMatcher& slot = slots_.at(row.slot);
  const structured::TokenBitmask mask = masker_->Mask(*slot.matcher);
  bool any = false;
  const int n = std::min<int>(static_cast<int>(logits.size()), masker_->vocab().size());
  for (int id = 0; id < n; ++id) {
    if (structured::Allowed(mask, id)) {
      any = true;
    } else {
      logits[id] = -std::numeric_limits<float>::infinity();
    }
  }
  // Padding rows of the LM head past the tokenizer's vocabulary are never text.
  for (size_t id = n; id < logits.size(); ++id) logits[id] = -std::numeric_limits<float>::infinity();
  // A grammar no token of this vocabulary can continue: end the text rather than emit junk.
  if (!any) {
    for (int32_t eos : masker_->vocab().eos_ids) {
      if (eos < static_cast<int32_t>(logits.size())) logits[eos] = 0.0f;
    }
  }
}

bool ConstrainedSampling::Constrains(const StepDescriptor& step) {
  return std::any_of(step.seqs.begin(), step.seqs.end(), [](const SequenceStep& s) {
    return s.sample && s.constraint != nullptr;
  });
}

int ConstrainedSampling::PackMasks(const StepDescriptor& step, std::span<const int> sample_seqs,
                                   int words, std::span<uint32_t> masks,
                                   std::span<int32_t> rows) const {
  int packed = 0;
  for (int j = 0; j < static_cast<int>(sample_seqs.size()); ++j) {
    const SequenceStep& row = step.seqs[sample_seqs[j]];
    if (!row.sample || row.constraint == nullptr) continue;
    const structured::TokenBitmask mask = masker_->Mask(*slots_.at(row.slot).matcher);
    std::span<uint32_t> out = masks.subspan(static_cast<size_t>(packed) * words, words);
    const size_t n = std::min(mask.size(), out.size());
    std::copy_n(mask.begin(), n, out.begin());
    std::fill(out.begin() + n, out.end(), 0u);
    // The tokenizer's vocabulary may end inside a word: the ids past it are never text.
    const int vocab = masker_->vocab().size();
    if (vocab < words * 32 && (vocab & 31) != 0) out[vocab >> 5] &= (1u << (vocab & 31)) - 1u;
    if (std::all_of(out.begin(), out.end(), [](uint32_t w) { return w == 0; })) {
      for (int32_t eos : masker_->vocab().eos_ids) {
        if (eos >= 0 && eos < words * 32) out[eos >> 5] |= 1u << (eos & 31);
      }
    }
    rows[packed++] = j;
  }
  return packed;
}

void ConstrainedSampling::Advance(const SequenceStep& row, int32_t token) {
  if (row.constraint == nullptr) return;
  SlotMatcher& slot = slots_.at(row.slot);
  masker_->Accept(*slot.matcher, token);  // eos (not text) leaves the matcher where it is
  slot.next_index = row.sample_index + 1;
}

}  // namespace tandem
