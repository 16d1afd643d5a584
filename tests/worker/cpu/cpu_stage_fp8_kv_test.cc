// The CPU stage with an FP8 KV-cache (StageSpec::kv_cache_fp8) on every tiny preset, on shuffled
// 4-token pages: logits against a naive forward in double whose K and V go through the same
// E4M3 codes, and near the fp32 cache's; the checkpoint's scales used; KV moves between FP8
// stages that continue as if the sequence had not moved; blocks of another dtype or other scales
// refused naming both; and FP8 without pages refused.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/fp8_quantize.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/cpu/cpu_stage_testing.h"
#include "worker/cpu/cpu_stage.h"
#include "worker/kv_out.h"
#include "worker/kv_scales.h"

namespace tandem {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using namespace cpu_test;

constexpr int kPageSize = 4;
constexpr int kPages = 48;
constexpr int kMaxSeqLen = 64;

// A paged stage of layers [first, last) of `dir`, its KV-cache in FP8 or fp32.
std::unique_ptr<Stage> PagedStage(const std::filesystem::path& dir, int first, int last, bool fp8) {
  StageSpec spec;
  spec.model_dir = dir;
  spec.first_layer = first;
  spec.last_layer = last;
  spec.max_slots = 4;
  spec.max_seq_len = kMaxSeqLen;
  spec.kv_page_size = kPageSize;
  spec.kv_pages = kPages;
  spec.kv_cache_fp8 = fp8;
  absl::StatusOr<std::unique_ptr<Stage>> stage = MakeCpuStage(spec);
  EXPECT_TRUE(stage.ok()) << stage.status();
  return stage.ok() ? *std::move(stage) : nullptr;
}

// The pages of slot s: every fourth of a shuffled pool, so that no sequence's pages are adjacent
// or in order.
std::vector<std::vector<int32_t>> ShuffledPages() {
  std::vector<std::vector<int32_t>> pages(4);
  for (int i = 0; i < kPages; ++i) pages[i % 4].push_back((i * 7 + 5) % kPages);
  return pages;
}

// `step` with each row's block table from `pages` (by slot).
StepDescriptor OnPages(StepDescriptor step, const std::vector<std::vector<int32_t>>& pages) {
  for (SequenceStep& s : step.seqs) {
    const int needed = (s.position + s.num_tokens + kPageSize - 1) / kPageSize;
    s.block_table.assign(pages[s.slot].begin(), pages[s.slot].begin() + needed);
  }
  return step;
}

// The naive forward's K and V rounded as an FP8 KV-cache with `scales` (per model layer) stores
// and reads them: each element as a float through its code.
NaiveModel::KvRounding Fp8Rounding(std::vector<KvScales> scales) {
  return [scales = std::move(scales)](int layer, Vec& k, Vec& v) {
    const KvScales s = scales.at(layer);
    for (double& x : k) x = DecodeKvE4M3(EncodeKvE4M3(static_cast<float>(x), s.k), s.k);
    for (double& x : v) x = DecodeKvE4M3(EncodeKvE4M3(static_cast<float>(x), s.v), s.v);
  };
}

std::vector<KvScales> ScalesOf(const std::filesystem::path& dir) {
  std::unique_ptr<Checkpoint> ckpt = Checkpoint::Open(dir).value();
  return LoadKvScales(*ckpt, 0, ckpt->config().num_layers).value();
}

// The preset's checkpoint with KV-cache scales in it: per layer, none a power of two (which would
// only shift E4M3's range, not its grid), near what amax / 448 gives for these models' K and V.
std::filesystem::path ScaledModelDir(const std::string& preset) {
  const std::filesystem::path dir = ModelsRoot() / (preset + "-kv-scales");
  if (!std::filesystem::exists(dir / "config.json")) {
    // The same weights as ModelDir(preset): its files with the scales added.
    const std::filesystem::path plain = ModelDir(preset);
    const ModelConfig c = LoadModelConfig(plain).value();
    std::vector<std::pair<float, float>> scales;
    for (int l = 0; l < c.num_layers; ++l)
      scales.emplace_back(0.0093f * (l + 1), 0.0071f / (l + 1));
    std::filesystem::create_directories(dir);
    std::vector<TensorToWrite> tensors;
    {
      std::unique_ptr<Checkpoint> ckpt = Checkpoint::Open(plain).value();
      for (const std::string& n : ckpt->names()) {
        const TensorView t = ckpt->tensor(n).value();
        tensors.push_back({n, t.dtype, t.shape, {t.data.begin(), t.data.end()}});
      }
    }
    for (int l = 0; l < c.num_layers; ++l) {
      for (bool v : {false, true}) {
        const float value = v ? scales[l].second : scales[l].first;
        TensorToWrite t{.name = KvScaleTensorName(c.arch, l, v), .dtype = DType::kF32};
        t.bytes.resize(sizeof(float));
        std::memcpy(t.bytes.data(), &value, sizeof(float));
        tensors.push_back(std::move(t));
      }
    }
    EXPECT_TRUE(WriteSafetensors(dir / "model.safetensors", tensors).ok());
    for (const char* f : {"config.json", "tokenizer.json", "tokenizer_config.json"}) {
      if (std::filesystem::exists(plain / f)) std::filesystem::copy_file(plain / f, dir / f);
    }
  }
  return dir;
}

class CpuStageFp8KvTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void TearDownTestSuite() { std::filesystem::remove_all(ModelsRoot()); }
  std::filesystem::path dir() { return ModelDir(GetParam()); }
  int vocab() { return LoadModelConfig(dir())->vocab_size; }
  int layers() { return LoadModelConfig(dir())->num_layers; }
};

// Two sequences (30 tokens, past the tiny Mistral's and Qwen2's windows, and 3) prefilled and
// decoded 4 steps on two stages whose FP8 caches are shuffled 4-token pages, with the scales of 1
// and with the checkpoint's. Against the naive forward whose K and V go through the same codes
// the stage's logits differ by at most 8.7e-7 (relative to the largest logit) over every preset,
// step and sequence; the bound of 1e-4 leaves room for a value within float rounding of an E4M3
// tie, which may take the other code in one than in the other. Against the fp32 cache they
// differ by 2.8e-3 to 7.3e-2: FP8's error, which the bound of 0.15 keeps loose.
TEST_P(CpuStageFp8KvTest, MatchesANaiveForwardWhoseKAndVGoThroughTheSameCodes) {
  for (const std::filesystem::path& d : {dir(), ScaledModelDir(GetParam())}) {
    SCOPED_TRACE(d.filename().string());
    const int v = vocab();
    NaiveModel naive(d, Fp8Rounding(ScalesOf(d)));
    Pipeline fp8, fp32;
    for (bool f : {true, false}) {
      Pipeline& p = f ? fp8 : fp32;
      p.push_back(PagedStage(d, 0, 2, f));
      p.push_back(PagedStage(d, 2, layers(), f));
    }
    const auto pages = ShuffledPages();
    std::vector<std::vector<int32_t>> history = {Prompt(30, 8, v), Prompt(3, 9, v)};
    std::vector<Seq> seqs = {{0, 0, history[0]}, {3, 0, history[1]}};
    for (int step = 0; step < 4; ++step) {
      const StepDescriptor paged = OnPages(MakeStep(seqs), pages);
      const StepOutput out = RunPipeline(fp8, paged);
      const StepOutput out32 = RunPipeline(fp32, paged);
      ASSERT_EQ(out.tokens.size(), 2u);
      for (int i = 0; i < 2; ++i) {
        const std::vector<float> got = Row(out.logits, i, v);
        EXPECT_LE(RelDiff(got, naive.Logits(history[i]).back()), 1e-4)
            << "step " << step << " seq " << i;
        const double from_fp32 = RelDiff(got, Row(out32.logits, i, v));
        EXPECT_LE(from_fp32, 0.15) << "step " << step << " seq " << i;
        EXPECT_GE(from_fp32, 1e-3) << "step " << step << " seq " << i << ": not rounded to FP8?";
        seqs[i].position = static_cast<int32_t>(history[i].size());
        seqs[i].tokens = {out.tokens[i]};
        history[i].push_back(out.tokens[i]);
      }
    }
  }
}

// A checkpoint's scales are the stage's: its blocks carry them, and its logits are those of the
// naive forward rounding with them, not with scales of 1.
TEST_P(CpuStageFp8KvTest, TheCheckpointsScalesAreTheCaches) {
  const std::filesystem::path d = ScaledModelDir(GetParam());
  const std::vector<KvScales> scales = ScalesOf(d);
  ASSERT_NE(scales[0], KvScales{});
  const int v = vocab();
  std::unique_ptr<Stage> stage = PagedStage(d, 1, layers(), true);
  absl::StatusOr<KvBlock> none = stage->ExportKv(0, 1, 1, 1);
  EXPECT_FALSE(none.ok());  // nothing cached yet
  Pipeline p;
  p.push_back(PagedStage(d, 0, 1, true));
  p.push_back(std::move(stage));
  const std::vector<int32_t> prompt = Prompt(12, 3, v);
  const StepOutput out = RunPipeline(p, OnPages(MakeStep({{1, 0, prompt}}), ShuffledPages()));
  const std::vector<float> got = Row(out.logits, 0, v);
  EXPECT_LE(RelDiff(got, NaiveModel(d, Fp8Rounding(scales)).Logits(prompt).back()), 1e-4);
  const std::vector<KvScales> ones(scales.size());
  EXPECT_GE(RelDiff(got, NaiveModel(d, Fp8Rounding(ones)).Logits(prompt).back()), 1e-3);
  const std::vector<int32_t> table = ShuffledPages()[1];
  absl::StatusOr<KvBlock> b =
      p[1]->ExportKv(KvPlace(1, {table.begin(), table.begin() + 3}), 12, 2, layers() - 2);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->dtype, DType::kF8E4M3);
  EXPECT_EQ(b->expected_bytes(), size_t{12} * (layers() - 2) * p[1]->config().kv_dim());
  EXPECT_EQ(b->scales, std::vector<KvScales>(scales.begin() + 2, scales.end()));
}

// A sequence moved mid-generation between FP8 stages (its codes and scales exported from one
// stage's pages and imported into other pages of the two stages of a split pipeline, and back)
// continues there with the logits, bit for bit, it would have had where it was.
TEST_P(CpuStageFp8KvTest, AMovedSequenceContinuesWithTheLogitsItHadWhereItWas) {
  const std::filesystem::path d = ScaledModelDir(GetParam());
  const int v = vocab(), n = layers();
  const auto pages = ShuffledPages();
  Pipeline one, two;
  one.push_back(PagedStage(d, 0, n, true));
  two.push_back(PagedStage(d, 0, 2, true));
  two.push_back(PagedStage(d, 2, n, true));
  Seq a{1, 0, Prompt(9, 8, v)};
  for (int step = 0; step < 3; ++step) {
    const StepOutput o = RunPipeline(one, OnPages(MakeStep({a}), pages));
    a.position += static_cast<int32_t>(a.tokens.size());
    a.tokens = o.tokens;
  }
  // Layers [0, 2) and [2, n) from slot 1's pages of `from` into slot `to_slot`'s of `to`.
  auto move = [&](const Pipeline& from, int from_slot, Pipeline& to, int to_slot) {
    const int cached = a.position;
    const int count = (cached + kPageSize - 1) / kPageSize;
    const KvPlace src(from_slot, {pages[from_slot].begin(), pages[from_slot].begin() + count});
    const KvPlace dst(to_slot, {pages[to_slot].begin(), pages[to_slot].begin() + count});
    for (auto [first, last] : {std::pair{0, 2}, std::pair{2, n}}) {
      const Stage& s = *from[from.size() == 1 || first == 0 ? 0 : 1];
      Stage& t = *to[to.size() == 1 || first == 0 ? 0 : 1];
      absl::StatusOr<KvBlock> b = s.ExportKv(src, cached, first, last - first);
      ASSERT_TRUE(b.ok()) << b.status();
      ASSERT_EQ(b->dtype, DType::kF8E4M3);
      const absl::Status st = t.ImportKv(dst, *b);
      ASSERT_TRUE(st.ok()) << st;
    }
  };
  ASSERT_NO_FATAL_FAILURE(move(one, 1, two, 3));
  Seq moved = a;
  moved.slot = 3;
  for (int step = 0; step < 3; ++step) {
    const StepOutput x = RunPipeline(one, OnPages(MakeStep({a}), pages));
    const StepOutput y = RunPipeline(two, OnPages(MakeStep({moved}), pages));
    ASSERT_EQ(y.logits, x.logits) << "step " << step;
    a.position = moved.position += 1;
    a.tokens = moved.tokens = x.tokens;
  }
  ASSERT_NO_FATAL_FAILURE(move(two, 3, one, 2));
  Seq back = a;
  back.slot = 2;
  for (int step = 0; step < 3; ++step) {
    const StepOutput x = RunPipeline(one, OnPages(MakeStep({a}), pages));
    const StepOutput y = RunPipeline(one, OnPages(MakeStep({back}), pages));
    ASSERT_EQ(y.logits, x.logits) << "back, step " << step;
    a.position = back.position += 1;
    a.tokens = back.tokens = x.tokens;
  }
}

// A step's write-out of an FP8 stage holds the codes and scales its ExportKv gives.
TEST_P(CpuStageFp8KvTest, AWriteOutHoldsTheCodesAndScalesOfExport) {
  const std::filesystem::path d = ScaledModelDir(GetParam());
  std::unique_ptr<Stage> stage = PagedStage(d, 0, layers(), true);
  const std::vector<int32_t> pages = ShuffledPages()[2], table(pages.begin(), pages.begin() + 2);
  absl::StatusOr<std::shared_ptr<KvOut>> out = stage->OpenKvOut(KvPlace(2, table), 7);
  ASSERT_TRUE(out.ok()) << out.status();
  StepDescriptor step = MakeStep({{2, 0, Prompt(7, 4, vocab())}});
  step.seqs[0].block_table = table;
  ASSERT_TRUE(stage->Step(step, {}).ok());
  ASSERT_TRUE((*out)->AwaitAll(absl::Now()).ok());
  absl::StatusOr<KvBlock> exported = stage->ExportKv(KvPlace(2, table), 7, 0, layers());
  ASSERT_TRUE(exported.ok()) << exported.status();
  const KvBlock& b = (*out)->block();
  EXPECT_EQ(b.dtype, DType::kF8E4M3);
  EXPECT_EQ(b.scales, ScalesOf(d));
  EXPECT_EQ(b.k, exported->k);
  EXPECT_EQ(b.v, exported->v);
}

// A block of the fp32 cache into an FP8 stage and the other way, and a block of FP8 codes over
// other scales, are refused naming both sides; the stage is unchanged and goes on.
TEST_P(CpuStageFp8KvTest, BlocksOfAnotherDtypeOrOtherScalesAreRefusedNamingBoth) {
  const std::filesystem::path plain = dir(), scaled = ScaledModelDir(GetParam());
  const int v = vocab(), n = layers();
  const std::vector<int32_t> pages = ShuffledPages()[0], table(pages.begin(), pages.begin() + 2);
  const KvPlace place(0, table);
  StepDescriptor prompt = MakeStep({{0, 0, Prompt(6, 5, v)}});
  prompt.seqs[0].block_table = table;
  auto exported = [&](const std::filesystem::path& d, bool fp8) {
    std::unique_ptr<Stage> s = PagedStage(d, 0, n, fp8);
    EXPECT_TRUE(s->Step(prompt, {}).ok());
    absl::StatusOr<KvBlock> b = s->ExportKv(place, 6, 0, n);
    EXPECT_TRUE(b.ok()) << b.status();
    return *std::move(b);
  };
  const KvBlock f32 = exported(plain, false), codes = exported(plain, true),
                scaled_codes = exported(scaled, true);
  std::unique_ptr<Stage> fp8 = PagedStage(plain, 0, n, true), fp32 = PagedStage(plain, 0, n, false);
  absl::Status st = fp8->ImportKv(place, f32);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("dtype F32, this stage's KV-cache holds F8_E4M3"));
  st = fp32->ImportKv(place, codes);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("dtype F8_E4M3, this stage's KV-cache holds F32"));
  st = fp8->ImportKv(place, scaled_codes);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  const KvScales s0 = ScalesOf(scaled)[0], mine = ScalesOf(plain)[0];
  EXPECT_THAT(
      st.message(),
      AllOf(HasSubstr("layer 0 is F8_E4M3 codes of k_scale " + absl::StrFormat("%.9g", s0.k)),
            HasSubstr(absl::StrFormat(
                "this stage's KV-cache of that layer holds codes of k_scale %.9g, v_scale %.9g",
                mine.k, mine.v))));
  // Nothing was taken: the slot has no positions to continue from, and the right block goes in.
  EXPECT_FALSE(fp8->ExportKv(place, 6, 0, n).ok());
  ASSERT_TRUE(fp8->ImportKv(place, codes).ok());
  absl::StatusOr<KvBlock> back = fp8->ExportKv(place, 6, 0, n);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->k, codes.k);
  EXPECT_EQ(back->v, codes.v);
}

INSTANTIATE_TEST_SUITE_P(TinyPresets, CpuStageFp8KvTest,
                         ::testing::Values("tiny-gpt2", "tiny-llama", "tiny-llama-tied",
                                           "tiny-llama3", "tiny-mistral", "tiny-qwen2",
                                           "tiny-qwen2-window", "tiny-qwen3", "tiny-qwen3-tied",
                                           "tiny-gpt2-scaled", "tiny-openllama"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

class CpuStageFp8KvSpecTest : public ::testing::Test {
 protected:
  static void TearDownTestSuite() { std::filesystem::remove_all(ModelsRoot()); }
};

// FP8 needs the paged KV-cache; a stage asked for it without pages is refused naming both.
TEST_F(CpuStageFp8KvSpecTest, Fp8WithoutPagesIsRefused) {
  StageSpec spec;
  spec.model_dir = ModelDir("tiny-llama");
  spec.max_slots = 2;
  spec.max_seq_len = 16;
  spec.kv_cache_fp8 = true;
  absl::StatusOr<std::unique_ptr<Stage>> stage = MakeCpuStage(spec);
  EXPECT_EQ(stage.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(stage.status().message(),
              AllOf(HasSubstr("fp8_e4m3 needs the paged KV-cache"), HasSubstr("kv_page_size 0")));
}

// A bad scale tensor stops an FP8 stage, naming it; a stage of the model's dtype does not read
// the scales, and loads.
TEST_F(CpuStageFp8KvSpecTest, ABadScaleTensorIsRefusedNamingItWhereTheCacheIsFp8) {
  const std::filesystem::path dir = ModelsRoot() / "bad-kv-scale";
  absl::StatusOr<ModelConfig> c = PresetConfig("tiny-llama");
  ASSERT_TRUE(c.ok());
  GeneratorOptions o;
  o.kv_scales = {{0.5f, 0.25f}};
  ASSERT_TRUE(WriteRandomCheckpoint(*c, o, dir).ok());
  std::vector<TensorToWrite> tensors;
  {
    std::unique_ptr<Checkpoint> ckpt = Checkpoint::Open(dir).value();
    for (const std::string& n : ckpt->names()) {
      const TensorView t = ckpt->tensor(n).value();
      tensors.push_back({n, t.dtype, t.shape, {t.data.begin(), t.data.end()}});
      if (n == "model.layers.1.self_attn.v_scale")
        std::fill(tensors.back().bytes.begin(), tensors.back().bytes.end(), std::byte{0});
    }
  }
  ASSERT_TRUE(WriteSafetensors(dir / "model.safetensors", tensors).ok());
  StageSpec spec;
  spec.model_dir = dir;
  spec.max_slots = 2;
  spec.max_seq_len = 16;
  spec.kv_page_size = kPageSize;
  spec.kv_cache_fp8 = true;
  absl::StatusOr<std::unique_ptr<Stage>> stage = MakeCpuStage(spec);
  EXPECT_EQ(stage.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(stage.status().message(),
              AllOf(HasSubstr("tensor 'model.layers.1.self_attn.v_scale'"), HasSubstr("value 0")));
  spec.kv_cache_fp8 = false;
  EXPECT_TRUE(MakeCpuStage(spec).ok());
}

}  // namespace
}  // namespace tandem
