// The CUDA stage against the fp32 CPU stage on tiny random checkpoints: logits within fp16
// rounding, the same greedy tokens, batched steps, graph replay equal to direct launches, a
// pipeline split equal to one stage, and bad input. Skipped where no GPU is present.
#include "worker/cuda/cuda_stage.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "bench/decode_profile.h"
#include "common/rng.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/cuda/cuda_test_util.h"
#include "tools/model_generator.h"
#include "worker/cpu/cpu_stage.h"
#include "worker/kv_out.h"

namespace tandem {
namespace {

using cuda_test::RelError;
using cuda_test::TmpDir;

std::filesystem::path Checkpoint(const std::string& preset) {
  return cuda_test::PresetCheckpoint("cuda_stage_" + preset, preset, 7);
}

std::vector<int32_t> Prompt(int n, uint64_t seed, int vocab) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = static_cast<int32_t>(RandomBits(seed, i) % vocab);
  return p;
}

struct Seq {
  int slot;
  std::vector<int32_t> prompt;
};

// Runs prefill of every sequence in one step, then `steps` batched greedy decode steps fed with
// each stage's own tokens; returns tokens and logits of every step.
struct Trace {
  std::vector<std::vector<int32_t>> tokens;  // per step
  std::vector<std::vector<float>> logits;    // per step
};
// The prefill of every sequence in one step.
StepDescriptor PrefillStep(const std::vector<Seq>& seqs) {
  StepDescriptor pre;
  for (const Seq& s : seqs) {
    SequenceStep ss;
    ss.slot = s.slot;
    ss.num_tokens = static_cast<int>(s.prompt.size());
    pre.seqs.push_back(ss);
    pre.tokens.insert(pre.tokens.end(), s.prompt.begin(), s.prompt.end());
  }
  return pre;
}

// Decode step i (from 0) after that prefill: one token per sequence, `tokens` in their order.
StepDescriptor DecodeStep(const std::vector<Seq>& seqs, int i, std::vector<int32_t> tokens) {
  StepDescriptor d;
  d.id = i + 1;
  for (const Seq& s : seqs) {
    SequenceStep ss;
    ss.slot = s.slot;
    ss.position = static_cast<int>(s.prompt.size()) + i;
    ss.sample_index = i + 1;
    d.seqs.push_back(ss);
  }
  d.tokens = std::move(tokens);
  return d;
}

Trace RunSteps(Stage& stage, const std::vector<Seq>& seqs, int steps) {
  Trace t;
  StepDescriptor pre = PrefillStep(seqs);
  pre.return_logits = true;
  auto out = stage.Step(pre, Activations{});
  EXPECT_TRUE(out.ok()) << out.status();
  if (!out.ok()) return t;
  t.tokens.push_back(out->tokens);
  t.logits.push_back(out->logits);
  for (int i = 0; i < steps; ++i) {
    StepDescriptor d = DecodeStep(seqs, i, t.tokens.back());
    d.return_logits = true;
    auto o = stage.Step(d, Activations{});
    EXPECT_TRUE(o.ok()) << o.status();
    if (!o.ok()) return t;
    t.tokens.push_back(o->tokens);
    t.logits.push_back(o->logits);
  }
  return t;
}

// A step of one sequence: `n` tokens from `position` in `slot`.
StepDescriptor StepOf(int slot, int position, int n, std::vector<int32_t> tokens,
                      bool return_logits = false) {
  StepDescriptor d;
  d.return_logits = return_logits;
  SequenceStep s;
  s.slot = slot;
  s.position = position;
  s.num_tokens = n;
  d.seqs = {s};
  d.tokens = std::move(tokens);
  return d;
}

std::unique_ptr<Stage> MakeCudaWith(const std::filesystem::path& dir, const CudaOptions& o,
                                    int first = 0, int last = -1) {
  StageSpec spec;
  spec.model_dir = dir;
  spec.first_layer = first;
  spec.last_layer = last;
  spec.max_slots = 4;
  spec.max_seq_len = 128;
  auto s = MakeCudaStage(spec, o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

std::unique_ptr<Stage> MakeCuda(const std::filesystem::path& dir, DType dtype, bool graphs,
                                int first = 0, int last = -1, int gemv_max_rows = 8) {
  CudaOptions o;
  o.dtype = dtype;
  o.cuda_graphs = graphs;
  o.gemv_max_rows = gemv_max_rows;
  return MakeCudaWith(dir, o, first, last);
}

std::unique_ptr<Stage> MakeCpu(const std::filesystem::path& dir) {
  StageSpec spec;
  spec.model_dir = dir;
  spec.max_slots = 4;
  spec.max_seq_len = 128;
  auto s = MakeCpuStage(spec);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

class CudaStageVsCpu : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaStageVsCpu, SingleSequenceLogitsAndGreedyTokensMatchCpuInFp16) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  auto gpu = MakeCuda(dir, DType::kF16, true);
  auto cpu = MakeCpu(dir);
  ASSERT_TRUE(gpu && cpu);
  const std::vector<Seq> seqs = {{0, Prompt(20, 1, gpu->config().vocab_size)}};
  Trace g = RunSteps(*gpu, seqs, 24), c = RunSteps(*cpu, seqs, 24);
  ASSERT_EQ(g.logits.size(), c.logits.size());
  for (size_t i = 0; i < g.logits.size(); ++i) {
    EXPECT_LE(RelError(g.logits[i], c.logits[i]), 1e-2) << "step " << i;
  }
  EXPECT_EQ(g.tokens, c.tokens);
}

TEST_P(CudaStageVsCpu, BatchOfDifferentLengthsMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  auto gpu = MakeCuda(dir, DType::kF16, true);
  auto cpu = MakeCpu(dir);
  ASSERT_TRUE(gpu && cpu);
  const int v = gpu->config().vocab_size;
  // Three sequences (a decode bucket of 4 with one padding row), slots out of order.
  const std::vector<Seq> seqs = {{2, Prompt(5, 2, v)}, {0, Prompt(70, 3, v)}, {3, Prompt(9, 4, v)}};
  Trace g = RunSteps(*gpu, seqs, 12), c = RunSteps(*cpu, seqs, 12);
  ASSERT_EQ(g.logits.size(), c.logits.size());
  for (size_t i = 0; i < g.logits.size(); ++i) {
    EXPECT_LE(RelError(g.logits[i], c.logits[i]), 1e-2) << "step " << i;
  }
  EXPECT_EQ(g.tokens, c.tokens);
}

TEST_P(CudaStageVsCpu, Bf16StaysCloseToCpu) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  auto gpu = MakeCuda(dir, DType::kBF16, true);
  auto cpu = MakeCpu(dir);
  ASSERT_TRUE(gpu && cpu);
  const std::vector<Seq> seqs = {{1, Prompt(16, 5, gpu->config().vocab_size)}};
  Trace g = RunSteps(*gpu, seqs, 0), c = RunSteps(*cpu, seqs, 0);
  ASSERT_EQ(g.logits.size(), 1u);
  EXPECT_LE(RelError(g.logits[0], c.logits[0]), 5e-2);
}

TEST_P(CudaStageVsCpu, GraphReplayEqualsDirectLaunches) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  auto with = MakeCuda(dir, DType::kF16, true);
  auto without = MakeCuda(dir, DType::kF16, false);
  ASSERT_TRUE(with && without);
  // Every bucket of the 4 slots (1, 2, 4) is captured when the stage loads, so that no step
  // stalls for a capture; the steps below replay those graphs.
  EXPECT_EQ(with->DecodeGraphCount().value_or(-1), 3);
  EXPECT_EQ(without->DecodeGraphCount().value_or(-1), 0);
  const int v = with->config().vocab_size;
  const std::vector<Seq> seqs = {{0, Prompt(7, 6, v)}, {1, Prompt(11, 7, v)}, {2, Prompt(3, 8, v)}};
  Trace a = RunSteps(*with, seqs, 10), b = RunSteps(*without, seqs, 10);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.logits, b.logits);  // the same kernels on the same padded bucket: bit-identical
  // A second pass over the same slots replays the captured graphs.
  Trace a2 = RunSteps(*with, seqs, 10);
  EXPECT_EQ(a2.logits, b.logits);
}

// Greedy decode of a stage `a` against a reference stage `b` whose arithmetic differs by
// rounding: every step's logits within `bound` (RelError), and the same token in every sampled
// row where b's two best logits are further apart than twice the largest logit difference of the
// row (so the argmax cannot move). Where the gap is smaller (a near tie) the tokens may part; from
// then on the two stages decode different tokens, so the later steps are not compared.
void ExpectSameDecodeUpToNearTies(const Trace& a, const Trace& b, int vocab, double bound) {
  ASSERT_EQ(a.logits.size(), b.logits.size());
  ASSERT_EQ(a.tokens.size(), b.tokens.size());
  for (size_t i = 0; i < b.logits.size(); ++i) {
    ASSERT_EQ(a.logits[i].size(), b.logits[i].size()) << "step " << i;
    ASSERT_EQ(a.tokens[i].size(), b.tokens[i].size()) << "step " << i;
    ASSERT_EQ(b.logits[i].size(), b.tokens[i].size() * vocab) << "step " << i;
    EXPECT_LE(RelError(a.logits[i], b.logits[i]), bound) << "step " << i;
    for (size_t r = 0; r < b.tokens[i].size(); ++r) {
      const float* la = a.logits[i].data() + r * vocab;
      const float* lb = b.logits[i].data() + r * vocab;
      double diff = 0, top1 = -INFINITY, top2 = -INFINITY;
      for (int j = 0; j < vocab; ++j) {
        diff = std::max(diff, std::fabs(double(la[j]) - lb[j]));
        if (lb[j] > top1) {
          top2 = top1;
          top1 = lb[j];
        } else if (lb[j] > top2) {
          top2 = lb[j];
        }
      }
      if (top1 - top2 > 2 * diff) {
        EXPECT_EQ(a.tokens[i][r], b.tokens[i][r])
            << "step " << i << ", row " << r << ": top-2 gap " << top1 - top2
            << ", logits apart by at most " << diff;
      }
    }
    if (a.tokens[i] != b.tokens[i]) return;
  }
}

// Decode through the fused GEMV kernels (buckets 1, 2 and 4 here, norms folded) and through
// cuBLAS with separate norm, bias and activation kernels: logits equal within fp16 rounding, the
// same tokens but on near ties.
TEST_P(CudaStageVsCpu, GemvDecodeMatchesCublasDecode) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  auto gemv = MakeCuda(dir, DType::kF16, true, 0, -1, 8);
  auto cublas = MakeCuda(dir, DType::kF16, true, 0, -1, 0);
  ASSERT_TRUE(gemv && cublas);
  const int v = gemv->config().vocab_size;
  for (const std::vector<Seq>& seqs :
       {std::vector<Seq>{{0, Prompt(9, 11, v)}},
        std::vector<Seq>{{0, Prompt(4, 12, v)}, {1, Prompt(13, 13, v)}},
        std::vector<Seq>{{3, Prompt(6, 14, v)}, {1, Prompt(2, 15, v)}, {0, Prompt(30, 16, v)}}}) {
    Trace a = RunSteps(*gemv, seqs, 10), b = RunSteps(*cublas, seqs, 10);
    ExpectSameDecodeUpToNearTies(a, b, v, 5e-3);
  }
}

// Decode passes of at most 4 rows through the GEMV kernels (the QKV projection writing q and the
// KV-cache itself) against cuBLAS with the separate split/rotate kernel, in decode buckets 1, 2
// and 4, through graphs and direct launches alike; and a later pipeline stage (no embedding)
// agrees too. The bound (5e-3 relative on the logits) and the comparison of tokens only where the
// top-2 gap is clear leave room for a greedy token that flips on a near tie.
TEST_P(CudaStageVsCpu, GemvDecodeOfFourRowsMatchesCublasInGraphsDirectLaunchesAndLaterStages) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  auto probe = MakeCuda(dir, DType::kF16, true);
  ASSERT_TRUE(probe);
  const int v = probe->config().vocab_size;
  probe.reset();
  const double bound = 5e-3;
  for (bool graphs : {true, false}) {
    SCOPED_TRACE(graphs ? "graphs" : "direct launches");
    auto fused = MakeCuda(dir, DType::kF16, graphs, 0, -1, 4);
    auto plain = MakeCuda(dir, DType::kF16, graphs, 0, -1, 0);
    ASSERT_TRUE(fused && plain);
    for (const std::vector<Seq>& seqs :
         {std::vector<Seq>{{0, Prompt(9, 21, v)}},
          std::vector<Seq>{{1, Prompt(3, 22, v)}, {0, Prompt(17, 23, v)}},
          std::vector<Seq>{{3, Prompt(6, 24, v)}, {1, Prompt(2, 25, v)}, {0, Prompt(70, 26, v)}},
          std::vector<Seq>{{2, Prompt(1, 27, v)}}}) {
      SCOPED_TRACE(testing::Message() << seqs.size() << " sequences");
      Trace a = RunSteps(*fused, seqs, 12), b = RunSteps(*plain, seqs, 12);
      ExpectSameDecodeUpToNearTies(a, b, v, bound);
    }
  }
  // Two stages through the GEMV kernels against one through cuBLAS: a single-token prompt is a
  // GEMV-sized pass.
  auto first = MakeCuda(dir, DType::kF16, true, 0, 2, 4);
  auto second = MakeCuda(dir, DType::kF16, true, 2, -1, 4);
  auto whole = MakeCuda(dir, DType::kF16, true, 0, -1, 0);
  ASSERT_TRUE(first && second && whole);
  StepDescriptor step;
  step.return_logits = true;
  SequenceStep s;
  s.num_tokens = 1;
  step.seqs = {s};
  step.tokens = Prompt(1, 28, v);
  auto want = whole->Step(step, Activations{});
  ASSERT_TRUE(want.ok()) << want.status();
  auto mid = first->Step(step, Activations{});
  ASSERT_TRUE(mid.ok()) << mid.status();
  auto got = second->Step(step, mid->hidden);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameDecodeUpToNearTies(Trace{{got->tokens}, {got->logits}},
                               Trace{{want->tokens}, {want->logits}}, v, bound);
}

TEST_P(CudaStageVsCpu, TwoStagesGiveTheSameLogitsAsOne) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  auto whole = MakeCuda(dir, DType::kF16, true);
  auto first = MakeCuda(dir, DType::kF16, true, 0, 2);
  auto second = MakeCuda(dir, DType::kF16, true, 2, -1);
  ASSERT_TRUE(whole && first && second);
  const int v = whole->config().vocab_size;
  StepDescriptor step;
  step.return_logits = true;
  SequenceStep s;
  s.num_tokens = 13;
  step.seqs = {s};
  step.tokens = Prompt(13, 9, v);
  auto want = whole->Step(step, Activations{});
  ASSERT_TRUE(want.ok()) << want.status();
  auto mid = first->Step(step, Activations{});
  ASSERT_TRUE(mid.ok()) << mid.status();
  EXPECT_EQ(mid->hidden.where, Where::kDevice);
  EXPECT_EQ(mid->hidden.dtype, DType::kF16);
  EXPECT_EQ(mid->hidden.rows, 13);
  auto got = second->Step(step, mid->hidden);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_LE(RelError(got->logits, want->logits), 1e-3);
  EXPECT_EQ(got->tokens, want->tokens);

  // The same hidden states handed over as fp32 host memory (as from the CPU transport).
  std::vector<uint16_t> h(mid->hidden.rows * mid->hidden.cols);
  ASSERT_EQ(cudaMemcpy(h.data(), mid->hidden.data.get(), h.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  auto host = std::make_shared<std::vector<float>>(h.size());
  ToFloat(DType::kF16, h.data(), h.size(), host->data());
  Activations in;
  in.rows = mid->hidden.rows;
  in.cols = mid->hidden.cols;
  in.dtype = DType::kF32;
  in.where = Where::kHost;
  in.data = std::shared_ptr<void>(host, host->data());
  auto third = MakeCuda(dir, DType::kF16, true, 2, -1);
  ASSERT_TRUE(third);
  auto got2 = third->Step(step, in);
  ASSERT_TRUE(got2.ok()) << got2.status();
  EXPECT_EQ(got2->logits, got->logits);
}

// The first `positions` of slot `from_slot` of `from`, layers [first, last), exported and
// imported into slot `to_slot` of `to`.
void MoveKv(const Stage& from, int from_slot, Stage& to, int to_slot, int positions, int first,
            int last) {
  absl::StatusOr<KvBlock> block = from.ExportKv(from_slot, positions, first, last - first);
  ASSERT_TRUE(block.ok()) << block.status();
  const absl::Status imported = to.ImportKv(to_slot, *block);
  ASSERT_TRUE(imported.ok()) << imported;
}

// The same kept in device memory (ExportKvToDevice, for a move over NCCL): its bytes are those of
// the host export, and imported from device memory into another slot of another stage, the
// sequence continues with the same logits bit for bit. A block refused by the checks writes
// nothing; host memory posing as device memory is refused naming the device.
TEST_P(CudaStageVsCpu, KvKeptInDeviceMemoryContinuesWithTheSameLogits) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  auto whole = MakeCuda(dir, DType::kF16, true);
  auto other = MakeCuda(dir, DType::kF16, true);
  ASSERT_TRUE(whole && other);
  const int v = whole->config().vocab_size, layers = whole->config().num_layers;
  const std::vector<Seq> seqs = {{1, Prompt(13, 30, v)}};
  const Trace before = RunSteps(*whole, seqs, 2);  // 15 positions
  absl::StatusOr<KvBlock> dev = whole->ExportKvToDevice(1, 15, 0, layers);
  absl::StatusOr<KvBlock> host = whole->ExportKv(1, 15, 0, layers);
  ASSERT_TRUE(dev.ok() && host.ok()) << dev.status() << host.status();
  ASSERT_TRUE(dev->on_device());
  EXPECT_TRUE(dev->k.empty() && dev->v.empty());
  EXPECT_EQ(dev->bytes(), host->bytes());
  absl::StatusOr<KvBlock> back = KvBlockToHost(*dev);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->k, host->k);
  EXPECT_EQ(back->v, host->v);
  EXPECT_THAT(whole->ExportKvToDevice(1, 16, 0, layers).status().message(),
              ::testing::HasSubstr("holds 15 positions, asked for 16"));

  KvBlock posing = *dev;  // host memory where device memory should be
  posing.device_k = std::shared_ptr<uint8_t>(back->k.data(), [](uint8_t*) {});
  posing.device_v = std::shared_ptr<uint8_t>(back->v.data(), [](uint8_t*) {});
  EXPECT_THAT(other->ImportKv(2, posing).message(),
              ::testing::HasSubstr("this stage runs on device"));

  ASSERT_TRUE(other->ImportKv(2, *dev).ok());
  int32_t token = before.tokens.back()[0];
  for (int i = 2; i < 5; ++i) {
    StepDescriptor want_step = DecodeStep({{1, seqs[0].prompt}}, i, {token});
    StepDescriptor moved = DecodeStep({{2, seqs[0].prompt}}, i, {token});
    want_step.return_logits = moved.return_logits = true;
    auto a = whole->Step(want_step, Activations{});
    auto b = other->Step(moved, Activations{});
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    EXPECT_EQ(b->logits, a->logits) << "step " << i;
    token = a->tokens[0];
  }
}

// A sequence's KV-cache exported mid-generation continues, imported into another slot of a whole
// stage and (layer range by layer range) into another slot of a pipeline split at layer 2, with
// the logits it has where it was, bit for bit (the same kernels on the same values). The exported
// bytes are the CPU stage's block in fp16, laid out as KvBlock says.
TEST_P(CudaStageVsCpu, KvMovedToAnotherSlotAndLayoutContinuesWithTheSameLogits) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  auto whole = MakeCuda(dir, DType::kF16, true);
  auto other = MakeCuda(dir, DType::kF16, true);
  auto first = MakeCuda(dir, DType::kF16, true, 0, 2);
  auto second = MakeCuda(dir, DType::kF16, true, 2, -1);
  auto cpu = MakeCpu(dir);
  ASSERT_TRUE(whole && other && first && second && cpu);
  const int v = whole->config().vocab_size, layers = whole->config().num_layers;
  const std::vector<Seq> seqs = {{1, Prompt(13, 30, v)}};
  const Trace before = RunSteps(*whole, seqs, 2);  // prefill, then 2 decode steps: 15 positions
  ASSERT_EQ(before.tokens.size(), 3u);

  // The prompt's 13 positions as the CPU stage caches them (fp32).
  ASSERT_EQ(RunSteps(*cpu, seqs, 0).logits.size(), 1u);
  absl::StatusOr<KvBlock> want = cpu->ExportKv(1, 13, 0, layers);
  absl::StatusOr<KvBlock> got = whole->ExportKv(1, 13, 0, layers);
  ASSERT_TRUE(want.ok() && got.ok()) << want.status() << got.status();
  EXPECT_EQ(got->dtype, DType::kF16);
  EXPECT_EQ(got->first_layer, 0);
  EXPECT_EQ(got->num_layers, layers);
  EXPECT_EQ(got->num_kv_heads, whole->config().num_kv_heads);
  EXPECT_EQ(got->head_dim, whole->config().head_dim);
  EXPECT_EQ(got->positions, 13);
  ASSERT_EQ(got->k.size(), got->expected_bytes());
  const size_t n = want->k.size() / sizeof(float);
  ASSERT_EQ(got->k.size(), n * 2);
  std::vector<float> k(n), v16(n), want_k(n), want_v(n);
  ToFloat(DType::kF16, got->k.data(), n, k.data());
  ToFloat(DType::kF16, got->v.data(), n, v16.data());
  std::memcpy(want_k.data(), want->k.data(), n * sizeof(float));
  std::memcpy(want_v.data(), want->v.data(), n * sizeof(float));
  EXPECT_LE(RelError(k, want_k), 1e-2);
  EXPECT_LE(RelError(v16, want_v), 1e-2);

  ASSERT_NO_FATAL_FAILURE(MoveKv(*whole, 1, *other, 2, 15, 0, layers));
  ASSERT_NO_FATAL_FAILURE(MoveKv(*whole, 1, *first, 3, 15, 0, 2));
  ASSERT_NO_FATAL_FAILURE(MoveKv(*whole, 1, *second, 3, 15, 2, layers));
  int32_t token = before.tokens.back()[0];
  for (int i = 2; i < 6; ++i) {  // decode steps 2 to 5, at positions 15 to 18
    const StepDescriptor at1 = DecodeStep({{1, seqs[0].prompt}}, i, {token});
    StepDescriptor at2 = DecodeStep({{2, seqs[0].prompt}}, i, {token});
    StepDescriptor at3 = DecodeStep({{3, seqs[0].prompt}}, i, {token});
    StepDescriptor want_step = at1;
    want_step.return_logits = at2.return_logits = at3.return_logits = true;
    auto a = whole->Step(want_step, Activations{});
    auto b = other->Step(at2, Activations{});
    auto mid = first->Step(at3, Activations{});
    ASSERT_TRUE(a.ok() && b.ok() && mid.ok()) << a.status() << b.status() << mid.status();
    auto c = second->Step(at3, mid->hidden);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_EQ(a->tokens.size(), 1u);
    EXPECT_EQ(b->logits, a->logits) << "step " << i;
    EXPECT_EQ(c->logits, a->logits) << "step " << i;
    EXPECT_EQ(b->tokens, a->tokens) << "step " << i;
    EXPECT_EQ(c->tokens, a->tokens) << "step " << i;
    token = a->tokens[0];
  }
}

// The decode profile (a DecodeProfiler observing the stage, bench/decode_profile.h) counts the
// decode steps since it was last taken, splits each one's device time into its parts, and leaves
// the results as they were.
TEST_P(CudaStageVsCpu, DecodeProfileCountsStepsAndLeavesTheResults) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  CudaOptions o;
  absl::StatusOr<std::unique_ptr<DecodeProfiler>> profiler = DecodeProfiler::Create();
  ASSERT_TRUE(profiler.ok()) << profiler.status();
  auto plain = MakeCudaWith(dir, o);
  auto profiled = MakeCudaWith(dir, o);
  ASSERT_TRUE(plain && profiled);
  ASSERT_TRUE(profiled->SetDecodeObserver(profiler->get()).ok());
  const int v = plain->config().vocab_size;
  const std::vector<Seq> seqs = {{0, Prompt(13, 9, v)}, {2, Prompt(7, 4, v)}};
  const Trace want = RunSteps(*plain, seqs, 5);
  (*profiler)->Take();
  const Trace got = RunSteps(*profiled, seqs, 5);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.logits, want.logits);

  const CudaDecodeProfile taken = (*profiler)->Take();
  const CudaDecodeProfile* p = &taken;
  EXPECT_EQ(p->steps, 5);      // the prefill is not a decode step
  EXPECT_EQ(p->idle_gaps, 4);  // between consecutive decode steps
  EXPECT_GT(p->forward_ms, 0);
  EXPECT_LE(p->forward_ms, p->device_ms);
  EXPECT_LE(p->launched_ms, p->host_ms);
  const double parts = p->start_ms + p->first_layer_ms +
                       p->middle_layers_ms * (plain->config().num_layers - 2) + p->last_layer_ms +
                       p->head_ms;
  EXPECT_NEAR(parts, p->forward_ms, 1e-3 * p->steps + 1e-3 * p->forward_ms);
  const CudaDecodeProfile again = (*profiler)->Take();
  EXPECT_EQ(again.steps, 0);
  EXPECT_EQ(again.device_ms, 0);
  profiled.reset();  // before the profiler its graphs record into
}

// A decode tail (Stage::SetDecodeTail) runs once per decode step, after the forward pass is queued
// and before the stage waits: work it queues on the stage's stream (Stage::DeviceStream) sees the
// step's output, hidden rows on a first stage and every sequence's token on the last; an error it
// returns fails the step and leaves the stage usable; prefill steps do not call it.
TEST_P(CudaStageVsCpu, DecodeTailSeesTheStepsOutputOnTheStream) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  auto whole = MakeCuda(dir, DType::kF16, true);
  auto first = MakeCuda(dir, DType::kF16, true, 0, 2);
  auto plain = MakeCuda(dir, DType::kF16, true);
  ASSERT_TRUE(whole && first && plain);
  const int v = whole->config().vocab_size;
  const int hidden = whole->config().hidden_size;
  const std::vector<Seq> seqs = {{0, Prompt(13, 9, v)}, {2, Prompt(7, 4, v)}};

  int32_t* tokens_seen = nullptr;  // pinned, written by the stream
  uint16_t* hidden_seen = nullptr;
  ASSERT_EQ(cudaMallocHost(&tokens_seen, 4 * sizeof(int32_t)), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&hidden_seen, 2 * hidden * sizeof(uint16_t)), cudaSuccess);
  absl::StatusOr<void*> stream = whole->DeviceStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  int calls = 0;
  uint64_t last_id = 0;
  ASSERT_TRUE(whole
                  ->SetDecodeTail([&](const StepDescriptor& step, const Activations& h,
                                      const int32_t* device_tokens) -> absl::Status {
                    ++calls;
                    last_id = step.id;
                    EXPECT_EQ(h.data, nullptr);  // the last stage has no hidden output
                    EXPECT_NE(device_tokens, nullptr);
                    const cudaError_t e = cudaMemcpyAsync(
                        tokens_seen, device_tokens, step.seqs.size() * sizeof(int32_t),
                        cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(*stream));
                    return e == cudaSuccess ? absl::OkStatus() : absl::InternalError("copy");
                  })
                  .ok());
  const Trace want = RunSteps(*plain, seqs, 4);
  const Trace got = RunSteps(*whole, seqs, 4);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(calls, 4);  // the decode steps, not the prefill
  EXPECT_EQ(last_id, 4u);
  ASSERT_EQ(got.tokens.back().size(), 2u);
  EXPECT_EQ(std::vector<int32_t>(tokens_seen, tokens_seen + 2), got.tokens.back());

  // A failing tail fails its step; without the tail the next steps give the same tokens.
  ASSERT_TRUE(whole
                  ->SetDecodeTail([](const StepDescriptor&, const Activations&, const int32_t*) {
                    return absl::UnavailableError("gone");
                  })
                  .ok());
  const StepDescriptor d = DecodeStep(seqs, 0, want.tokens[0]);
  EXPECT_EQ(whole->Step(d, Activations{}).status().code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(whole->SetDecodeTail(nullptr).ok());
  const Trace again = RunSteps(*whole, seqs, 4);
  EXPECT_EQ(again.tokens, want.tokens);

  // A first stage's tail sees its hidden rows (device memory, in stream order).
  absl::StatusOr<void*> first_stream = first->DeviceStream();
  ASSERT_TRUE(first_stream.ok());
  ASSERT_TRUE(first
                  ->SetDecodeTail([&](const StepDescriptor& step, const Activations& h,
                                      const int32_t* device_tokens) -> absl::Status {
                    EXPECT_EQ(device_tokens, nullptr);
                    EXPECT_EQ(h.where, Where::kDevice);
                    EXPECT_EQ(h.rows, static_cast<int64_t>(step.seqs.size()));
                    EXPECT_EQ(h.cols, hidden);
                    const cudaError_t e = cudaMemcpyAsync(hidden_seen, h.data.get(), h.nbytes(),
                                                          cudaMemcpyDeviceToHost,
                                                          static_cast<cudaStream_t>(*first_stream));
                    return e == cudaSuccess ? absl::OkStatus() : absl::InternalError("copy");
                  })
                  .ok());
  ASSERT_TRUE(first->Step(PrefillStep(seqs), Activations{}).ok());
  auto out = first->Step(d, Activations{});
  ASSERT_TRUE(out.ok()) << out.status();
  std::vector<uint16_t> h(2 * hidden);
  ASSERT_EQ(cudaMemcpy(h.data(), out->hidden.data.get(), h.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(std::vector<uint16_t>(hidden_seen, hidden_seen + 2 * hidden), h);
  cudaFreeHost(tokens_seen);
  cudaFreeHost(hidden_seen);
}

// With a stream watch (Stage::SetStreamWatch) the stage polls it while waiting for its stream: an
// OK watch leaves the results as they were; an error fails the step once the stream has drained,
// and the stage stays usable. The stream is kept busy by a host function sleeping behind each
// decode step's forward pass (queued from a decode tail, so that the stage is waiting for it).
TEST_P(CudaStageVsCpu, StreamWatchIsPolledAndItsErrorFailsTheStep) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  auto plain = MakeCuda(dir, DType::kF16, true);
  auto watched = MakeCuda(dir, DType::kF16, true);
  ASSERT_TRUE(plain && watched);
  const int v = plain->config().vocab_size;
  const std::vector<Seq> seqs = {{0, Prompt(13, 9, v)}, {2, Prompt(7, 4, v)}};
  absl::StatusOr<void*> stream = watched->DeviceStream();
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE(watched
                  ->SetDecodeTail([&](const StepDescriptor&, const Activations&,
                                      const int32_t*) -> absl::Status {
                    const auto sleep = [](void*) {
                      std::this_thread::sleep_for(std::chrono::milliseconds(20));
                    };
                    return cudaLaunchHostFunc(static_cast<cudaStream_t>(*stream), sleep, nullptr) ==
                                   cudaSuccess
                               ? absl::OkStatus()
                               : absl::InternalError("cudaLaunchHostFunc");
                  })
                  .ok());
  int calls = 0;
  absl::Status verdict;
  ASSERT_TRUE(watched
                  ->SetStreamWatch([&] {
                    ++calls;
                    return verdict;
                  })
                  .ok());
  const Trace want = RunSteps(*plain, seqs, 3);
  const Trace got = RunSteps(*watched, seqs, 3);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.logits, want.logits);
  EXPECT_GE(calls, 3);  // each decode step waited 20 ms behind its sleep

  verdict = absl::UnavailableError("the next stage is gone");
  const absl::StatusOr<StepOutput> failed =
      watched->Step(DecodeStep(seqs, 3, want.tokens[3]), Activations{});
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  ASSERT_TRUE(watched->SetStreamWatch(nullptr).ok());
  ASSERT_TRUE(watched->SetDecodeTail(nullptr).ok());
  EXPECT_EQ(RunSteps(*watched, seqs, 3).tokens, want.tokens);
}

// Input that is still arriving (as NcclTransport::PostRecv hands it over): the stage queues its
// step behind `ready` on the device and reports `arrival`'s verdict; an error leaves it usable.
TEST_P(CudaStageVsCpu, InputStillArrivingIsWaitedForOnTheDevice) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  auto first = MakeCuda(dir, DType::kF16, true, 0, 2);
  auto second = MakeCuda(dir, DType::kF16, true, 2, -1);
  ASSERT_TRUE(first && second);
  const int v = first->config().vocab_size;
  auto prefill = [&](int slot) { return StepOf(slot, 0, 13, Prompt(13, 9, v), true); };
  auto decode = [](int slot) { return StepOf(slot, 13, 1, {5}, true); };
  // What the second stage gives for inputs that are there (slot 0).
  auto mid = first->Step(prefill(0), Activations{});
  ASSERT_TRUE(mid.ok()) << mid.status();
  const int64_t bytes = static_cast<int64_t>(mid->hidden.nbytes());
  std::vector<char> prefill_in(bytes);
  ASSERT_EQ(cudaMemcpy(prefill_in.data(), mid->hidden.data.get(), bytes, cudaMemcpyDeviceToHost),
            cudaSuccess);
  auto want_prefill = second->Step(prefill(0), mid->hidden);
  ASSERT_TRUE(want_prefill.ok()) << want_prefill.status();
  auto mid_decode = first->Step(decode(0), Activations{});
  ASSERT_TRUE(mid_decode.ok()) << mid_decode.status();
  std::vector<char> decode_in(mid_decode->hidden.nbytes());
  ASSERT_EQ(cudaMemcpy(decode_in.data(), mid_decode->hidden.data.get(), decode_in.size(),
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  auto want_decode = second->Step(decode(0), mid_decode->hidden);
  ASSERT_TRUE(want_decode.ok()) << want_decode.status();

  // The same inputs arriving 100 ms after the step is queued (slot 1): a buffer that holds zeros
  // until a side stream, after a host sleep, copies them in and records `ready`.
  cudaStream_t side = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  cudaEvent_t ready = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), cudaSuccess);
  void* raw = nullptr;
  ASSERT_EQ(cudaMalloc(&raw, bytes), cudaSuccess);
  std::shared_ptr<void> buf(raw, [](void* p) { cudaFree(p); });
  int asked = 0;
  auto late = [&](const std::vector<char>& host) {
    EXPECT_EQ(cudaMemsetAsync(buf.get(), 0, bytes, side), cudaSuccess);
    EXPECT_EQ(cudaLaunchHostFunc(
                  side, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(100)); },
                  nullptr),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpyAsync(buf.get(), host.data(), host.size(), cudaMemcpyHostToDevice, side),
              cudaSuccess);
    EXPECT_EQ(cudaEventRecord(ready, side), cudaSuccess);
    const int64_t rows = static_cast<int64_t>(host.size()) / (mid->hidden.cols * 2);
    Activations a{rows, mid->hidden.cols, DType::kF16, Where::kDevice, buf};
    a.ready = ready;
    a.arrival = [ready, &asked]() -> absl::StatusOr<absl::Time> {
      ++asked;
      if (cudaEventSynchronize(ready) != cudaSuccess) return absl::InternalError("event failed");
      return absl::Now();
    };
    return a;
  };
  auto got_prefill = second->Step(prefill(1), late(prefill_in));
  ASSERT_TRUE(got_prefill.ok()) << got_prefill.status();
  EXPECT_EQ(got_prefill->logits, want_prefill->logits);
  EXPECT_EQ(asked, 1);
  auto got_decode = second->Step(decode(1), late(decode_in));  // a graph replay
  ASSERT_TRUE(got_decode.ok()) << got_decode.status();
  EXPECT_EQ(got_decode->logits, want_decode->logits);
  EXPECT_EQ(asked, 2);

  // The transport's error is the step's (slot 2), and the stage goes on (slot 3).
  Activations lost = late(prefill_in);
  lost.arrival = [] { return absl::StatusOr<absl::Time>(absl::DataLossError("frame of step 7")); };
  auto failed = second->Step(prefill(2), lost);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss) << failed.status();
  auto after = second->Step(prefill(3), late(prefill_in));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->logits, want_prefill->logits);

  // A step the stage rejects still takes its input, so that the next step's is not taken for it.
  StepDescriptor bad = prefill(4);
  bad.seqs[0].slot = 99;
  asked = 0;
  EXPECT_EQ(second->Step(bad, late(prefill_in)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(asked, 1);
  EXPECT_EQ(cudaStreamSynchronize(side), cudaSuccess);
  cudaEventDestroy(ready);
  cudaStreamDestroy(side);
}

// Batch-invariant mode: a sequence's logits are bit for bit the same whether it runs alone or
// among other sequences of other lengths, first or in the middle of the batch, in batches that
// cross the GEMV/cuBLAS boundary of the default mode (2, 5 and 9 rows), prefill and decode, through
// graphs; two stages split anywhere give the same bits as one.
TEST_P(CudaStageVsCpu, BatchInvariantModeGivesASequenceTheSameBitsInAnyBatch) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  auto make = [&](int first, int last) {
    StageSpec spec;
    spec.model_dir = dir;
    spec.first_layer = first;
    spec.last_layer = last;
    spec.max_slots = 12;
    spec.max_seq_len = 128;
    CudaOptions o;
    o.dtype = DType::kF16;
    o.batch_invariant = true;
    auto st = MakeCudaStage(spec, o);
    EXPECT_TRUE(st.ok()) << st.status();
    return st.ok() ? std::move(*st) : nullptr;
  };
  auto stage = make(0, -1);
  ASSERT_TRUE(stage);
  const int v = stage->config().vocab_size;
  const std::vector<int32_t> a = Prompt(11, 40, v);
  const Trace alone = RunSteps(*stage, {{0, a}}, 10);
  ASSERT_EQ(alone.logits.size(), 11u);
  // The logits of the sequence at `index` of each step of `t`.
  auto of = [&](const Trace& t, int index) {
    std::vector<std::vector<float>> out;
    for (const auto& l : t.logits) {
      out.emplace_back(l.begin() + static_cast<size_t>(index) * v,
                       l.begin() + static_cast<size_t>(index + 1) * v);
    }
    return out;
  };
  for (int others : {1, 4, 8}) {
    for (int at : {0, others / 2}) {
      SCOPED_TRACE(::testing::Message() << others << " other sequences, ours at " << at);
      std::vector<Seq> batch;
      for (int i = 0; i < others; ++i) batch.push_back({i + 1, Prompt(3 + 7 * i, 50 + i, v)});
      batch.insert(batch.begin() + at, Seq{0, a});
      const Trace t = RunSteps(*stage, batch, 10);
      ASSERT_EQ(t.logits.size(), alone.logits.size());
      const auto ours = of(t, at);
      for (size_t step = 0; step < ours.size(); ++step) {
        EXPECT_EQ(ours[step], alone.logits[step]) << "step " << step;
        EXPECT_EQ(t.tokens[step][at], alone.tokens[step][0]) << "step " << step;
      }
    }
  }
  // Two stages, split after layer 1.
  auto first = make(0, 1), second = make(1, -1);
  ASSERT_TRUE(first && second);
  StepDescriptor step;
  step.return_logits = true;
  SequenceStep s;
  s.num_tokens = static_cast<int>(a.size());
  step.seqs = {s};
  step.tokens = a;
  auto mid = first->Step(step, Activations{});
  ASSERT_TRUE(mid.ok()) << mid.status();
  auto got = second->Step(step, mid->hidden);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->logits, alone.logits[0]);
}

// A prompt pass's last layer runs past its cache write only for the rows it samples. In
// batch-invariant mode, where a row's arithmetic does not depend on the other rows, a prompt cut
// into pieces that sample nothing until the last (their passes stop after the last layer's cache
// write) gives the same bits as the whole prompt among others.
TEST_P(CudaStageVsCpu, LastLayerOfTheSampledRowsOnlyKeepsTheBits) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  CudaOptions o;
  o.dtype = DType::kF16;
  o.batch_invariant = true;
  auto sampled_only = MakeCudaWith(dir, o);
  ASSERT_TRUE(sampled_only);
  const int v = sampled_only->config().vocab_size;
  const std::vector<Seq> seqs = {
      {0, Prompt(20, 61, v)}, {1, Prompt(5, 62, v)}, {2, Prompt(33, 63, v)}};
  const Trace b = RunSteps(*sampled_only, seqs, 4);
  ASSERT_EQ(b.logits.size(), 5u);

  // The third prompt again in slot 3, in pieces of 12, 1 and 20 tokens; only the last samples.
  const std::vector<int32_t>& p = seqs[2].prompt;
  int at = 0;
  for (int n : {12, 1, 20}) {
    StepDescriptor piece =
        StepOf(3, at, n, std::vector<int32_t>(p.begin() + at, p.begin() + at + n), true);
    piece.id = 100 + at;
    piece.seqs[0].sample = at + n == static_cast<int>(p.size());
    auto out = sampled_only->Step(piece, Activations{});
    ASSERT_TRUE(out.ok()) << out.status();
    at += n;
    if (!piece.seqs[0].sample) {
      EXPECT_TRUE(out->tokens.empty()) << "piece ending at " << at;
      continue;
    }
    ASSERT_EQ(out->logits.size(), static_cast<size_t>(v));
    EXPECT_EQ(out->logits, std::vector<float>(b.logits[0].begin() + 2 * static_cast<size_t>(v),
                                              b.logits[0].begin() + 3 * static_cast<size_t>(v)));
    EXPECT_EQ(out->tokens, std::vector<int32_t>{b.tokens[0][2]});
  }
}

// Decode steps launched ahead (LaunchDecode) run on the device behind the step before, their
// rows fed on the device from its samples, and give the tokens of steps run one at a time: the
// rows in another order every step (so a row's token comes from another row of the step before),
// one sequence sampled at a temperature, one skipping a step (then fed from the host).
TEST_P(CudaStageVsCpu, DecodeStepsLaunchedAheadGiveTheTokensOfStepsRunOneAtATime) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  auto ahead = MakeCuda(dir, DType::kF16, true);
  auto one_by_one = MakeCuda(dir, DType::kF16, true);
  ASSERT_TRUE(ahead && one_by_one);
  const int v = ahead->config().vocab_size;
  const std::vector<Seq> seqs = {
      {0, Prompt(9, 71, v)}, {1, Prompt(4, 72, v)}, {3, Prompt(17, 73, v)}};
  const StepDescriptor pre = PrefillStep(seqs);
  auto pa = ahead->Step(pre, Activations{});
  auto pb = one_by_one->Step(pre, Activations{});
  ASSERT_TRUE(pa.ok() && pb.ok());
  ASSERT_EQ(pa->tokens, pb->tokens);
  // Step i's rows: the sequences rotated by i; sequence 1 skips step 3.
  constexpr int kSteps = 8;
  std::vector<int> next_pos = {9, 4, 17};
  std::vector<int32_t> last(pb->tokens.begin(), pb->tokens.end());  // by sequence
  std::vector<StepDescriptor> steps;
  std::vector<std::vector<int32_t>> want;
  for (int i = 0; i < kSteps; ++i) {
    StepDescriptor d;
    d.id = i + 1;
    for (int k = 0; k < 3; ++k) {
      const int q = (k + i) % 3;
      if (q == 1 && i == 3) continue;
      SequenceStep s;
      s.slot = seqs[q].slot;
      s.position = next_pos[q]++;
      s.sample_index = i + 1;
      if (q == 2) s.sampling = {.temperature = 0.8f, .top_k = 20, .seed = 5};
      d.seqs.push_back(s);
      d.tokens.push_back(last[q]);
    }
    auto o = one_by_one->Step(d, Activations{});
    ASSERT_TRUE(o.ok()) << o.status();
    for (size_t r = 0; r < d.seqs.size(); ++r) {
      const int q = d.seqs[r].slot == 3 ? 2 : d.seqs[r].slot;
      last[q] = o->tokens[r];
    }
    want.push_back(o->tokens);
    steps.push_back(std::move(d));
  }
  // The same steps launched two at a time: each row whose slot the step before sampled takes
  // that row's token on the device (its given token is replaced by 0, which it must not read).
  std::vector<std::vector<int32_t>> got;
  for (int i = 0; i < kSteps; ++i) {
    StepDescriptor d = steps[i];
    std::vector<int> from_previous(d.seqs.size(), -1);
    if (i > 0) {
      for (size_t r = 0; r < d.seqs.size(); ++r) {
        for (size_t b = 0; b < steps[i - 1].seqs.size(); ++b) {
          if (steps[i - 1].seqs[b].slot == d.seqs[r].slot) from_previous[r] = static_cast<int>(b);
        }
        if (from_previous[r] >= 0) d.tokens[r] = 0;
      }
    }
    ASSERT_TRUE(ahead->CanLaunchDecode(d));
    ASSERT_TRUE(ahead->LaunchDecode(d, from_previous).ok()) << "step " << i;
    if (i > 0) {
      EXPECT_EQ(ahead->Step(steps[i], Activations{}).status().code(),
                absl::StatusCode::kFailedPrecondition);
      EXPECT_EQ(ahead->LaunchDecode(d, {}).code(), absl::StatusCode::kFailedPrecondition);
      auto o = ahead->FinishDecode();
      ASSERT_TRUE(o.ok()) << o.status();
      got.push_back(o->tokens);
    }
  }
  while (ahead->launched_decodes() > 0) {
    auto o = ahead->FinishDecode();
    ASSERT_TRUE(o.ok()) << o.status();
    got.push_back(o->tokens);
  }
  EXPECT_TRUE(ahead->DecodeDone());
  EXPECT_EQ(got, want);
  // Steps that return logits or take the host's sampling rule run one at a time.
  StepDescriptor logits = steps[0];
  logits.return_logits = true;
  EXPECT_FALSE(ahead->CanLaunchDecode(logits));
  StepDescriptor penalty = steps[0];
  penalty.seqs[0].sampling.presence_penalty = 0.5f;
  EXPECT_FALSE(ahead->CanLaunchDecode(penalty));
}

// Weights placed ahead (PlaceCudaWeights) or held by an earlier stage are taken instead of
// loaded, and a stage on them computes the same bits as one that loaded its own: the two halves
// of the model placed one after the other (only what lacks is placed each time), the halves of a
// pipeline on one stage's arena. Arenas of another dtype are not taken.
TEST_P(CudaStageVsCpu, PlacedWeightsAreTakenInsteadOfLoadedAndKeepTheBits) {
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint(GetParam());
  CudaOptions o;
  o.dtype = DType::kF16;
  o.batch_invariant = true;
  auto loaded = MakeCudaWith(dir, o);
  ASSERT_TRUE(loaded);
  const int n = loaded->config().num_layers;
  const int v = loaded->config().vocab_size;
  ASSERT_GE(n, 2);
  using Placed = std::vector<std::shared_ptr<const PlacedWeights>>;
  auto spec_of = [&](int first, int last, Placed placed) {
    StageSpec spec;
    spec.model_dir = dir;
    spec.first_layer = first;
    spec.last_layer = last;
    spec.max_slots = 4;
    spec.max_seq_len = 128;
    spec.placed = std::move(placed);
    return spec;
  };
  ASSERT_EQ(loaded->placed_weights().size(), 1u);
  EXPECT_EQ(loaded->placed_weights()[0]->first_layer(), 0);
  EXPECT_EQ(loaded->placed_weights()[0]->last_layer(), n);

  absl::StatusOr<std::shared_ptr<const PlacedWeights>> front =
      PlaceCudaWeights(spec_of(0, n / 2, {}), o);
  ASSERT_TRUE(front.ok()) << front.status();
  ASSERT_NE(*front, nullptr);
  EXPECT_EQ((*front)->first_layer(), 0);
  EXPECT_EQ((*front)->last_layer(), n / 2);
  absl::StatusOr<std::shared_ptr<const PlacedWeights>> back =
      PlaceCudaWeights(spec_of(0, -1, {*front}), o);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_NE(*back, nullptr);
  EXPECT_EQ((*back)->first_layer(), n / 2);
  EXPECT_EQ((*back)->last_layer(), n);
  absl::StatusOr<std::shared_ptr<const PlacedWeights>> none =
      PlaceCudaWeights(spec_of(0, -1, {*front, *back}), o);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, nullptr);
  EXPECT_FALSE(PlaceCudaWeights(spec_of(0, n + 1, {}), o).ok());

  const std::vector<Seq> seqs = {{0, Prompt(17, 71, v)}, {1, Prompt(6, 72, v)}};
  const Trace want = RunSteps(*loaded, seqs, 3);
  absl::StatusOr<std::unique_ptr<Stage>> halves = MakeCudaStage(spec_of(0, -1, {*front, *back}), o);
  ASSERT_TRUE(halves.ok()) << halves.status();
  EXPECT_EQ((*halves)->placed_weights(), (Placed{*front, *back}));
  const Trace got = RunSteps(**halves, seqs, 3);
  ASSERT_EQ(got.logits.size(), want.logits.size());
  for (size_t i = 0; i < got.logits.size(); ++i) {
    EXPECT_EQ(got.logits[i], want.logits[i]) << "step " << i;
  }
  EXPECT_EQ(got.tokens, want.tokens);

  // A pipeline of two stages on the whole model's arena against one of two loaded halves.
  StepDescriptor step = PrefillStep(seqs);
  step.return_logits = true;
  auto run_pipeline = [&](Stage& a, Stage& b) {
    auto mid = a.Step(step, Activations{});
    EXPECT_TRUE(mid.ok()) << mid.status();
    if (!mid.ok()) return std::vector<float>{};
    auto out = b.Step(step, mid->hidden);
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? out->logits : std::vector<float>{};
  };
  absl::StatusOr<std::unique_ptr<Stage>> first =
      MakeCudaStage(spec_of(0, n / 2, loaded->placed_weights()), o);
  absl::StatusOr<std::unique_ptr<Stage>> second =
      MakeCudaStage(spec_of(n / 2, -1, loaded->placed_weights()), o);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ((*first)->placed_weights(), loaded->placed_weights());
  EXPECT_EQ((*second)->placed_weights(), loaded->placed_weights());
  auto first_loaded = MakeCudaWith(dir, o, 0, n / 2);
  auto second_loaded = MakeCudaWith(dir, o, n / 2, -1);
  ASSERT_TRUE(first_loaded && second_loaded);
  const std::vector<float> taken = run_pipeline(**first, **second);
  EXPECT_FALSE(taken.empty());
  EXPECT_EQ(taken, run_pipeline(*first_loaded, *second_loaded));

  CudaOptions bf16 = o;
  bf16.dtype = DType::kBF16;
  absl::StatusOr<std::unique_ptr<Stage>> other =
      MakeCudaStage(spec_of(0, -1, loaded->placed_weights()), bf16);
  ASSERT_TRUE(other.ok()) << other.status();
  ASSERT_EQ((*other)->placed_weights().size(), 1u);
  EXPECT_NE((*other)->placed_weights()[0], loaded->placed_weights()[0]);
}

INSTANTIATE_TEST_SUITE_P(Presets, CudaStageVsCpu,
                         // The new families: llama3 rope scaling, a sliding window of 16
                         // (shorter than the prompts), q/k/v biases with a tied head, Qwen3's
                         // per-head q/k norm with head_dim != hidden / heads.
                         ::testing::Values("tiny-gpt2", "tiny-llama", "tiny-llama-tied",
                                           "tiny-llama3", "tiny-mistral", "tiny-qwen2",
                                           "tiny-qwen3", "tiny-qwen3-tied", "tiny-openllama"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n) ch = ch == '-' ? '_' : ch;
                           return n;
                         });

// A prompt's KV-cache written out as its step goes (a prefill worker's hand-off): in a prompt of
// two chunks, each layer is published in order while the step still runs (the slot does not hold
// the prompt yet), behind the last chunk's write of it, and the block in device memory then
// holds the bytes of a host export. A one-token prompt (a decode-sized pass) writes it out after
// its step.
TEST(CudaStageTest, AStepWritesItsKvCacheOutLayerByLayerAsItGoes) {
  SKIP_WITHOUT_GPU();
  absl::StatusOr<ModelConfig> c = PresetConfig("tiny-llama");
  ASSERT_TRUE(c.ok());
  c->max_positions = 2048;
  const std::filesystem::path dir = TmpDir() / ("cuda_stage_kv_out." + std::to_string(getpid()));
  ASSERT_TRUE(WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 5}, dir).ok());
  CudaOptions o;
  o.dtype = DType::kF16;
  o.prefill_rows = 1024;
  StageSpec spec;
  spec.model_dir = dir;
  spec.max_slots = 2;
  spec.max_seq_len = 2048;
  absl::StatusOr<std::unique_ptr<Stage>> made = MakeCudaStage(spec, o);
  ASSERT_TRUE(made.ok()) << made.status();
  Stage& stage = **made;
  const int layers = c->num_layers, n = 1500;  // rows [0, 1024), then [1024, 1500)
  absl::StatusOr<std::shared_ptr<KvOut>> out = stage.OpenKvOut(1, n);
  ASSERT_TRUE(out.ok()) << out.status();
  std::vector<int> order;
  (*out)->OnPublished([&](int layer) {
    order.push_back(layer);
    EXPECT_FALSE(stage.ExportKv(1, n, layer, 1).ok()) << "layer " << layer << " after the step";
  });
  std::vector<int32_t> prompt(n);
  for (int i = 0; i < n; ++i) prompt[i] = (31 * i + 7) % c->vocab_size;
  StepDescriptor step = StepOf(1, 0, n, prompt);
  step.seqs[0].sample = true;
  absl::StatusOr<StepOutput> ran = stage.Step(step, Activations{});
  ASSERT_TRUE(ran.ok()) << ran.status();
  std::vector<int> all(layers);
  for (int l = 0; l < layers; ++l) all[l] = l;
  EXPECT_EQ(order, all);
  ASSERT_TRUE((*out)->AwaitAll(absl::Now() + absl::Seconds(10)).ok());
  ASSERT_TRUE((*out)->block().on_device());
  absl::StatusOr<KvBlock> got = KvBlockToHost((*out)->block());
  absl::StatusOr<KvBlock> want = stage.ExportKv(1, n, 0, layers);
  ASSERT_TRUE(got.ok() && want.ok()) << got.status() << want.status();
  EXPECT_EQ(got->k, want->k);
  EXPECT_EQ(got->v, want->v);

  absl::StatusOr<std::shared_ptr<KvOut>> one = stage.OpenKvOut(0, 1);
  ASSERT_TRUE(one.ok()) << one.status();
  StepDescriptor single = StepOf(0, 0, 1, {3});
  single.seqs[0].sample = true;
  ASSERT_TRUE(stage.Step(single, Activations{}).ok());
  ASSERT_TRUE((*one)->AwaitAll(absl::Now() + absl::Seconds(10)).ok());
  got = KvBlockToHost((*one)->block());
  want = stage.ExportKv(0, 1, 0, layers);
  ASSERT_TRUE(got.ok() && want.ok()) << got.status() << want.status();
  EXPECT_EQ(got->k, want->k);
  EXPECT_EQ(got->v, want->v);
  std::filesystem::remove_all(dir);
}

TEST(CudaStageTest, KvCacheThatDoesNotFitFailsTheLoadNamingBytes) {
  SKIP_WITHOUT_GPU();
  StageSpec spec;
  spec.model_dir = Checkpoint("tiny-llama");
  spec.max_slots = 8;
  CudaOptions o;
  o.kv_memory_fraction = 1e-9f;
  auto s = MakeCudaStage(spec, o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.status().message()),
              ::testing::AllOf(::testing::HasSubstr("KV-cache"), ::testing::HasSubstr("bytes")));
}

TEST(CudaStageTest, RejectsFp32AndBadKvFraction) {
  SKIP_WITHOUT_GPU();
  StageSpec spec;
  spec.model_dir = Checkpoint("tiny-llama");
  CudaOptions o;
  o.dtype = DType::kF32;
  EXPECT_EQ(MakeCudaStage(spec, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.dtype = DType::kF16;
  o.kv_memory_fraction = 0.0f;
  EXPECT_EQ(MakeCudaStage(spec, o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaStageTest, DeviceCapabilitiesOfAHostStageAreUnimplemented) {
  auto cpu = MakeCpu(Checkpoint("tiny-llama"));
  ASSERT_TRUE(cpu);
  EXPECT_EQ(cpu->SetDecodeObserver(nullptr).code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(cpu->DecodeGraphCount().status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(cpu->DeviceStream().status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(cpu->SetDecodeTail(nullptr).code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(cpu->SetStreamWatch(nullptr).code(), absl::StatusCode::kUnimplemented);
}

TEST(CudaStageTest, MissingCheckpointFailsTheLoad) {
  SKIP_WITHOUT_GPU();
  StageSpec spec;
  spec.model_dir = TmpDir() / "no_such_model";
  EXPECT_FALSE(MakeCudaStage(spec, CudaOptions{}).ok());
}

TEST(CudaStageTest, BadStepsAreRejectedAndTheStageStaysUsable) {
  SKIP_WITHOUT_GPU();
  auto stage = MakeCuda(Checkpoint("tiny-llama"), DType::kF16, true);
  ASSERT_TRUE(stage);
  EXPECT_EQ(stage->Step(StepOf(9, 0, 1, {1}), {}).status().code(),
            absl::StatusCode::kInvalidArgument);  // slot
  EXPECT_EQ(stage->Step(StepOf(0, 5, 1, {1}), {}).status().code(),
            absl::StatusCode::kInvalidArgument);  // position past the cache
  EXPECT_EQ(stage->Step(StepOf(0, 127, 2, {1, 2}), {}).status().code(),
            absl::StatusCode::kInvalidArgument);  // past the context
  EXPECT_EQ(stage->Step(StepOf(0, 0, 1, {100000}), {}).status().code(),
            absl::StatusCode::kInvalidArgument);  // token id
  EXPECT_EQ(stage->Step(StepOf(0, 0, 2, {1}), {}).status().code(),
            absl::StatusCode::kInvalidArgument);  // token count
  StepDescriptor bad_sampling = StepOf(0, 0, 1, {1});
  bad_sampling.seqs[0].sampling.top_p = 0.0f;
  EXPECT_EQ(stage->Step(bad_sampling, {}).status().code(), absl::StatusCode::kInvalidArgument);
  auto ok = stage->Step(StepOf(0, 0, 3, {1, 2, 3}), {});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->tokens.size(), 1u);
}

TEST(CudaStageTest, LaterStageRejectsMismatchedInput) {
  SKIP_WITHOUT_GPU();
  auto stage = MakeCuda(Checkpoint("tiny-llama"), DType::kF16, true, 2, -1);
  ASSERT_TRUE(stage);
  StepDescriptor d;
  SequenceStep s;
  s.num_tokens = 2;
  d.seqs = {s};
  auto buf = std::make_shared<std::vector<float>>(2 * 64);
  Activations in{2, 32, DType::kF32, Where::kHost, std::shared_ptr<void>(buf, buf->data())};
  EXPECT_EQ(stage->Step(d, in).status().code(), absl::StatusCode::kInvalidArgument);
  in.cols = 64;
  in.dtype = DType::kBF16;
  in.where = Where::kDevice;
  EXPECT_EQ(stage->Step(d, in).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaStageTest, LongPrefillRunsInChunksLikeShortOnes) {
  SKIP_WITHOUT_GPU();
  // More rows than one forward pass holds (1024): 5 sequences of about 250 tokens, chunked.
  const auto dir = Checkpoint("tiny-gpt2");
  StageSpec spec;
  spec.model_dir = dir;
  spec.max_slots = 8;
  spec.max_seq_len = 256;
  CudaOptions options;
  options.prefill_rows = 1024;
  auto gpu = MakeCudaStage(spec, options);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto cpu = MakeCpuStage(spec);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::vector<Seq> seqs;
  for (int i = 0; i < 5; ++i) seqs.push_back({i, Prompt(250 + i, 20 + i, 512)});
  Trace g = RunSteps(**gpu, seqs, 2), c = RunSteps(**cpu, seqs, 2);
  ASSERT_EQ(g.logits.size(), c.logits.size());
  for (size_t i = 0; i < g.logits.size(); ++i) {
    EXPECT_LE(RelError(g.logits[i], c.logits[i]), 1e-2) << "step " << i;
  }
  EXPECT_EQ(g.tokens, c.tokens);
}

// Every field of a KV block that does not fit the stage is refused naming it, and nothing is
// written: the slot it was aimed at goes on with its own sequence, bit for bit as elsewhere.
TEST(CudaStageTest, KvBlocksThatDoNotFitAreRejectedAndNothingIsWritten) {
  using ::testing::HasSubstr;
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint("tiny-llama");
  auto src = MakeCuda(dir, DType::kF16, true);
  auto dst = MakeCuda(dir, DType::kF16, true);
  ASSERT_TRUE(src && dst);
  const int v = src->config().vocab_size, layers = src->config().num_layers;
  const std::vector<int32_t> a = Prompt(20, 40, v), b = Prompt(9, 41, v);
  ASSERT_TRUE(src->Step(StepOf(0, 0, 20, a), {}).ok());  // sequence a, the block's
  ASSERT_TRUE(src->Step(StepOf(1, 0, 9, b), {}).ok());   // sequence b undisturbed
  ASSERT_TRUE(dst->Step(StepOf(0, 0, 9, b), {}).ok());   // sequence b, under the bad blocks
  absl::StatusOr<KvBlock> good = src->ExportKv(0, 20, 0, layers);
  ASSERT_TRUE(good.ok()) << good.status();
  auto expect_refused = [&](KvBlock block, int slot, const std::string& what) {
    const absl::Status s = dst->ImportKv(slot, block);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(s.message(), HasSubstr(what));
  };
  KvBlock bad = *good;
  bad.version = 2;
  expect_refused(bad, 0, "version 2");
  expect_refused(*good, 4, "slot 4");
  bad = *good;
  bad.dtype = DType::kBF16;
  expect_refused(bad, 0, "dtype BF16");
  bad = *good;
  bad.num_kv_heads += 1;
  expect_refused(bad, 0, "KV heads");
  bad = *good;
  bad.head_dim *= 2;
  expect_refused(bad, 0, "KV heads of");
  bad = *good;
  bad.first_layer = 1;
  expect_refused(bad, 0, "layers [1, 5)");
  bad = *good;
  bad.num_layers = 0;
  expect_refused(bad, 0, "layers [0, 0)");
  bad = *good;
  bad.positions = 129;  // past the stage's 128
  expect_refused(bad, 0, "129 positions");
  bad = *good;
  bad.v.pop_back();
  expect_refused(bad, 0, "bytes of K");
  bad = *good;
  bad.k.push_back(0);
  expect_refused(bad, 0, "bytes of K");

  // Slot 0 still holds b's 9 positions only (a step at a's 20 is refused) and b's values.
  EXPECT_EQ(dst->Step(StepOf(0, 20, 1, {5}), {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto want_b = src->Step(StepOf(1, 9, 1, {5}, true), {});
  auto got_b = dst->Step(StepOf(0, 9, 1, {5}, true), {});
  ASSERT_TRUE(want_b.ok() && got_b.ok()) << want_b.status() << got_b.status();
  EXPECT_EQ(got_b->logits, want_b->logits);
  // The good block is taken, into another slot, which then continues a.
  ASSERT_TRUE(dst->ImportKv(2, *good).ok());
  auto want_a = src->Step(StepOf(0, 20, 1, {5}, true), {});
  auto got_a = dst->Step(StepOf(2, 20, 1, {5}, true), {});
  ASSERT_TRUE(want_a.ok() && got_a.ok()) << want_a.status() << got_a.status();
  EXPECT_EQ(got_a->logits, want_a->logits);
}

// An export names what the stage does not hold: positions past the slot's, a slot out of range,
// layers outside the stage's.
TEST(CudaStageTest, KvExportOfWhatTheStageDoesNotHoldIsRefused) {
  using ::testing::HasSubstr;
  SKIP_WITHOUT_GPU();
  const auto dir = Checkpoint("tiny-llama");
  auto whole = MakeCuda(dir, DType::kF16, true);
  auto second = MakeCuda(dir, DType::kF16, true, 2, -1);
  ASSERT_TRUE(whole && second);
  ASSERT_TRUE(whole->Step(StepOf(0, 0, 20, Prompt(20, 42, whole->config().vocab_size)), {}).ok());
  auto refused = [](const absl::StatusOr<KvBlock>& b, const std::string& what) {
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(b.status().message(), HasSubstr(what));
  };
  refused(whole->ExportKv(0, 21, 0, 4), "slot 0 holds 20 positions, asked for 21");
  refused(whole->ExportKv(0, 0, 0, 4), "asked for 0");
  refused(whole->ExportKv(1, 1, 0, 4), "slot 1 holds 0 positions");
  refused(whole->ExportKv(4, 20, 0, 4), "slot 4");
  refused(whole->ExportKv(0, 20, 1, 4), "layers [1, 5)");
  refused(second->ExportKv(0, 1, 0, 2), "layers [0, 2) are not within this stage's [2, 4)");
  absl::StatusOr<KvBlock> all = whole->ExportKv(0, 20, 0, 4);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->k.size(), size_t{4} * 20 * whole->config().kv_dim() * 2);
}

}  // namespace
}  // namespace tandem
