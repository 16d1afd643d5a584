// The CPU engine against Hugging Face transformers' outputs for the same checkpoint (a fixture
// made by hf_reference.py): last-position logits after the prompt and after 31 greedy steps, and
// the 32 greedy tokens, for four prompts of different lengths run as one batch.
#include <cmath>
#include <cstdlib>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "worker/cpu/cpu_stage.h"

namespace tandem {
namespace {

// max |a - b| / max |b|: the error relative to the size of the reference logits.
double RelativeError(const float* a, const std::vector<double>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return diff / scale;
}

TEST(ReferenceTest, CpuEngineMatchesHuggingFace) {
  const char* fixture_path = std::getenv("TANDEM_REFERENCE_FIXTURE");
  const char* model_dir = std::getenv("TANDEM_REFERENCE_MODEL");
  if (!fixture_path || !model_dir) GTEST_SKIP() << "run by check_reference.sh";
  nlohmann::json fixture = nlohmann::json::parse(std::ifstream(fixture_path));
  const auto& results = fixture["results"];
  const int steps = fixture["steps"];
  const int n = static_cast<int>(results.size());

  StageSpec spec;
  spec.model_dir = model_dir;
  spec.max_slots = n;
  auto stage = MakeCpuStage(spec);
  ASSERT_TRUE(stage.ok()) << stage.status();
  const int vocab = (*stage)->config().vocab_size;

  // Prefill: every prompt in one step, each in its own slot.
  StepDescriptor step;
  step.return_logits = true;
  for (int i = 0; i < n; ++i) {
    const std::vector<int32_t> prompt = results[i]["prompt"];
    SequenceStep seq;
    seq.slot = i;
    seq.num_tokens = static_cast<int>(prompt.size());
    step.seqs.push_back(seq);
    step.tokens.insert(step.tokens.end(), prompt.begin(), prompt.end());
  }
  std::vector<std::vector<int32_t>> generated(n);
  double worst = 0;
  for (int s = 0; s < steps; ++s) {
    auto out = (*stage)->Step(step, Activations{});
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->tokens.size(), static_cast<size_t>(n));
    ASSERT_EQ(out->logits.size(), static_cast<size_t>(n) * vocab);
    for (int i = 0; i < n; ++i) {
      generated[i].push_back(out->tokens[i]);
      const char* key = s == 0 ? "prefill_logits" : s == steps - 1 ? "final_logits" : nullptr;
      if (key) {
        const std::vector<double> want = results[i][key];
        ASSERT_EQ(want.size(), static_cast<size_t>(vocab));
        const double err = RelativeError(out->logits.data() + static_cast<size_t>(i) * vocab, want);
        worst = std::max(worst, err);
        EXPECT_LE(err, 1e-4) << "prompt " << i << " " << key;
      }
    }
    // Next step: each sequence decodes its newest token.
    StepDescriptor next;
    next.id = s + 1;
    next.return_logits = true;
    for (int i = 0; i < n; ++i) {
      const int len = static_cast<int>(results[i]["prompt"].size());
      SequenceStep seq;
      seq.slot = i;
      seq.position = len + s;
      next.seqs.push_back(seq);
      next.tokens.push_back(out->tokens[i]);
    }
    step = std::move(next);
  }
  for (int i = 0; i < n; ++i) {
    const std::vector<int32_t> want = results[i]["greedy"];
    EXPECT_EQ(generated[i], want) << "prompt " << i;
  }
  std::cout << fixture["model"] << ": worst relative logits error " << worst << ", " << n
            << " prompts x " << steps << " greedy tokens identical\n";
}

}  // namespace
}  // namespace tandem
