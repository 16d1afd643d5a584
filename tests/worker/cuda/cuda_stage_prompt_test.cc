// Prompt logprobs on the CUDA stage against the fp32 CPU stage on the same tiny checkpoints: every
// scored row's next-token logprob and alternatives agree within fp16 rounding, for a step that
// mixes sequences that ask with ones that do not, a prompt cut across two forward passes, and
// prompts longer than one piece of the LM head. Skipped where no GPU is present.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "common/rng.h"
#include "gtest/gtest.h"
#include "tests/worker/cuda/cuda_test_util.h"
#include "tools/model_generator.h"
#include "worker/cpu/cpu_stage.h"
#include "worker/cuda/cuda_stage.h"

namespace tandem {
namespace {

using cuda_test::RelError;
using cuda_test::TmpDir;



// A preset with `vocab` ids, written aside and renamed into place (tests may run at once).
std::filesystem::path Checkpoint(const std::string& preset, int vocab) {
  const std::filesystem::path dir =
      TmpDir() / ("cuda_prompt_" + preset + "_" + std::to_string(vocab));
  if (!std::filesystem::exists(dir / "config.json")) {
    auto c = PresetConfig(preset);
    EXPECT_TRUE(c.ok()) << c.status();
    c->vocab_size = vocab;
    c->bos_token_id = c->eos_token_id = vocab - 1;
    const std::filesystem::path tmp = TmpDir() / ("cuda_prompt.tmp" + std::to_string(getpid()));
    std::filesystem::remove_all(tmp);
    EXPECT_TRUE(WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 11}, tmp).ok());
    std::error_code ec;
    std::filesystem::rename(tmp, dir, ec);
    if (ec) std::filesystem::remove_all(tmp);
  }
  return dir;
}

// One prefill step: sequence i in slot i with prompt_lengths[i] tokens; sequences 1 and 3 ask for
// prompt logprobs (3 asks for 4 alternatives and samples; 1 asks for none and scores its last row
// against next_prompt_token instead of sampling), the others ask for nothing.
StepDescriptor PromptStep(const std::vector<int>& prompt_lengths, int vocab) {
  StepDescriptor d;
  d.id = 1;
  for (int i = 0; i < static_cast<int>(prompt_lengths.size()); ++i) {
    SequenceStep s;
    s.slot = i;
    s.num_tokens = prompt_lengths[i];
    if (i == 1) {
      s.prompt_logprobs = 0;
      s.sample = false;
      s.next_prompt_token = 17;
    } else if (i == 3) {
      s.prompt_logprobs = 4;
    }
    d.seqs.push_back(s);
    for (int t = 0; t < s.num_tokens; ++t) {
      d.tokens.push_back(static_cast<int32_t>(RandomBits(60 + i, t) % vocab));
    }
  }
  return d;
}

void ExpectSameLogprobs(const std::string& preset, int vocab,
                        const std::vector<int>& prompt_lengths) {
  StageSpec spec;
  spec.model_dir = Checkpoint(preset, vocab);
  spec.max_slots = 6;
  spec.max_seq_len = 256;
  auto cpu = MakeCpuStage(spec);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  CudaOptions o;
  o.dtype = DType::kF16;
  auto cuda = MakeCudaStage(spec, o);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  const StepDescriptor d = PromptStep(prompt_lengths, vocab);
  auto want = (*cpu)->Step(d, Activations{});
  ASSERT_TRUE(want.ok()) << want.status();
  auto got = (*cuda)->Step(d, Activations{});
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->logprobs.size(), 2u);
  ASSERT_EQ(want->logprobs.size(), 2u);
  for (int e = 0; e < 2; ++e) {
    const SequenceLogprobs& g = got->logprobs[e];
    const SequenceLogprobs& c = want->logprobs[e];
    ASSERT_EQ(g.seq, c.seq);
    EXPECT_FALSE(g.has_sampled);
    // Every row but the sampled one; sequence 1's last row too, against next_prompt_token.
    ASSERT_EQ(g.prompt.size(), static_cast<size_t>(prompt_lengths[g.seq] - (g.seq == 3 ? 1 : 0)));
    ASSERT_EQ(g.prompt.size(), c.prompt.size());
    for (size_t t = 0; t < g.prompt.size(); ++t) {
      SCOPED_TRACE(testing::Message() << "sequence " << g.seq << " row " << t);
      EXPECT_EQ(g.prompt[t].token, c.prompt[t].token);
      EXPECT_NEAR(g.prompt[t].logprob, c.prompt[t].logprob, 3e-2);
      ASSERT_EQ(g.prompt[t].top.size(), c.prompt[t].top.size());
      // The alternatives' logprobs (their order may differ where two are within fp16 rounding).
      for (size_t k = 0; k < g.prompt[t].top.size(); ++k) {
        EXPECT_NEAR(g.prompt[t].top[k].second, c.prompt[t].top[k].second, 3e-2) << k;
      }
    }
  }
}

TEST(CudaPromptLogprobs, MatchTheCpuStageForTheSequencesThatAsk) {
  SKIP_WITHOUT_GPU();
  ExpectSameLogprobs("tiny-llama", 512, {9, 12, 1, 7});
}

// GPT-2's last projection leaves its bias pending into the final norm.
TEST(CudaPromptLogprobs, MatchTheCpuStageOnGpt2) {
  SKIP_WITHOUT_GPU();
  ExpectSameLogprobs("tiny-gpt2", 512, {9, 12, 1, 7});
}

// 1,100 rows: two forward passes of at most 1,024, sequence 3 cut between them; 32,768 ids make
// the LM head's pieces 128 rows, so each scored prompt takes several.
TEST(CudaPromptLogprobs, LongPromptsAcrossPassesAndHeadPieces) {
  SKIP_WITHOUT_GPU();
  ExpectSameLogprobs("tiny-llama", 32768, {220, 220, 220, 220, 220});
}

}  // namespace
}  // namespace tandem
