// The sampling controls on the CUDA stage against the fp32 CPU stage: raw logprobs and their top
// alternatives agree within fp16 rounding, penalties and min_p pick what the CPU rule picks over
// the CUDA stage's own logits, and a step without controls returns no logprobs (prompt logprobs:
// cuda_stage_prompt_test.cc). Skipped where no GPU is present.
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "common/rng.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/cuda/cuda_test_util.h"
#include "tools/model_generator.h"
#include "worker/cpu/cpu_stage.h"
#include "worker/cuda/cuda_stage.h"
#include "worker/sampling.h"

namespace tandem {
namespace {


std::filesystem::path TmpDir() {
  const char* env = std::getenv("TANDEM_TEST_TMPDIR");
  return env != nullptr ? std::filesystem::path(env) : std::filesystem::path(TANDEM_TEST_TMPDIR);
}

// Written aside and renamed into place, so that tests running at once never read one half
// written.
std::filesystem::path Checkpoint() {
  const std::filesystem::path dir = TmpDir() / "cuda_sampling_tiny-llama";
  if (!std::filesystem::exists(dir / "config.json")) {
    auto c = PresetConfig("tiny-llama");
    EXPECT_TRUE(c.ok()) << c.status();
    const std::filesystem::path tmp = TmpDir() / ("cuda_sampling.tmp" + std::to_string(getpid()));
    std::filesystem::remove_all(tmp);
    EXPECT_TRUE(WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 5}, tmp).ok());
    std::error_code ec;
    std::filesystem::rename(tmp, dir, ec);
    if (ec) std::filesystem::remove_all(tmp);
  }
  return dir;
}

struct Stages {
  std::unique_ptr<Stage> cpu, cuda;
};

Stages MakeStages() {
  const StageSpec spec{.model_dir = Checkpoint(), .first_layer = 0, .last_layer = -1,
                       .max_slots = 4, .max_seq_len = 128};
  auto cpu = MakeCpuStage(spec);
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  CudaOptions o;
  o.dtype = DType::kF16;
  auto cuda = MakeCudaStage(spec, o);
  EXPECT_TRUE(cuda.ok()) << cuda.status();
  if (!cpu.ok() || !cuda.ok()) return {};
  return {*std::move(cpu), *std::move(cuda)};
}

std::vector<int32_t> Prompt(int n, uint64_t seed) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = static_cast<int32_t>(RandomBits(seed, i) % 512);
  return p;
}

// Prefill of three sequences in one step (slots 0..2), each with its own controls, then one
// decode step of all three; the logits come back too.
std::vector<StepOutput> PrefillAndDecode(Stage& stage, const std::vector<SequenceStep>& controls) {
  std::vector<StepOutput> outs;
  StepDescriptor d;
  d.id = 1;
  d.return_logits = true;
  for (size_t i = 0; i < controls.size(); ++i) {
    SequenceStep s = controls[i];
    s.slot = static_cast<int>(i);
    s.position = 0;
    s.num_tokens = 9;
    s.sample = true;
    d.seqs.push_back(s);
    const std::vector<int32_t> p = Prompt(9, 40 + i);
    d.tokens.insert(d.tokens.end(), p.begin(), p.end());
  }
  auto prefill = stage.Step(d, Activations{});
  EXPECT_TRUE(prefill.ok()) << prefill.status();
  if (!prefill.ok()) return outs;
  outs.push_back(*prefill);
  d.id = 2;
  d.tokens.clear();
  for (size_t i = 0; i < d.seqs.size(); ++i) {
    d.seqs[i].position = 9;
    d.seqs[i].num_tokens = 1;
    d.seqs[i].sample_index = 1;
    d.tokens.push_back(prefill->tokens[i]);
  }
  auto decode = stage.Step(d, Activations{});
  EXPECT_TRUE(decode.ok()) << decode.status();
  if (decode.ok()) outs.push_back(*decode);
  return outs;
}

std::vector<SequenceStep> Controls() {
  SequenceStep greedy_logprobs;
  greedy_logprobs.logprobs = 5;
  SequenceStep penalised;
  penalised.sampling = {.temperature = 0.8f, .seed = 3, .presence_penalty = 1.5f,
                        .frequency_penalty = 0.5f, .repetition_penalty = 1.3f};
  penalised.seen = {{.id = 7, .output_count = 2, .in_prompt = true},
                    {.id = 100, .output_count = 1, .in_prompt = false},
                    {.id = 300, .output_count = 0, .in_prompt = true}};
  penalised.logprobs = 0;
  SequenceStep min_p;
  min_p.sampling = {.temperature = 1.0f, .seed = 9, .min_p = 0.2f};
  return {greedy_logprobs, penalised, min_p};
}

TEST(CudaSampling, LogprobsMatchTheCpuStageWithinFp16Rounding) {
  SKIP_WITHOUT_GPU();
  Stages st = MakeStages();
  ASSERT_NE(st.cuda, nullptr);
  const std::vector<StepOutput> cpu = PrefillAndDecode(*st.cpu, Controls());
  const std::vector<StepOutput> gpu = PrefillAndDecode(*st.cuda, Controls());
  ASSERT_EQ(cpu.size(), 2u);
  ASSERT_EQ(gpu.size(), 2u);
  for (int step = 0; step < 2; ++step) {
    ASSERT_EQ(gpu[step].logprobs.size(), 2u) << "step " << step;
    // Sequence 0 is greedy: the same token (the model's margins are far above fp16 rounding on
    // this seed), its logprob the top alternative's, and the alternatives in the same order.
    const SequenceLogprobs& g = gpu[step].logprobs[0];
    const SequenceLogprobs& c = cpu[step].logprobs[0];
    ASSERT_EQ(g.seq, 0);
    ASSERT_TRUE(g.has_sampled);
    EXPECT_EQ(g.sampled.token, c.sampled.token);
    EXPECT_NEAR(g.sampled.logprob, c.sampled.logprob, 2e-2);
    ASSERT_EQ(g.sampled.top.size(), 5u);
    EXPECT_EQ(g.sampled.top[0].first, g.sampled.token);
    EXPECT_EQ(g.sampled.top[0].second, g.sampled.logprob);
    for (size_t k = 0; k < 5; ++k) {
      EXPECT_NEAR(g.sampled.top[k].second, c.sampled.top[k].second, 2e-2) << k;
    }
    // Sequence 1: its sampled token's logprob is the raw one, before the penalties.
    EXPECT_EQ(gpu[step].logprobs[1].seq, 1);
    const int vocab = st.cuda->config().vocab_size;
    const std::span<const float> row(gpu[step].logits.data() + vocab, vocab);
    const TokenLogprob want = ComputeLogprob(row, gpu[step].tokens[1], 0);
    EXPECT_NEAR(gpu[step].logprobs[1].sampled.logprob, want.logprob, 1e-5);
  }
}

TEST(CudaSampling, PenaltiesAndMinPFollowTheHostRuleOverTheStagesLogits) {
  SKIP_WITHOUT_GPU();
  Stages st = MakeStages();
  ASSERT_NE(st.cuda, nullptr);
  const std::vector<SequenceStep> controls = Controls();
  const std::vector<StepOutput> gpu = PrefillAndDecode(*st.cuda, controls);
  ASSERT_EQ(gpu.size(), 2u);
  const int vocab = st.cuda->config().vocab_size;
  for (int step = 0; step < 2; ++step) {
    for (int i = 1; i < 3; ++i) {
      std::vector<float> row(gpu[step].logits.begin() + static_cast<size_t>(i) * vocab,
                             gpu[step].logits.begin() + static_cast<size_t>(i + 1) * vocab);
      ApplyPenalties(row, controls[i].sampling, controls[i].seen);
      EXPECT_EQ(gpu[step].tokens[i], SampleToken(row, controls[i].sampling, step))
          << "step " << step << " sequence " << i;
    }
  }
}

TEST(CudaSampling, ProbabilitiesMatchTheCpuStage) {
  SKIP_WITHOUT_GPU();
  Stages st = MakeStages();
  ASSERT_NE(st.cuda, nullptr);
  const std::vector<StepOutput> cpu = PrefillAndDecode(*st.cpu, Controls());
  const std::vector<StepOutput> gpu = PrefillAndDecode(*st.cuda, Controls());
  ASSERT_EQ(gpu.size(), 2u);
  const int vocab = st.cuda->config().vocab_size;
  // Prefill rows: the same inputs on both backends; softmax probabilities within 1e-3.
  for (int i = 0; i < 3; ++i) {
    const std::span<const float> g(gpu[0].logits.data() + static_cast<size_t>(i) * vocab, vocab);
    const std::span<const float> c(cpu[0].logits.data() + static_cast<size_t>(i) * vocab, vocab);
    const TokenLogprob gl = ComputeLogprob(g, 0, vocab), cl = ComputeLogprob(c, 0, vocab);
    std::vector<double> gp(vocab), cp(vocab);
    for (const auto& [t, lp] : gl.top) gp[t] = std::exp(lp);
    for (const auto& [t, lp] : cl.top) cp[t] = std::exp(lp);
    for (int t = 0; t < vocab; ++t) EXPECT_NEAR(gp[t], cp[t], 1e-3) << "row " << i << " " << t;
  }
}

TEST(CudaSampling, StepsWithoutControlsReturnNoLogprobsOrLogits) {
  SKIP_WITHOUT_GPU();
  Stages st = MakeStages();
  ASSERT_NE(st.cuda, nullptr);
  StepDescriptor d;
  d.seqs = {SequenceStep{}};
  d.seqs[0].num_tokens = 3;
  d.tokens = {1, 2, 3};
  auto out = st.cuda->Step(d, Activations{});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->logprobs.empty());
  EXPECT_TRUE(out->logits.empty());
  d.seqs[0].logprobs = 1;
  d.seqs[0].slot = 1;
  out = st.cuda->Step(d, Activations{});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->logprobs.size(), 1u);
  EXPECT_TRUE(out->logits.empty()) << "logits copied for the rule are not returned";
}

}  // namespace
}  // namespace tandem
