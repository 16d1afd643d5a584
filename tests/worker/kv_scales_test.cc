// LoadKvScales: an FP8 KV-cache's per-layer scales from the checkpoint's k_scale and v_scale
// tensors (as tandem-make-model --kv_scales writes them), computed from the weights where it has
// none, and a scale
// tensor that is not one finite number > 0, or that has no partner, refused naming it. The
// weights' loader takes a checkpoint that holds them.
#include "worker/kv_scales.h"

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
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

// The RMS of layer `l`'s K (v: V) for `samples` random inputs pushed through the layer's
// attention norm and projection (and Qwen3's k_norm): what EstimateKvScales predicts from the
// weights alone.
double MeasuredRms(const ModelConfig& c, const LayerWeights& w, bool v, int samples) {
  const int in = c.hidden_size, hd = c.head_dim;
  const int row0 = c.q_dim() + (v ? c.kv_dim() : 0);
  std::mt19937 gen(11);
  std::normal_distribution<double> normal;
  double sum = 0;
  for (int n = 0; n < samples; ++n) {
    std::vector<double> z(in);
    double mean = 0, ms = 0;
    for (double& x : z) x = normal(gen);
    for (double x : z) mean += x / in;
    const bool layer_norm = !w.attn_norm_b.empty();
    for (double& x : z) {
      if (layer_norm) x -= mean;
      ms += x * x / in;
    }
    std::vector<double> x(in);
    for (int i = 0; i < in; ++i) {
      x[i] = z[i] / std::sqrt(ms) * w.attn_norm_w[i] + (layer_norm ? w.attn_norm_b[i] : 0.0);
    }
    std::vector<double> out(c.kv_dim());
    for (int j = 0; j < c.kv_dim(); ++j) {
      double a = w.bqkv.empty() ? 0.0 : w.bqkv[row0 + j];
      for (int i = 0; i < in; ++i) a += double(w.wqkv[size_t(row0 + j) * in + i]) * x[i];
      out[j] = a;
    }
    if (!v && !w.k_norm_w.empty()) {
      for (int h = 0; h < c.num_kv_heads; ++h) {
        double hs = 0;
        for (int d = 0; d < hd; ++d) hs += out[h * hd + d] * out[h * hd + d] / hd;
        for (int d = 0; d < hd; ++d) out[h * hd + d] *= w.k_norm_w[d] / std::sqrt(hs);
      }
    }
    for (double o : out) sum += o * o;
  }
  return std::sqrt(sum / (double(samples) * c.kv_dim()));
}

// Without scale tensors the scales are computed from the weights: the RMS of K and V over
// random inputs is kKvRmsInCodes times the scale, within sampling, for RMSNorm (Llama, GQA),
// LayerNorm with biases (GPT-2) and Qwen3's k_norm. (A scale left at 1, or the norm's weight
// left out of the estimate, is off by far more: tiny models' K and V have RMS well below 1.)
TEST_F(KvScalesTest, WithoutScaleTensorsTheScalesAreThoseOfTheWeights) {
  for (const char* preset : {"tiny-llama", "tiny-gpt2", "tiny-qwen3"}) {
    SCOPED_TRACE(preset);
    const fs::path dir = Checkpointed(std::string("none-") + preset, preset, {});
    absl::StatusOr<std::vector<KvScales>> s = Load(dir, 1, 3);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_EQ(s->size(), 2u);
    std::unique_ptr<Checkpoint> ckpt = Checkpoint::Open(dir).value();
    absl::StatusOr<StageWeights> w = LoadStageWeights(*ckpt, 1, 3);
    ASSERT_TRUE(w.ok()) << w.status();
    for (int l = 0; l < 2; ++l) {
      const double k = MeasuredRms(ckpt->config(), w->layers[l], false, 400);
      const double v = MeasuredRms(ckpt->config(), w->layers[l], true, 400);
      EXPECT_NEAR((*s)[l].k * kKvRmsInCodes / k, 1.0, 0.1) << "layer " << l + 1 << ": K RMS " << k;
      EXPECT_NEAR((*s)[l].v * kKvRmsInCodes / v, 1.0, 0.1) << "layer " << l + 1 << ": V RMS " << v;
      if (std::string(preset) == "tiny-llama") {
        EXPECT_LT(k, 0.5) << "a scale of 1 would leave these keys in E4M3's lowest codes";
      }
    }
  }
}

// What EstimateKvScales' rule gives from each layer's whole fused QKV weight (and bias) in fp32.
std::vector<KvScales> ScalesOfWholeWeights(const ModelConfig& c, const StageWeights& w) {
  const int64_t in = c.hidden_size, q_dim = c.q_dim(), kv_dim = c.kv_dim();
  auto scale = [](double mean_square) {
    const double s = std::sqrt(mean_square) / kKvRmsInCodes;
    return s > 0 && std::isfinite(s) ? static_cast<float>(s) : 1.0f;
  };
  std::vector<KvScales> scales;
  for (const LayerWeights& l : w.layers) {
    std::vector<double> x2(in);
    for (int64_t i = 0; i < in; ++i) {
      x2[i] = double(l.attn_norm_w[i]) * l.attn_norm_w[i] +
              (l.attn_norm_b.empty() ? 0.0 : double(l.attn_norm_b[i]) * l.attn_norm_b[i]);
    }
    auto mean_square = [&](int64_t row0) {
      double sum = 0;
      for (int64_t j = row0; j < row0 + kv_dim; ++j) {
        double m = 0;
        for (int64_t i = 0; i < in; ++i)
          m += double(l.wqkv[j * in + i]) * l.wqkv[j * in + i] * x2[i];
        if (!l.bqkv.empty()) m += double(l.bqkv[j]) * l.bqkv[j];
        sum += m;
      }
      return sum / double(kv_dim);
    };
    double k2 = mean_square(q_dim);
    if (!l.k_norm_w.empty()) {
      k2 = 0;
      for (float x : l.k_norm_w) k2 += double(x) * x;
      k2 /= double(l.k_norm_w.size());
    }
    scales.push_back({scale(k2), scale(mean_square(q_dim + kv_dim))});
  }
  return scales;
}

// Rewrites the checkpoint in `dir` with each element of its F32 tensors multiplied by
// factor(tensor name, the element's index in the last dimension).
void ScaleTensors(const fs::path& dir,
                  const std::function<float(const std::string&, int64_t)>& factor) {
  std::vector<TensorToWrite> tensors;
  {
    std::unique_ptr<Checkpoint> ckpt = Checkpoint::Open(dir).value();
    for (const std::string& n : ckpt->names()) {
      const TensorView t = ckpt->tensor(n).value();
      TensorToWrite w{n, t.dtype, t.shape, {t.data.begin(), t.data.end()}};
      if (t.dtype == DType::kF32) {
        const int64_t last = t.shape.empty() ? 1 : t.shape.back();
        std::vector<float> v(static_cast<size_t>(t.numel()));
        std::memcpy(v.data(), w.bytes.data(), w.bytes.size());
        for (size_t e = 0; e < v.size(); ++e) v[e] *= factor(n, static_cast<int64_t>(e) % last);
        std::memcpy(w.bytes.data(), v.data(), w.bytes.size());
      }
      tensors.push_back(std::move(w));
    }
  }
  ASSERT_TRUE(WriteSafetensors(dir / "model.safetensors", tensors).ok());
}

// EstimateKvScales converts only the K and V rows of each layer's fused QKV weight: its scales
// are those of the same rule applied to the whole weight converted to fp32, for models whose Q, K
// and V rows have distinct magnitudes (Q's 16 times, V's an eighth of the generated weights'), so
// that rows of another block would give other scales. Llama (GQA, its q, k and v stacked), Qwen2
// (biases), Qwen3 (k_norm), GPT-2 (c_attn's columns, transposed), and FP8 Llama with per-channel
// and with block scales (the scales of its q and v multiplied instead).
TEST_F(KvScalesTest, TheScalesAreThoseOfTheKAndVRowsOfTheWholeWeights) {
  struct Model {
    std::string preset, quantization;
  };
  for (const Model& m : std::vector<Model>{{"tiny-llama", ""},
                                           {"tiny-qwen2", ""},
                                           {"tiny-qwen3", ""},
                                           {"tiny-gpt2", ""},
                                           {"tiny-llama", "compressed-tensors"},
                                           {"tiny-llama", "fp8-block"}}) {
    SCOPED_TRACE(m.preset + " " + m.quantization);
    const fs::path dir = Dir("rows-" + m.preset + "-" + m.quantization);
    ModelOverrides o;
    if (!m.quantization.empty()) {
      o.dtype = "f16";
      o.quantization = m.quantization;
    }
    absl::StatusOr<ModelConfig> c = ApplyOverrides(PresetConfig(m.preset).value(), o);
    ASSERT_TRUE(c.ok()) << c.status();
    GeneratorOptions g;
    g.seed = 7;
    ASSERT_TRUE(WriteRandomCheckpoint(*c, g, dir).ok());
    const int64_t h = c->hidden_size;
    ScaleTensors(dir, [&](const std::string& name, int64_t col) {
      const bool q = absl::StrContains(name, "q_proj.weight") ||
                     (absl::StrContains(name, "c_attn.weight") && col < h);
      const bool v = absl::StrContains(name, "v_proj.weight") ||
                     (absl::StrContains(name, "c_attn.weight") && col >= 2 * h);
      return q ? 16.0f : v ? 0.125f : 1.0f;
    });
    std::unique_ptr<Checkpoint> ckpt = Checkpoint::Open(dir).value();
    absl::StatusOr<std::vector<KvScales>> s = EstimateKvScales(*ckpt, 1, 3);
    ASSERT_TRUE(s.ok()) << s.status();
    absl::StatusOr<StageWeights> w = LoadStageWeights(*ckpt, 1, 3);
    ASSERT_TRUE(w.ok()) << w.status();
    const std::vector<KvScales> want = ScalesOfWholeWeights(*c, *w);
    ASSERT_EQ(s->size(), want.size());
    for (size_t l = 0; l < want.size(); ++l) {
      EXPECT_FLOAT_EQ((*s)[l].k, want[l].k) << "layer " << l + 1;
      EXPECT_FLOAT_EQ((*s)[l].v, want[l].v) << "layer " << l + 1;
      EXPECT_GT(want[l].k / want[l].v, 2.0f) << "layer " << l + 1 << ": K and V alike";
    }
  }
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
