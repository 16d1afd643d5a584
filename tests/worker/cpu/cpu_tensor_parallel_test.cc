// The CPU stage over tensor-parallel thread ranks against the same stage whole: the same logits
// within fp32 rounding and the same greedy tokens, over GPT-2, Llama with GQA (at TP4 fewer K/V
// heads than ranks) and Qwen3, whole and as the second of two pipeline stages; with FP8
// KV-caches on pages; and a sequence's KV-cache moved between the split stage and the whole one.
#include "worker/cpu/cpu_tensor_parallel.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tools/model_generator.h"
#include "worker/cpu/cpu_all_reduce.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

std::filesystem::path ModelsRoot() {
  return std::filesystem::path(TANDEM_TEST_TMPDIR) /
         ("cpu_tensor_parallel_test_models_" + std::to_string(getpid()));
}

// The preset's random checkpoint, written on first use in this process.
std::filesystem::path ModelDir(const std::string& name) {
  const std::filesystem::path dir = ModelsRoot() / name;
  if (!std::filesystem::exists(dir / "config.json")) {
    absl::StatusOr<ModelConfig> config = PresetConfig(name);
    EXPECT_TRUE(config.ok()) << config.status();
    GeneratorOptions options;
    options.seed = 20261128;
    absl::Status st = WriteRandomCheckpoint(*config, options, dir);
    EXPECT_TRUE(st.ok()) << st;
  }
  return dir;
}

// fp8: an FP8 KV-cache of 48 pages of 4 positions (StageSpec::kv_cache_fp8).
std::unique_ptr<Stage> MakeStage(const std::filesystem::path& dir, int first, int last, int ranks,
                                 bool fp8 = false) {
  StageSpec spec;
  spec.model_dir = dir;
  spec.first_layer = first;
  spec.last_layer = last;
  spec.max_slots = 4;
  if (fp8) {
    spec.max_seq_len = 64;
    spec.kv_page_size = 4;
    spec.kv_pages = 48;
    spec.kv_cache_fp8 = true;
  }
  auto stage = MakeCpuTensorParallelStage(spec, ranks);
  EXPECT_TRUE(stage.ok()) << stage.status();
  return stage.ok() ? std::move(stage).value() : nullptr;
}

std::vector<int32_t> Prompt(int length, int salt, int vocab) {
  std::vector<int32_t> t;
  for (int i = 0; i < length; ++i) t.push_back((37 * i + 101 * salt + 7) % vocab);
  return t;
}

// max |a - b| / max |b|.
double RelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return scale > 0.0 ? diff / scale : diff;
}

struct Seq {
  int32_t slot = 0;
  int32_t position = 0;
  std::vector<int32_t> tokens;
};

StepDescriptor MakeStep(const std::vector<Seq>& seqs) {
  static uint64_t next_id = 1;
  StepDescriptor step;
  step.id = next_id++;
  step.return_logits = true;
  for (const Seq& s : seqs) {
    SequenceStep ss;
    ss.slot = s.slot;
    ss.position = s.position;
    ss.num_tokens = static_cast<int32_t>(s.tokens.size());
    ss.sample = true;
    step.seqs.push_back(ss);
    step.tokens.insert(step.tokens.end(), s.tokens.begin(), s.tokens.end());
  }
  return step;
}

// Runs `step` through the stages in turn, each taking the previous one's hidden states.
StepOutput RunStages(std::vector<std::unique_ptr<Stage>>& stages, const StepDescriptor& step) {
  Activations in;
  StepOutput out;
  for (auto& stage : stages) {
    auto r = stage->Step(step, in);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    out = std::move(r).value();
    in = out.hidden;
  }
  return out;
}

class CpuTensorParallelTest
    : public ::testing::TestWithParam<std::tuple<std::string, int>> {
 protected:
  static void TearDownTestSuite() { std::filesystem::remove_all(ModelsRoot()); }
  std::filesystem::path dir() { return ModelDir(std::get<0>(GetParam())); }
  int ranks() { return std::get<1>(GetParam()); }
};

// A prefill of three sequences of different lengths, then four decode steps: logits within fp32
// rounding of the whole stage's and the same greedy tokens, whole and as a pipeline's second
// stage (its input the first stage's hidden states).
TEST_P(CpuTensorParallelTest, LogitsEqualTheWholeStagesWithinFp32Rounding) {
  const ModelConfig config = *LoadModelConfig(dir());
  const int v = config.vocab_size, layers = config.num_layers;
  std::vector<std::unique_ptr<Stage>> whole, split, piped;
  whole.push_back(MakeStage(dir(), 0, layers, 1));
  split.push_back(MakeStage(dir(), 0, layers, ranks()));
  piped.push_back(MakeStage(dir(), 0, 2, ranks()));
  piped.push_back(MakeStage(dir(), 2, layers, ranks()));
  ASSERT_TRUE(whole[0] && split[0] && piped[0] && piped[1]);
  EXPECT_EQ(split[0]->config().num_heads, config.num_heads);  // the whole model's config

  std::vector<Seq> seqs = {{0, 0, Prompt(5, 1, v)}, {1, 0, Prompt(9, 2, v)},
                           {2, 0, Prompt(2, 3, v)}};
  for (int step = 0; step < 5; ++step) {
    const StepDescriptor d = MakeStep(seqs);
    const StepOutput a = RunStages(whole, d), b = RunStages(split, d), c = RunStages(piped, d);
    ASSERT_EQ(a.logits.size(), 3u * v);
    EXPECT_LE(RelDiff(b.logits, a.logits), 2e-5) << "step " << step;
    EXPECT_LE(RelDiff(c.logits, a.logits), 2e-5) << "step " << step;
    EXPECT_EQ(b.tokens, a.tokens) << "step " << step;
    EXPECT_EQ(c.tokens, a.tokens) << "step " << step;
    for (size_t i = 0; i < seqs.size(); ++i) {
      seqs[i].position += static_cast<int32_t>(seqs[i].tokens.size());
      seqs[i].tokens = {a.tokens[i]};
    }
  }
}

// The same with FP8 KV-caches on pages: every rank rounds its heads' K and V through the layer's
// scales as the whole stage does. A rank's fp32 sums differ from the whole stage's in their last
// bits, and where a value lies that close to the boundary between two E4M3 codes it takes the
// other one (a step of up to 2^-4 relative): the logits stay within 1e-3 of the whole stage's
// (2.5e-4 measured on tiny-qwen3), not fp32 rounding's 2e-5.
TEST_P(CpuTensorParallelTest, Fp8KvCachesOnPagesGiveTheWholeStagesLogits) {
  const ModelConfig config = *LoadModelConfig(dir());
  const int v = config.vocab_size, layers = config.num_layers;
  std::vector<std::unique_ptr<Stage>> whole, split;
  whole.push_back(MakeStage(dir(), 0, layers, 1, /*fp8=*/true));
  split.push_back(MakeStage(dir(), 0, 2, ranks(), /*fp8=*/true));
  split.push_back(MakeStage(dir(), 2, layers, ranks(), /*fp8=*/true));
  ASSERT_TRUE(whole[0] && split[0] && split[1]);
  EXPECT_EQ(split[0]->kv_pages(), 48);  // what the coordinator sizes the pipeline's pool by
  std::vector<Seq> seqs = {{0, 0, Prompt(5, 1, v)}, {3, 0, Prompt(9, 2, v)}};
  for (int step = 0; step < 5; ++step) {
    StepDescriptor d = MakeStep(seqs);
    for (SequenceStep& s : d.seqs) {  // slot s: pages 47 - s, 43 - s, ... (every fourth, down)
      for (int p = 0; p * 4 < s.position + s.num_tokens; ++p) {
        s.block_table.push_back(47 - s.slot - 4 * p);
      }
    }
    const StepOutput a = RunStages(whole, d), b = RunStages(split, d);
    ASSERT_EQ(a.logits.size(), 2u * v);
    EXPECT_LE(RelDiff(b.logits, a.logits), 1e-3) << "step " << step;
    for (size_t i = 0; i < seqs.size(); ++i) {
      seqs[i].position += static_cast<int32_t>(seqs[i].tokens.size());
      seqs[i].tokens = {a.tokens[i]};
    }
  }
}

// The K/V floats of a host block.
std::vector<float> KvFloats(const KvBlock& b) {
  EXPECT_EQ(b.dtype, DType::kF32);
  std::vector<float> f((b.k.size() + b.v.size()) / 4);
  std::memcpy(f.data(), b.k.data(), b.k.size());
  std::memcpy(f.data() + b.k.size() / 4, b.v.data(), b.v.size());
  return f;
}

// A sequence's KV-cache moves between the split stage and the stage whole (tensor-parallel groups
// of different sizes): the split stage exports every K/V head (each rank's, side by side) within
// fp32 rounding of the whole stage's, and a block imported either way continues the sequence with
// the whole stage's logits.
TEST_P(CpuTensorParallelTest, KvMovesBetweenTheSplitStageAndTheWholeOne) {
  const ModelConfig config = *LoadModelConfig(dir());
  const int v = config.vocab_size, layers = config.num_layers;
  std::unique_ptr<Stage> whole = MakeStage(dir(), 0, layers, 1);
  std::unique_ptr<Stage> split = MakeStage(dir(), 0, layers, ranks());
  ASSERT_TRUE(whole && split);
  const std::vector<int32_t> prompt = Prompt(7, 4, v);
  const int n = static_cast<int>(prompt.size());
  absl::StatusOr<StepOutput> a = whole->Step(MakeStep({{0, 0, prompt}}), {});
  absl::StatusOr<StepOutput> b = split->Step(MakeStep({{0, 0, prompt}}), {});
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();

  absl::StatusOr<KvBlock> from_whole = whole->ExportKv(KvPlace(0), n, 0, layers);
  absl::StatusOr<KvBlock> from_split = split->ExportKv(KvPlace(0), n, 0, layers);
  ASSERT_TRUE(from_whole.ok()) << from_whole.status();
  ASSERT_TRUE(from_split.ok()) << from_split.status();
  EXPECT_EQ(from_split->num_kv_heads, config.num_kv_heads);
  EXPECT_LE(RelDiff(KvFloats(*from_split), KvFloats(*from_whole)), 2e-5);

  // The whole stage's block into the split stage's slot 1, the split stage's into the whole
  // stage's slot 2; then one decode step of the same token everywhere.
  ASSERT_TRUE(split->ImportKv(KvPlace(1), *from_whole).ok());
  ASSERT_TRUE(whole->ImportKv(KvPlace(2), *from_split).ok());
  const int32_t next = a->tokens[0];
  absl::StatusOr<StepOutput> w = whole->Step(MakeStep({{0, n, {next}}, {2, n, {next}}}), {});
  absl::StatusOr<StepOutput> s = split->Step(MakeStep({{0, n, {next}}, {1, n, {next}}}), {});
  ASSERT_TRUE(w.ok() && s.ok()) << w.status() << s.status();
  const std::vector<float> want(w->logits.begin(), w->logits.begin() + v);
  auto row = [&](const StepOutput& o, int i) {
    return std::vector<float>(o.logits.begin() + i * v, o.logits.begin() + (i + 1) * v);
  };
  EXPECT_LE(RelDiff(row(*w, 1), want), 2e-5) << "the whole stage from the split stage's block";
  EXPECT_LE(RelDiff(row(*s, 0), want), 2e-5) << "the split stage";
  EXPECT_LE(RelDiff(row(*s, 1), want), 2e-5) << "the split stage from the whole stage's block";

  // A block of other heads is refused, naming the rank's check, and nothing is written.
  KvBlock bad = *from_whole;
  bad.num_kv_heads += 1;
  const absl::Status st = split->ImportKv(KvPlace(3), bad);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("K/V heads"));
}

// tiny-llama and tiny-qwen3 have 4 query heads over 2 K/V heads: TP4 replicates each K/V head
// on two ranks. tiny-gpt2 has 4 heads of its own K/V.
INSTANTIATE_TEST_SUITE_P(TinyPresets, CpuTensorParallelTest,
                         ::testing::Combine(::testing::Values("tiny-gpt2", "tiny-llama",
                                                              "tiny-qwen3"),
                                            ::testing::Values(2, 4)),
                         [](const auto& info) {
                           std::string n = std::get<0>(info.param);
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n + "_tp" + std::to_string(std::get<1>(info.param));
                         });

// A size the model's heads do not split into is refused naming both numbers.
TEST(CpuTensorParallelErrorTest, ASizeThatDoesNotDivideTheHeadsIsRefusedNamingThem) {
  StageSpec spec;
  spec.model_dir = ModelDir("tiny-llama");  // 4 heads
  absl::StatusOr<std::unique_ptr<Stage>> stage = MakeCpuTensorParallelStage(spec, 3);
  ASSERT_FALSE(stage.ok());
  EXPECT_EQ(stage.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(stage.status().message(), HasSubstr("tensor-parallel size 3"));
  EXPECT_THAT(stage.status().message(), HasSubstr("4 attention heads"));
}

// A step refused by the ranks' checks leaves the split stage usable.
TEST(CpuTensorParallelErrorTest, ARefusedStepLeavesTheStageUsable) {
  std::unique_ptr<Stage> stage = MakeStage(ModelDir("tiny-llama"), 0, 4, 2);
  ASSERT_TRUE(stage);
  StepDescriptor bad = MakeStep({{9, 0, {1, 2}}});  // slot 9 of 4
  EXPECT_FALSE(stage->Step(bad, {}).ok());
  absl::StatusOr<StepOutput> good = stage->Step(MakeStep({{0, 0, {1, 2}}}), {});
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(good->tokens.size(), 1u);
}

}  // namespace
}  // namespace tandem
