// LoadKvScales: an FP8 KV-cache's per-layer scales from the checkpoint's k_scale and v_scale
// tensors (as tandem-make-model --kv_scales writes them), 1 where it has none, and a scale
// tensor that is not one finite number > 0, or that has no partner, refused naming it. The
// weights' loader takes a checkpoint that holds them.
#include "worker/kv_scales.h"

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tools/model_generator.h"
#include "worker/weights.h"

namespace tandem {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

namespace fs = std::filesystem;

fs::path Dir(const std::string& name) {
  return fs::path(TANDEM_TEST_TMPDIR) / ("kv_scales_test_" + std::to_string(getpid())) / name;
}

// The preset's checkpoint with `scales` (tandem-make-model --kv_scales) in folder `name`.
fs::path Checkpointed(const std::string& name, const std::string& preset,
                      std::vector<std::pair<float, float>> scales) {
  const fs::path dir = Dir(name);
  absl::StatusOr<ModelConfig> c = PresetConfig(preset);
  EXPECT_TRUE(c.ok()) << c.status();
  GeneratorOptions o;
  o.seed = 7;
  o.kv_scales = std::move(scales);
  const absl::Status st = WriteRandomCheckpoint(*c, o, dir);
  EXPECT_TRUE(st.ok()) << st;
  return dir;
}

// Rewrites the single-file checkpoint in `dir` with tensor `name` replaced by `with` (or left out
// where `with` has no name).
void Rewrite(const fs::path& dir, const std::string& name, const TensorToWrite& with) {
  std::vector<TensorToWrite> tensors;
  {
    std::unique_ptr<Checkpoint> ckpt = Checkpoint::Open(dir).value();
    for (const std::string& n : ckpt->names()) {
      if (n == name) {
        if (!with.name.empty()) tensors.push_back(with);
        continue;
      }
      const TensorView t = ckpt->tensor(n).value();
      tensors.push_back({n, t.dtype, t.shape, {t.data.begin(), t.data.end()}});
    }
  }
  ASSERT_TRUE(WriteSafetensors(dir / "model.safetensors", tensors).ok());
}

TensorToWrite F32(const std::string& name, std::vector<int64_t> shape, std::vector<float> values) {
  TensorToWrite t{.name = name, .dtype = DType::kF32, .shape = std::move(shape)};
  t.bytes.resize(values.size() * sizeof(float));
  std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

absl::StatusOr<std::vector<KvScales>> Load(const fs::path& dir, int first, int last) {
  std::unique_ptr<Checkpoint> ckpt = Checkpoint::Open(dir).value();
  return LoadKvScales(*ckpt, first, last);
}

class KvScalesTest : public ::testing::Test {
 protected:
  static void TearDownTestSuite() { fs::remove_all(Dir("")); }
};

TEST_F(KvScalesTest, WithoutScaleTensorsEveryLayerHasScaleOne) {
  const fs::path dir = Checkpointed("none", "tiny-llama", {});
  absl::StatusOr<std::vector<KvScales>> s = Load(dir, 1, 4);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT(*s, ElementsAre(KvScales{1, 1}, KvScales{1, 1}, KvScales{1, 1}));
}

TEST_F(KvScalesTest, TheCheckpointsScalesOfTheStagesLayersInOrder) {
  const fs::path dir =
      Checkpointed("per_layer", "tiny-llama", {{0.5f, 0.25f}, {2, 4}, {0.125f, 3}, {6, 0.0625f}});
  absl::StatusOr<std::vector<KvScales>> s = Load(dir, 1, 3);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT(*s, ElementsAre(KvScales{2, 4}, KvScales{0.125f, 3}));
  s = Load(dir, 0, 4);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT(*s, ElementsAre(KvScales{0.5f, 0.25f}, KvScales{2, 4}, KvScales{0.125f, 3},
                              KvScales{6, 0.0625f}));
  // GPT-2's are under its "attn" module; stored as [1] they read the same as [].
  const fs::path gpt2 = Checkpointed("gpt2", "tiny-gpt2", {{0.5f, 0.25f}});
  Rewrite(gpt2, "transformer.h.1.attn.v_scale", F32("transformer.h.1.attn.v_scale", {1}, {8}));
  s = Load(gpt2, 0, 2);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT(*s, ElementsAre(KvScales{0.5f, 0.25f}, KvScales{0.5f, 8}));
}

// The weights' loader does not take the scales for tensors the model does not use.
TEST_F(KvScalesTest, TheWeightsOfACheckpointWithScalesLoad) {
  for (const char* preset : {"tiny-llama", "tiny-gpt2"}) {
    const fs::path dir = Checkpointed(std::string("weights_") + preset, preset, {{0.5f, 0.25f}});
    std::unique_ptr<Checkpoint> ckpt = Checkpoint::Open(dir).value();
    absl::StatusOr<StageSources> w = FindStageWeights(*ckpt, 1, 2);
    EXPECT_TRUE(w.ok()) << preset << ": " << w.status();
  }
}

TEST_F(KvScalesTest, AScaleThatIsNotOneFiniteNumberAboveZeroIsRefusedNamingIt) {
  const std::string name = "model.layers.2.self_attn.k_scale";
  struct Bad {
    TensorToWrite tensor;
    const char* why;
  };
  const std::vector<Bad> bad = {
      {F32(name, {}, {0.0f}), "value 0"},
      {F32(name, {}, {-0.5f}), "value -0.5"},
      {F32(name, {}, {std::nanf("")}), "value nan"},
      {F32(name, {}, {INFINITY}), "value inf"},
      {F32(name, {2}, {1, 1}), "shape [2], expected [] or [1]"},
      {F32(name, {1, 1}, {1}), "shape [1, 1], expected [] or [1]"},
      {{.name = name, .dtype = DType::kF8E4M3, .shape = {}, .bytes = {std::byte{0x38}}},
       "dtype F8_E4M3, expected F32, F16 or BF16"},
  };
  for (const Bad& b : bad) {
    const fs::path dir = Checkpointed("bad", "tiny-llama", {{0.5f, 0.25f}});
    Rewrite(dir, name, b.tensor);
    absl::StatusOr<std::vector<KvScales>> s = Load(dir, 0, 4);
    ASSERT_FALSE(s.ok()) << b.why;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.status().message(),
                AllOf(HasSubstr("tensor '" + name + "'"), HasSubstr(b.why),
                      HasSubstr("a KV-cache scale is one finite number > 0")));
    // A stage without that layer does not read it.
    EXPECT_TRUE(Load(dir, 0, 2).ok()) << b.why;
  }
}

TEST_F(KvScalesTest, AScaleWithoutItsPartnersIsRefusedNamingTheMissingOne) {
  const fs::path dir = Checkpointed("partner", "tiny-llama", {{0.5f, 0.25f}});
  Rewrite(dir, "model.layers.3.self_attn.v_scale", {});
  for (auto [first, last] : {std::pair{0, 1}, std::pair{3, 4}}) {
    absl::StatusOr<std::vector<KvScales>> s = Load(dir, first, last);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.status().message(),
                HasSubstr("but not 'model.layers.3.self_attn.v_scale': a checkpoint with KV-cache "
                          "scales has k_scale and v_scale for every layer"));
  }
}

TEST_F(KvScalesTest, ALayerRangeOutsideTheModelIsRefused) {
  const fs::path dir = Checkpointed("range", "tiny-llama", {});
  for (auto [first, last] : {std::pair{-1, 2}, std::pair{2, 5}, std::pair{2, 2}}) {
    absl::StatusOr<std::vector<KvScales>> s = Load(dir, first, last);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << first << " " << last;
  }
}

}  // namespace
}  // namespace tandem
