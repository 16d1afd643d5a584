// The CUDA stage with FP8 linear weights against the CPU reference on the same weights: a tiny
// Llama quantized at load (--quantization fp8) and the same model read from its pre-quantized
// per-channel checkpoint, through the prefill GEMM path (FP8 rows dequantized, then the GEMM) and
// the decode GEMV path (FP8 codes read by the kernel), with and without CUDA graphs. Skipped where
// no GPU is present.
#include <unistd.h>

#include <cmath>
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


// tiny-llama in fp16, unquantized ("none") or as a --quantization form of tandem-make-model.
std::filesystem::path Model(const std::string& quantization) {
  const std::filesystem::path dir = TmpDir() / ("cuda_stage_fp8_" + quantization);
  if (!std::filesystem::exists(dir / "config.json")) {
    ModelOverrides o;
    o.dtype = "f16";
    o.quantization = quantization;
    auto c = ApplyOverrides(*PresetConfig("tiny-llama"), o);
    EXPECT_TRUE(c.ok()) << c.status();
    GeneratorOptions g;
    g.seed = 11;
    const std::filesystem::path tmp = TmpDir() / ("cuda_stage_fp8_" + quantization + ".tmp" +
                                                  std::to_string(getpid()));
    std::filesystem::remove_all(tmp);
    EXPECT_TRUE(WriteRandomCheckpoint(*c, g, tmp).ok());
    std::error_code ec;
    std::filesystem::rename(tmp, dir, ec);
    if (ec) std::filesystem::remove_all(tmp);
  }
  return dir;
}


StageSpec Spec(const std::filesystem::path& dir, bool quantize) {
  StageSpec spec;
  spec.model_dir = dir;
  spec.max_slots = 4;
  spec.max_seq_len = 64;
  spec.quantize_fp8 = quantize;
  return spec;
}

// Logits of a prefill of two sequences (13 and 20 tokens: the GEMM path), then of 4 greedy decode
// steps of both (2 rows: the GEMV path), each fed with the CPU reference's tokens so that both
// backends see the same inputs.
std::vector<std::vector<float>> RunSteps(Stage& stage,
                                         const std::vector<std::vector<int32_t>>& feed,
                                         std::vector<std::vector<int32_t>>* tokens_out) {
  std::vector<std::vector<float>> logits;
  const std::vector<int> lengths = {13, 20};
  StepDescriptor pre;
  pre.return_logits = true;
  for (int s = 0; s < 2; ++s) {
    SequenceStep ss;
    ss.slot = s;
    ss.num_tokens = lengths[s];
    pre.seqs.push_back(ss);
    for (int i = 0; i < lengths[s]; ++i) pre.tokens.push_back(RandomBits(40 + s, i) % 256);
  }
  auto out = stage.Step(pre, Activations{});
  EXPECT_TRUE(out.ok()) << out.status();
  if (!out.ok()) return logits;
  logits.push_back(out->logits);
  if (tokens_out != nullptr) tokens_out->push_back(out->tokens);
  for (int i = 0; i < 4; ++i) {
    StepDescriptor d;
    d.id = i + 1;
    d.return_logits = true;
    for (int s = 0; s < 2; ++s) {
      SequenceStep ss;
      ss.slot = s;
      ss.position = lengths[s] + i;
      ss.sample_index = i + 1;
      d.seqs.push_back(ss);
    }
    d.tokens = feed.empty() ? tokens_out->back() : feed[i];
    auto o = stage.Step(d, Activations{});
    EXPECT_TRUE(o.ok()) << o.status();
    if (!o.ok()) return logits;
    logits.push_back(o->logits);
    if (tokens_out != nullptr) tokens_out->push_back(o->tokens);
  }
  return logits;
}

TEST(CudaStageFp8Test, LogitsMatchTheCpuReferenceOnTheSameFp8Weights) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device available";
  for (auto [form, quantize] : {std::pair{std::string("none"), true},
                                {std::string("compressed-tensors"), false},
                                {std::string("fp8-static"), false}}) {
    SCOPED_TRACE(form);
    auto cpu = MakeCpuStage(Spec(Model(form), quantize));
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    std::vector<std::vector<int32_t>> tokens;
    const auto want = RunSteps(**cpu, {}, &tokens);
    ASSERT_EQ(want.size(), 5u);
    for (bool graphs : {false, true}) {
      for (bool invariant : {true, false}) {
        CudaOptions o;
        o.dtype = DType::kF16;
        o.cuda_graphs = graphs;
        o.batch_invariant = invariant;
        auto gpu = MakeCudaStage(Spec(Model(form), quantize), o);
        ASSERT_TRUE(gpu.ok()) << gpu.status();
        std::vector<std::vector<int32_t>> feed(tokens.begin(), tokens.end() - 1);
        const auto got = RunSteps(**gpu, feed, nullptr);
        ASSERT_EQ(got.size(), want.size());
        // Batch-invariant, every product reads the dequantized weights with fp16 activations:
        // against fp32 ones on the very same weights, the bound of the fp16 comparison
        // (tests/worker/cuda/cuda_stage_test.cc). Otherwise the prompt's GEMMs run on FP8 tensor
        // cores with the activations quantized per token to E4M3 (half a step is a relative
        // 2^-4 per element), which the fp32 reference does not do: a looser bound.
        const double bound = invariant ? 1e-2 : 3e-2;
        for (size_t i = 0; i < want.size(); ++i) {
          EXPECT_LE(RelError(got[i], want[i]), bound)
              << "step " << i << " graphs " << graphs << " batch-invariant " << invariant;
        }
      }
    }
  }
}

// Quantized at load and read from the per-channel checkpoint: the same codes and scales on the
// device, so the same bits.
TEST(CudaStageFp8Test, QuantizedAtLoadEqualsThePerChannelCheckpointBitForBit) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device available";
  CudaOptions o;
  o.dtype = DType::kF16;
  auto a = MakeCudaStage(Spec(Model("none"), true), o);
  auto b = MakeCudaStage(Spec(Model("compressed-tensors"), false), o);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<std::vector<int32_t>> tokens;
  const auto x = RunSteps(**a, {}, &tokens);
  std::vector<std::vector<int32_t>> feed(tokens.begin(), tokens.end() - 1);
  EXPECT_EQ(RunSteps(**b, feed, nullptr), x);
}

}  // namespace
}  // namespace tandem
