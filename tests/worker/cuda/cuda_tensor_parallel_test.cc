// The CUDA stage over two tensor-parallel GPUs against the same stage on one: the same logits
// within fp16 rounding and the same greedy tokens (where the top two logits are further apart
// than that), for a prompt step and decode steps replayed from graphs, on Llama with GQA and on
// Qwen3 (per-head norms), through the GEMV and the cuBLAS decode paths. And the refusals, which
// need no GPU: a size the heads do not divide, more GPUs than the host has, biases on the
// row-parallel projections.
#include "worker/cuda/cuda_tensor_parallel.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/cuda/cuda_test_util.h"
#include "tools/model_generator.h"

namespace tandem {
namespace {

using cuda_test::RelError;
using cuda_test::TmpDir;

using ::testing::HasSubstr;

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

#define SKIP_WITHOUT_TWO_GPUS()                                                         \
  do {                                                                                  \
    if (DeviceCount() < 2) {                                                            \
      GTEST_SKIP() << "tensor parallelism needs 2 CUDA devices; this host has "         \
                   << DeviceCount();                                                    \
    }                                                                                   \
  } while (0)

// A preset's checkpoint; "tiny-llama-odd-vocab": tiny Llama with a vocabulary of 1,001, which
// the two ranks' halves of the LM head do not divide (the last rank's rows padded).
std::filesystem::path Checkpoint(const std::string& preset) {
  if (preset != "tiny-llama-odd-vocab") {
    return cuda_test::PresetCheckpoint("cuda_tensor_parallel_" + preset, preset, 11);
  }
  const std::filesystem::path dir = TmpDir() / "cuda_tensor_parallel_odd_vocab";
  if (!std::filesystem::exists(dir / "config.json")) {
    absl::StatusOr<ModelConfig> base = PresetConfig("tiny-llama");
    EXPECT_TRUE(base.ok()) << base.status();
    ModelOverrides o;
    o.vocab_size = 1001;
    absl::StatusOr<ModelConfig> c = ApplyOverrides(*base, o);
    EXPECT_TRUE(c.ok()) << c.status();
    GeneratorOptions g;
    g.seed = 11;
    const std::filesystem::path tmp = TmpDir() / ("odd_vocab.tmp" + std::to_string(getpid()));
    std::filesystem::remove_all(tmp);
    EXPECT_TRUE(WriteRandomCheckpoint(*c, g, tmp).ok());
    std::error_code ec;
    std::filesystem::rename(tmp, dir, ec);  // fails where another test got there first
    if (ec) std::filesystem::remove_all(tmp);
  }
  return dir;
}

StageSpec SpecOf(const std::filesystem::path& dir) {
  StageSpec spec;
  spec.model_dir = dir;
  spec.max_slots = 4;
  spec.max_seq_len = 64;
  return spec;
}

std::vector<int32_t> Prompt(int length, int salt, int vocab) {
  std::vector<int32_t> t;
  for (int i = 0; i < length; ++i) t.push_back((37 * i + 101 * salt + 7) % vocab);
  return t;
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
    ss.sample = true;  // greedy
    step.seqs.push_back(ss);
    step.tokens.insert(step.tokens.end(), s.tokens.begin(), s.tokens.end());
  }
  return step;
}

class CudaTensorParallelTest
    : public ::testing::TestWithParam<std::tuple<std::string, int>> {
 protected:
  std::string preset() const { return std::get<0>(GetParam()); }
  int gemv_max_rows() const { return std::get<1>(GetParam()); }
};

// A prompt step of three sequences of different lengths, then four decode steps (replayed from
// the decode graphs): TP2's logits within 1e-2 of TP1's (relative to TP1's largest), and its
// greedy tokens TP1's for every row whose top two logits differ by more than twice the error.
TEST_P(CudaTensorParallelTest, Tp2LogitsAndGreedyTokensEqualTp1) {
  SKIP_WITHOUT_TWO_GPUS();
  const std::filesystem::path dir = Checkpoint(preset());
  CudaOptions options;
  options.device = 0;
  options.kv_memory_fraction = 0.05f;
  options.gemv_max_rows = gemv_max_rows();
  auto tp1 = MakeCudaTensorParallelStage(SpecOf(dir), options, 1);
  ASSERT_TRUE(tp1.ok()) << "TP1 stage: " << tp1.status();
  auto tp2 = MakeCudaTensorParallelStage(SpecOf(dir), options, 2);
  ASSERT_TRUE(tp2.ok()) << "TP2 stage: " << tp2.status();
  const int v = (*tp1)->config().vocab_size;
  EXPECT_EQ((*tp2)->config().num_heads, (*tp1)->config().num_heads)
      << "the TP2 stage should show the whole model's config";
  absl::StatusOr<int> graphs = (*tp2)->DecodeGraphCount();
  ASSERT_TRUE(graphs.ok()) << graphs.status();
  EXPECT_GT(*graphs, 0) << "the TP2 stage captured no decode graph: decode steps would not test "
                           "the all-reduce inside graphs";

  std::vector<Seq> seqs = {{0, 0, Prompt(5, 1, v)}, {1, 0, Prompt(9, 2, v)},
                           {2, 0, Prompt(2, 3, v)}};
  for (int step = 0; step < 5; ++step) {
    const std::string what = step == 0 ? "prompt step" : "decode step " + std::to_string(step);
    const StepDescriptor d = MakeStep(seqs);
    absl::StatusOr<StepOutput> a = (*tp1)->Step(d, {});
    ASSERT_TRUE(a.ok()) << what << ", TP1: " << a.status();
    absl::StatusOr<StepOutput> b = (*tp2)->Step(d, {});
    ASSERT_TRUE(b.ok()) << what << ", TP2: " << b.status();
    ASSERT_EQ(a->logits.size(), seqs.size() * v) << what;
    ASSERT_EQ(b->logits.size(), a->logits.size()) << what;
    double diff = 0.0, scale = 0.0;
    for (size_t i = 0; i < a->logits.size(); ++i) {
      diff = std::max(diff, std::abs(static_cast<double>(b->logits[i]) - a->logits[i]));
      scale = std::max(scale, std::abs(static_cast<double>(a->logits[i])));
    }
    EXPECT_LE(diff, 1e-2 * scale) << what << ": TP2's logits differ from TP1's by " << diff
                                  << " (largest TP1 logit " << scale
                                  << "); the all-reduce or the shards are wrong";
    ASSERT_EQ(b->tokens.size(), a->tokens.size()) << what;
    for (size_t r = 0; r < seqs.size(); ++r) {
      std::vector<float> row(a->logits.begin() + r * v, a->logits.begin() + (r + 1) * v);
      std::partial_sort(row.begin(), row.begin() + 2, row.end(), std::greater<float>());
      if (row[0] - row[1] > 2 * diff) {
        EXPECT_EQ(b->tokens[r], a->tokens[r])
            << what << ", sequence " << r << ": greedy tokens differ though the top two logits "
            << "are " << row[0] - row[1] << " apart (error " << diff << ")";
      }
    }
    for (size_t i = 0; i < seqs.size(); ++i) {
      seqs[i].position += static_cast<int32_t>(seqs[i].tokens.size());
      seqs[i].tokens = {a->tokens[i]};
    }
  }
}

// On pages (pages of 4, 48 of them): the TP2 stage reports its pages (the coordinator sizes its
// pool by them), and a sequence's KV-cache moves from TP1 into TP2 and back, continuing with TP1's
// logits (within 1e-2 of the largest).
TEST_P(CudaTensorParallelTest, PagedTp2ReportsItsPagesAndMovesKvWithTp1) {
  SKIP_WITHOUT_TWO_GPUS();
  const std::filesystem::path dir = Checkpoint(preset());
  CudaOptions options;
  options.device = 0;
  options.gemv_max_rows = gemv_max_rows();
  StageSpec spec = SpecOf(dir);
  spec.kv_page_size = 4;
  spec.kv_pages = 48;
  auto tp1 = MakeCudaTensorParallelStage(spec, options, 1);
  ASSERT_TRUE(tp1.ok()) << "TP1 stage: " << tp1.status();
  auto tp2 = MakeCudaTensorParallelStage(spec, options, 2);
  ASSERT_TRUE(tp2.ok()) << "TP2 stage: " << tp2.status();
  EXPECT_EQ((*tp2)->kv_pages(), 48);
  const int v = (*tp1)->config().vocab_size;
  auto paged = [](StepDescriptor d, const std::vector<std::vector<int32_t>>& tables) {
    for (size_t i = 0; i < d.seqs.size(); ++i) d.seqs[i].block_table = tables[i];
    return d;
  };
  const std::vector<int32_t> prompt = Prompt(7, 4, v);
  const std::vector<int32_t> t0 = {5, 9}, t1 = {20, 33};  // slot 0's and slot 1's pages
  absl::StatusOr<StepOutput> a = (*tp1)->Step(paged(MakeStep({{0, 0, prompt}}), {t0}), {});
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<StepOutput> b = (*tp2)->Step(paged(MakeStep({{0, 0, prompt}}), {t0}), {});
  ASSERT_TRUE(b.ok()) << b.status();
  absl::StatusOr<KvBlock> from1 =
      (*tp1)->ExportKv(KvPlace(0, t0), 7, 0, (*tp1)->config().num_layers);
  ASSERT_TRUE(from1.ok()) << from1.status();
  absl::StatusOr<KvBlock> from2 =
      (*tp2)->ExportKv(KvPlace(0, t0), 7, 0, (*tp2)->config().num_layers);
  ASSERT_TRUE(from2.ok()) << from2.status();
  EXPECT_EQ(from2->num_kv_heads, from1->num_kv_heads);
  ASSERT_TRUE((*tp2)->ImportKv(KvPlace(1, t1), *from1).ok());
  ASSERT_TRUE((*tp1)->ImportKv(KvPlace(1, t1), *from2).ok());
  const int32_t next = a->tokens[0];
  const StepDescriptor d = paged(MakeStep({{0, 7, {next}}, {1, 7, {next}}}), {t0, t1});
  absl::StatusOr<StepOutput> x = (*tp1)->Step(d, {});
  ASSERT_TRUE(x.ok()) << x.status();
  absl::StatusOr<StepOutput> y = (*tp2)->Step(d, {});
  ASSERT_TRUE(y.ok()) << y.status();
  double scale = 0.0;
  for (int i = 0; i < v; ++i) scale = std::max(scale, std::abs(static_cast<double>(x->logits[i])));
  for (const auto& [out, row, what] :
       {std::tuple{&*x, 1, "TP1 from TP2's block"}, std::tuple{&*y, 0, "TP2"},
        std::tuple{&*y, 1, "TP2 from TP1's block"}}) {
    double diff = 0.0;
    for (int i = 0; i < v; ++i) {
      diff = std::max(diff, std::abs(static_cast<double>(out->logits[row * v + i]) - x->logits[i]));
    }
    EXPECT_LE(diff, 1e-2 * scale) << what;
  }
}

// Decode steps launched ahead on TP2 (each fed the token the step before samples, on the device):
// the tokens of the same steps run one at a time.
TEST_P(CudaTensorParallelTest, Tp2DecodeLaunchedAheadGivesTheTokensOfStepByStep) {
  SKIP_WITHOUT_TWO_GPUS();
  const std::filesystem::path dir = Checkpoint(preset());
  CudaOptions options;
  options.device = 0;
  options.kv_memory_fraction = 0.05f;
  options.gemv_max_rows = gemv_max_rows();
  auto tp2 = MakeCudaTensorParallelStage(SpecOf(dir), options, 2);
  ASSERT_TRUE(tp2.ok()) << "TP2 stage: " << tp2.status();
  Stage& stage = **tp2;
  ASSERT_TRUE(stage.LaunchOverlaps());
  const int v = stage.config().vocab_size;
  const std::vector<int32_t> prompt = Prompt(6, 7, v);
  constexpr int kSteps = 5;
  // Slot 0 step by step.
  std::vector<int32_t> want;
  absl::StatusOr<StepOutput> first = stage.Step(MakeStep({{0, 0, prompt}}), {});
  ASSERT_TRUE(first.ok()) << first.status();
  want.push_back(first->tokens[0]);
  for (int k = 0; k < kSteps; ++k) {
    StepDescriptor d = MakeStep({{0, static_cast<int32_t>(prompt.size()) + k, {want.back()}}});
    d.return_logits = false;
    absl::StatusOr<StepOutput> o = stage.Step(d, {});
    ASSERT_TRUE(o.ok()) << o.status();
    want.push_back(o->tokens[0]);
  }
  // Slot 1 launched ahead: step k + 1 is launched before step k is finished, its token the one
  // step k samples.
  std::vector<int32_t> got;
  first = stage.Step(MakeStep({{1, 0, prompt}}), {});
  ASSERT_TRUE(first.ok()) << first.status();
  got.push_back(first->tokens[0]);
  for (int k = 0; k < kSteps; ++k) {
    StepDescriptor d = MakeStep({{1, static_cast<int32_t>(prompt.size()) + k, {got[0]}}});
    d.return_logits = false;
    ASSERT_TRUE(stage.CanLaunchDecode(d));
    const std::vector<int> from_previous = {k == 0 ? -1 : 0};
    const absl::Status launched = stage.LaunchDecode(d, from_previous);
    ASSERT_TRUE(launched.ok()) << "step " << k << ": " << launched;
    if (k > 0) {
      absl::StatusOr<StepOutput> o = stage.FinishDecode();
      ASSERT_TRUE(o.ok()) << o.status();
      got.push_back(o->tokens[0]);
    }
  }
  absl::StatusOr<StepOutput> last = stage.FinishDecode();
  ASSERT_TRUE(last.ok()) << last.status();
  got.push_back(last->tokens[0]);
  EXPECT_EQ(stage.launched_decodes(), 0);
  EXPECT_EQ(got, want);
}

// Prompt logprobs (the LM head over every prompt row, split by vocabulary on TP2 and gathered):
// each scored token's logprob and its alternatives as TP1's.
TEST_P(CudaTensorParallelTest, Tp2PromptLogprobsAreTp1s) {
  SKIP_WITHOUT_TWO_GPUS();
  const std::filesystem::path dir = Checkpoint(preset());
  CudaOptions options;
  options.device = 0;
  options.kv_memory_fraction = 0.05f;
  options.gemv_max_rows = gemv_max_rows();
  auto tp1 = MakeCudaTensorParallelStage(SpecOf(dir), options, 1);
  ASSERT_TRUE(tp1.ok()) << "TP1 stage: " << tp1.status();
  auto tp2 = MakeCudaTensorParallelStage(SpecOf(dir), options, 2);
  ASSERT_TRUE(tp2.ok()) << "TP2 stage: " << tp2.status();
  const int v = (*tp1)->config().vocab_size;
  StepDescriptor d = MakeStep({{0, 0, Prompt(9, 5, v)}});
  d.seqs[0].prompt_logprobs = 3;
  absl::StatusOr<StepOutput> a = (*tp1)->Step(d, {});
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<StepOutput> b = (*tp2)->Step(d, {});
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(a->logprobs.size(), 1u);
  ASSERT_EQ(b->logprobs.size(), 1u);
  const std::vector<TokenLogprob>& x = a->logprobs[0].prompt;
  const std::vector<TokenLogprob>& y = b->logprobs[0].prompt;
  ASSERT_EQ(x.size(), 8u) << "tokens 1..8 of the prompt are scored";
  ASSERT_EQ(y.size(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(y[i].token, x[i].token) << "row " << i;
    EXPECT_NEAR(y[i].logprob, x[i].logprob, 2e-2) << "row " << i << ": the scored token's logprob";
    ASSERT_EQ(y[i].top.size(), x[i].top.size()) << "row " << i;
    for (size_t k = 0; k < x[i].top.size(); ++k) {
      EXPECT_NEAR(y[i].top[k].second, x[i].top[k].second, 2e-2)
          << "row " << i << ", alternative " << k;
    }
  }
}

// gemv_max_rows 4: decode steps of three rows through the GEMV kernels; 0: through cuBLAS. The
// LM head is split by vocabulary but where it is the tied embedding (tiny-llama-tied).
INSTANTIATE_TEST_SUITE_P(Presets, CudaTensorParallelTest,
                         ::testing::Combine(::testing::Values("tiny-llama", "tiny-qwen3",
                                                              "tiny-llama-tied",
                                                              "tiny-llama-odd-vocab"),
                                            ::testing::Values(4, 0)),
                         [](const auto& info) {
                           std::string n = std::get<0>(info.param);
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n + (std::get<1>(info.param) > 0 ? "_gemv" : "_cublas");
                         });

// Refused before any GPU is touched: 3 does not divide tiny-llama's 4 heads.
TEST(CudaTensorParallelErrorTest, ASizeThatDoesNotDivideTheHeadsIsRefusedNamingThem) {
  auto stage = MakeCudaTensorParallelStage(SpecOf(Checkpoint("tiny-llama")), CudaOptions{}, 3);
  ASSERT_FALSE(stage.ok());
  EXPECT_EQ(stage.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(stage.status().message(), HasSubstr("tensor-parallel size 3"));
  EXPECT_THAT(stage.status().message(), HasSubstr("4 attention heads"));
}

// Two ranks from the first device past the host's last are refused naming the count.
TEST(CudaTensorParallelErrorTest, MoreGpusThanTheHostHasAreRefusedNamingTheCount) {
  const int count = DeviceCount();
  CudaOptions options;
  options.device = count;
  auto stage = MakeCudaTensorParallelStage(SpecOf(Checkpoint("tiny-llama")), options, 2);
  ASSERT_FALSE(stage.ok());
  EXPECT_EQ(stage.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(stage.status().message(),
              HasSubstr("this host has " + std::to_string(count)));
}

// GPT-2's attention output and MLP down projections have biases, which the cuda ranks do not
// split: refused with the way out.
TEST(CudaTensorParallelErrorTest, BiasesOnRowParallelProjectionsAreRefused) {
  auto stage = MakeCudaTensorParallelStage(SpecOf(Checkpoint("tiny-gpt2")), CudaOptions{}, 2);
  ASSERT_FALSE(stage.ok());
  EXPECT_EQ(stage.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(stage.status().message(), HasSubstr("biases"));
}

}  // namespace
}  // namespace tandem
