// Tests for the random-checkpoint generator: Hugging Face names, shapes and dtypes, seeded
// determinism, sharding, config round trip, flag validation, and the generated tokenizer.
#include "tools/model_generator.h"

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "common/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tools/byte_level_bpe.h"

namespace tandem {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

namespace fs = std::filesystem;

fs::path TestDir(const std::string& name) {
  fs::path dir = fs::path(TANDEM_TEST_TMPDIR) / "model_generator_test" / name;
  fs::remove_all(dir);
  return dir;
}

std::string ReadBytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

ModelConfig Preset(const std::string& name) {
  absl::StatusOr<ModelConfig> c = PresetConfig(name);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

void Write(const ModelConfig& c, const fs::path& dir, uint64_t seed, int64_t shard_bytes = 0) {
  GeneratorOptions o;
  o.seed = seed;
  o.max_shard_bytes = shard_bytes;
  absl::Status s = WriteRandomCheckpoint(c, o, dir);
  ASSERT_TRUE(s.ok()) << s;
}

using Shapes = std::map<std::string, std::vector<int64_t>>;

// The names and shapes that transformers' GPT2LMHeadModel.save_pretrained writes (Conv1D weights
// are (in, out); the LM head is tied to wte and not saved).
Shapes ExpectedGpt2(int64_t vocab, int64_t h, int64_t inter, int64_t layers, int64_t pos) {
  Shapes s = {{"transformer.wte.weight", {vocab, h}},
              {"transformer.wpe.weight", {pos, h}},
              {"transformer.ln_f.weight", {h}},
              {"transformer.ln_f.bias", {h}}};
  for (int i = 0; i < layers; ++i) {
    const std::string p = "transformer.h." + std::to_string(i) + ".";
    s[p + "ln_1.weight"] = {h};
    s[p + "ln_1.bias"] = {h};
    s[p + "attn.c_attn.weight"] = {h, 3 * h};
    s[p + "attn.c_attn.bias"] = {3 * h};
    s[p + "attn.c_proj.weight"] = {h, h};
    s[p + "attn.c_proj.bias"] = {h};
    s[p + "ln_2.weight"] = {h};
    s[p + "ln_2.bias"] = {h};
    s[p + "mlp.c_fc.weight"] = {h, inter};
    s[p + "mlp.c_fc.bias"] = {inter};
    s[p + "mlp.c_proj.weight"] = {inter, h};
    s[p + "mlp.c_proj.bias"] = {h};
  }
  return s;
}

// LlamaForCausalLM.save_pretrained: Linear weights are (out, in); lm_head only when untied.
Shapes ExpectedLlama(int64_t vocab, int64_t h, int64_t inter, int64_t layers, int64_t heads,
                     int64_t kv_heads, bool tied) {
  const int64_t hd = h / heads;
  Shapes s = {{"model.embed_tokens.weight", {vocab, h}}, {"model.norm.weight", {h}}};
  if (!tied) s["lm_head.weight"] = {vocab, h};
  for (int i = 0; i < layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    s[p + "input_layernorm.weight"] = {h};
    s[p + "self_attn.q_proj.weight"] = {heads * hd, h};
    s[p + "self_attn.k_proj.weight"] = {kv_heads * hd, h};
    s[p + "self_attn.v_proj.weight"] = {kv_heads * hd, h};
    s[p + "self_attn.o_proj.weight"] = {h, heads * hd};
    s[p + "post_attention_layernorm.weight"] = {h};
    s[p + "mlp.gate_proj.weight"] = {inter, h};
    s[p + "mlp.up_proj.weight"] = {inter, h};
    s[p + "mlp.down_proj.weight"] = {h, inter};
  }
  return s;
}

// Every expected tensor is in the single file with its shape and dtype, and nothing else is.
void ExpectExactly(const fs::path& dir, const Shapes& expected, DType dtype) {
  auto file = SafetensorsFile::Open(dir / "model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<std::string> want;
  for (const auto& [name, shape] : expected) want.push_back(name);
  EXPECT_EQ((*file)->names(), want);  // both sorted
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  for (const auto& [name, shape] : expected) {
    auto t = (*ckpt)->tensor(name);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->shape, shape) << name;
    EXPECT_EQ(t->dtype, dtype) << name;
  }
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
}

std::vector<float> ReadAll(Checkpoint& ckpt, const std::string& name) {
  auto view = ckpt.tensor(name);
  EXPECT_TRUE(view.ok()) << view.status();
  if (!view.ok()) return {};
  auto values = ckpt.ReadFloat(name, view->shape);
  EXPECT_TRUE(values.ok()) << values.status();
  return values.ok() ? *values : std::vector<float>{};
}

void MeanStd(const std::vector<float>& v, double* mean, double* std) {
  double s = 0, s2 = 0;
  for (float x : v) s += x;
  *mean = s / v.size();
  for (float x : v) s2 += (x - *mean) * (x - *mean);
  *std = std::sqrt(s2 / v.size());
}

TEST(ModelGeneratorTest, Gpt2HasExactlyHuggingFaceTensorNamesShapesAndDtype) {
  fs::path dir = TestDir("gpt2_layout");
  Write(Preset("tiny-gpt2"), dir, 1);
  ExpectExactly(dir, ExpectedGpt2(512, 64, 256, 4, 256), DType::kF32);
}

TEST(ModelGeneratorTest, UntiedLlamaHasLmHeadAndGqaShapes) {
  fs::path dir = TestDir("llama_untied");
  Write(Preset("tiny-llama"), dir, 1);
  ExpectExactly(dir, ExpectedLlama(512, 64, 160, 4, 4, 2, /*tied=*/false), DType::kF32);
}

TEST(ModelGeneratorTest, TiedLlamaHasNoLmHead) {
  fs::path dir = TestDir("llama_tied");
  Write(Preset("tiny-llama-tied"), dir, 1);
  ExpectExactly(dir, ExpectedLlama(512, 64, 160, 4, 4, 2, /*tied=*/true), DType::kF32);
}

TEST(ModelGeneratorTest, OverriddenGpt2ShapeAndHalfDtypeAreWritten) {
  ModelOverrides o;
  o.num_layers = 2;
  o.hidden_size = 32;
  o.num_heads = 2;
  o.vocab_size = 300;
  o.max_positions = 40;
  o.dtype = "f16";
  auto c = ApplyOverrides(Preset("gpt2"), o);
  ASSERT_TRUE(c.ok()) << c.status();
  fs::path dir = TestDir("gpt2_override");
  Write(*c, dir, 3);
  ExpectExactly(dir, ExpectedGpt2(300, 32, 128, 2, 40), DType::kF16);
}

TEST(ModelGeneratorTest, Bf16LlamaHasBf16Tensors) {
  ModelOverrides o;
  o.dtype = "bf16";
  auto c = ApplyOverrides(Preset("tiny-llama"), o);
  ASSERT_TRUE(c.ok()) << c.status();
  fs::path dir = TestDir("llama_bf16");
  Write(*c, dir, 1);
  ExpectExactly(dir, ExpectedLlama(512, 64, 160, 4, 4, 2, false), DType::kBF16);
}

TEST(ModelGeneratorTest, SameSeedGivesIdenticalFiles) {
  fs::path a = TestDir("same_a"), b = TestDir("same_b");
  Write(Preset("tiny-llama"), a, 42);
  Write(Preset("tiny-llama"), b, 42);
  for (const char* f : {"model.safetensors", "config.json", "tokenizer.json"}) {
    const std::string bytes = ReadBytes(a / f);
    EXPECT_FALSE(bytes.empty()) << f;
    EXPECT_EQ(bytes, ReadBytes(b / f)) << f;
  }
}

TEST(ModelGeneratorTest, DifferentSeedGivesDifferentWeights) {
  fs::path a = TestDir("seed_a"), b = TestDir("seed_b");
  Write(Preset("tiny-gpt2"), a, 1);
  Write(Preset("tiny-gpt2"), b, 2);
  EXPECT_NE(ReadBytes(a / "model.safetensors"), ReadBytes(b / "model.safetensors"));
  auto ca = Checkpoint::Open(a), cb = Checkpoint::Open(b);
  ASSERT_TRUE(ca.ok() && cb.ok());
  // Every tensor differs, not just one.
  for (const TensorSpec& spec : CheckpointTensors(Preset("tiny-gpt2"))) {
    EXPECT_NE(ReadAll(**ca, spec.name), ReadAll(**cb, spec.name)) << spec.name;
  }
}

TEST(ModelGeneratorTest, TensorsOfTheSameShapeDiffer) {
  fs::path dir = TestDir("distinct_streams");
  Write(Preset("tiny-llama"), dir, 5);
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok());
  EXPECT_NE(ReadAll(**ckpt, "model.layers.0.mlp.gate_proj.weight"),
            ReadAll(**ckpt, "model.layers.0.mlp.up_proj.weight"));
  EXPECT_NE(ReadAll(**ckpt, "model.layers.0.self_attn.k_proj.weight"),
            ReadAll(**ckpt, "model.layers.1.self_attn.k_proj.weight"));
  EXPECT_NE(ReadAll(**ckpt, "model.embed_tokens.weight"), ReadAll(**ckpt, "lm_head.weight"));
}

TEST(ModelGeneratorTest, ValuesHaveTheDocumentedDistributions) {
  fs::path dir = TestDir("distributions");
  Write(Preset("tiny-gpt2"), dir, 9);
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok());
  double mean, std;
  MeanStd(ReadAll(**ckpt, "transformer.wte.weight"), &mean, &std);  // 32768 values
  EXPECT_NEAR(mean, 0.0, 0.001);
  EXPECT_NEAR(std, 0.02, 0.001);
  std::vector<float> norms;
  for (int i = 0; i < 4; ++i) {
    for (const char* n : {".ln_1.weight", ".ln_2.weight"}) {
      auto v = ReadAll(**ckpt, "transformer.h." + std::to_string(i) + n);
      norms.insert(norms.end(), v.begin(), v.end());
    }
  }
  MeanStd(norms, &mean, &std);  // 512 values
  EXPECT_NEAR(mean, 1.0, 0.02);
  EXPECT_NEAR(std, 0.1, 0.015);
  MeanStd(ReadAll(**ckpt, "transformer.h.0.mlp.c_fc.bias"), &mean, &std);
  EXPECT_NEAR(mean, 0.0, 0.005);
  EXPECT_NEAR(std, 0.02, 0.004);
  // Irwin-Hall of 4 uniforms is bounded by 2 * sqrt(3) standard deviations.
  for (float x : ReadAll(**ckpt, "transformer.wpe.weight")) {
    EXPECT_LE(std::fabs(x), 0.02f * 2.0f * 1.7320508f + 1e-6f);
  }
}

// Golden values, also computed by an independent Python rendering of the documented formula
// (splitmix64 finalizer, FNV-1a of the name, float32 Irwin-Hall): the generator must give the same
// numbers on every machine and in every build.
TEST(ModelGeneratorTest, RandomWeightMatchesGoldenValues) {
  const TensorSpec matrix{"model.layers.0.self_attn.q_proj.weight", {64, 64}, 0.0f, 0.02f};
  const TensorSpec norm{"model.norm.weight", {64}, 1.0f, 0.1f};
  EXPECT_EQ(RandomWeight(0, matrix, 0), 0x1.28cc38p-9f);
  EXPECT_EQ(RandomWeight(0, matrix, 4095), -0x1.9438cp-7f);
  EXPECT_EQ(RandomWeight(7, matrix, 0), -0x1.d930dcp-7f);
  EXPECT_EQ(RandomWeight(0, norm, 3), 0x1.1a40a8p+0f);
}

TEST(ModelGeneratorTest, WrittenValuesAreRandomWeightRoundedToDtype) {
  fs::path dir = TestDir("values");
  const ModelConfig c = Preset("tiny-llama");
  Write(c, dir, 11);
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok());
  for (const TensorSpec& spec : CheckpointTensors(c)) {
    const std::vector<float> v = ReadAll(**ckpt, spec.name);
    for (int64_t i : {int64_t{0}, static_cast<int64_t>(v.size()) - 1}) {
      EXPECT_EQ(v[i], RandomWeight(11, spec, i)) << spec.name << "[" << i << "]";
    }
  }
}

// A tensor larger than one write chunk (4M elements), generated by several threads, holds the
// same values as element-by-element generation, also across the chunk boundary.
TEST(ModelGeneratorTest, LargeTensorsAreChunkedWithoutChangingValues) {
  ModelOverrides o;
  o.vocab_size = 70000;
  o.num_layers = 1;
  o.tie_word_embeddings = true;
  auto c = ApplyOverrides(Preset("tiny-llama"), o);
  ASSERT_TRUE(c.ok()) << c.status();
  fs::path dir = TestDir("large");
  Write(*c, dir, 13);
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok());
  const std::vector<float> v = ReadAll(**ckpt, "model.embed_tokens.weight");
  ASSERT_EQ(v.size(), 70000u * 64u);
  const TensorSpec spec = CheckpointTensors(*c).front();
  ASSERT_EQ(spec.name, "model.embed_tokens.weight");
  for (int64_t i :
       {int64_t{0}, int64_t{65535}, int64_t{4194303}, int64_t{4194304}, int64_t{4479999}}) {
    EXPECT_EQ(v[i], RandomWeight(13, spec, i)) << i;
  }
}

TEST(ModelGeneratorTest, ConfigJsonRoundTripsThroughLoadModelConfig) {
  for (const std::string preset : {"tiny-gpt2", "tiny-llama", "tiny-llama-tied", "tiny-llama3",
                                   "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-tied"}) {
    fs::path dir = TestDir("config_" + preset);
    const ModelConfig c = Preset(preset);
    Write(c, dir, 1);
    auto back = LoadModelConfig(dir);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->arch, c.arch) << preset;
    EXPECT_EQ(back->vocab_size, c.vocab_size) << preset;
    EXPECT_EQ(back->hidden_size, c.hidden_size) << preset;
    EXPECT_EQ(back->intermediate_size, c.intermediate_size) << preset;
    EXPECT_EQ(back->num_layers, c.num_layers) << preset;
    EXPECT_EQ(back->num_heads, c.num_heads) << preset;
    EXPECT_EQ(back->num_kv_heads, c.num_kv_heads) << preset;
    EXPECT_EQ(back->head_dim, c.head_dim) << preset;
    EXPECT_EQ(back->max_positions, c.max_positions) << preset;
    EXPECT_FLOAT_EQ(back->norm_eps, c.norm_eps) << preset;
    EXPECT_EQ(back->tie_word_embeddings, c.tie_word_embeddings) << preset;
    EXPECT_EQ(back->bos_token_id, c.bos_token_id) << preset;
    EXPECT_EQ(back->eos_token_id, c.eos_token_id) << preset;
    EXPECT_EQ(back->dtype, c.dtype) << preset;
    if (c.arch == Arch::kLlama) {
      EXPECT_FLOAT_EQ(back->rope_theta, c.rope_theta) << preset;
    }
    EXPECT_EQ(back->model_type, c.model_type) << preset;
    EXPECT_EQ(back->rope_scaling.type, c.rope_scaling.type) << preset;
    EXPECT_FLOAT_EQ(back->rope_scaling.factor, c.rope_scaling.factor) << preset;
    EXPECT_EQ(back->rope_scaling.original_max_positions, c.rope_scaling.original_max_positions)
        << preset;
    EXPECT_EQ(back->qkv_bias, c.qkv_bias) << preset;
    EXPECT_EQ(back->o_bias, c.o_bias) << preset;
    EXPECT_EQ(back->qk_norm, c.qk_norm) << preset;
    EXPECT_EQ(back->sliding_window, c.sliding_window) << preset;
    for (int l = 0; l < c.num_layers; ++l) {
      EXPECT_EQ(back->attention_window(l), c.attention_window(l)) << preset << " layer " << l;
    }
  }
}

// The config.json of the new families' presets holds the fields, names and values of the
// published checkpoints' config.json.
TEST(ModelGeneratorTest, NewFamilyPresetsWriteThePublishedConfigFields) {
  auto config = [](const std::string& preset) {
    return nlohmann::json::parse(ModelConfigToJson(Preset(preset)));
  };
  const nlohmann::json l31 = config("llama3.1-8b");
  EXPECT_EQ(l31["architectures"], nlohmann::json({"LlamaForCausalLM"}));
  EXPECT_EQ(l31["model_type"], "llama");
  EXPECT_EQ(l31["vocab_size"], 128256);
  EXPECT_EQ(l31["hidden_size"], 4096);
  EXPECT_EQ(l31["intermediate_size"], 14336);
  EXPECT_EQ(l31["num_hidden_layers"], 32);
  EXPECT_EQ(l31["num_key_value_heads"], 8);
  EXPECT_EQ(l31["rope_theta"], 500000.0);
  EXPECT_EQ(l31["max_position_embeddings"], 131072);
  EXPECT_EQ(l31["rope_scaling"], nlohmann::json::parse(R"({"factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
              "rope_type": "llama3"})"));
  EXPECT_EQ(l31["tie_word_embeddings"], false);
  EXPECT_EQ(l31["attention_bias"], false);
  EXPECT_EQ(l31["torch_dtype"], "bfloat16");
  const nlohmann::json l32 = config("llama3.2-1b");
  EXPECT_EQ(l32["hidden_size"], 2048);
  EXPECT_EQ(l32["intermediate_size"], 8192);
  EXPECT_EQ(l32["num_hidden_layers"], 16);
  EXPECT_EQ(l32["num_attention_heads"], 32);
  EXPECT_EQ(l32["head_dim"], 64);
  EXPECT_EQ(l32["tie_word_embeddings"], true);
  EXPECT_EQ(l32["rope_scaling"]["factor"], 32.0);
  const nlohmann::json m = config("mistral-7b");
  EXPECT_EQ(m["architectures"], nlohmann::json({"MistralForCausalLM"}));
  EXPECT_EQ(m["model_type"], "mistral");
  EXPECT_EQ(m["sliding_window"], 4096);
  EXPECT_EQ(m["num_hidden_layers"], 32);
  EXPECT_EQ(m["num_key_value_heads"], 8);
  EXPECT_EQ(m["intermediate_size"], 14336);
  EXPECT_EQ(m["vocab_size"], 32000);
  EXPECT_EQ(m["rope_theta"], 10000.0);
  EXPECT_FALSE(m.contains("head_dim"));  // 4096 / 32, not spelled out in v0.1's config
  EXPECT_FALSE(m.contains("rope_scaling"));
  const nlohmann::json q = config("qwen2.5-7b");
  EXPECT_EQ(q["architectures"], nlohmann::json({"Qwen2ForCausalLM"}));
  EXPECT_EQ(q["model_type"], "qwen2");
  EXPECT_EQ(q["hidden_size"], 3584);
  EXPECT_EQ(q["num_hidden_layers"], 28);
  EXPECT_EQ(q["num_attention_heads"], 28);
  EXPECT_EQ(q["num_key_value_heads"], 4);
  EXPECT_EQ(q["intermediate_size"], 18944);
  EXPECT_EQ(q["vocab_size"], 152064);
  EXPECT_EQ(q["rope_theta"], 1000000.0);
  EXPECT_EQ(q["use_sliding_window"], false);
  EXPECT_EQ(q["sliding_window"], 131072);
  EXPECT_EQ(q["max_window_layers"], 28);
  EXPECT_EQ(q["tie_word_embeddings"], false);
  EXPECT_FALSE(q.contains("attention_bias"));  // Qwen2 always has q/k/v biases
  // Qwen/Qwen3-8B's config.json.
  const nlohmann::json q3 = config("qwen3-8b");
  EXPECT_EQ(q3["architectures"], nlohmann::json({"Qwen3ForCausalLM"}));
  EXPECT_EQ(q3["model_type"], "qwen3");
  EXPECT_EQ(q3["hidden_size"], 4096);
  EXPECT_EQ(q3["num_hidden_layers"], 36);
  EXPECT_EQ(q3["num_attention_heads"], 32);
  EXPECT_EQ(q3["num_key_value_heads"], 8);
  EXPECT_EQ(q3["head_dim"], 128);
  EXPECT_EQ(q3["intermediate_size"], 12288);
  EXPECT_EQ(q3["vocab_size"], 151936);
  EXPECT_EQ(q3["max_position_embeddings"], 40960);
  EXPECT_EQ(q3["rope_theta"], 1000000.0);
  EXPECT_EQ(q3["rms_norm_eps"], 1e-06);
  EXPECT_EQ(q3["attention_bias"], false);
  EXPECT_EQ(q3["use_sliding_window"], false);
  EXPECT_EQ(q3["tie_word_embeddings"], false);
  EXPECT_EQ(q3["bos_token_id"], 151643);
  EXPECT_EQ(q3["eos_token_id"], 151645);
  EXPECT_EQ(q3["torch_dtype"], "bfloat16");
}

// Qwen3: q_norm and k_norm of (head_dim) after o_proj in every layer, q/k/v/o widths from the
// explicit head_dim (32 in tiny-qwen3, twice hidden / heads); no biases; tied: no lm_head.
TEST(ModelGeneratorTest, Qwen3HasPerHeadQkNormsAndItsOwnHeadDim) {
  std::map<std::string, std::vector<int64_t>> names;
  for (const TensorSpec& t : CheckpointTensors(Preset("qwen3-8b"))) names[t.name] = t.shape;
  EXPECT_EQ(names["model.layers.35.self_attn.q_norm.weight"], std::vector<int64_t>{128});
  EXPECT_EQ(names["model.layers.0.self_attn.k_norm.weight"], std::vector<int64_t>{128});
  EXPECT_EQ(names["model.layers.0.self_attn.k_proj.weight"], (std::vector<int64_t>{1024, 4096}));
  EXPECT_EQ(names.count("model.layers.0.self_attn.q_proj.bias"), 0u);
  EXPECT_EQ(names["lm_head.weight"], (std::vector<int64_t>{151936, 4096}));
  EXPECT_EQ(names.size(), 1u + 36u * 11u + 2u);

  for (bool tied : {false, true}) {
    const ModelConfig c = Preset(tied ? "tiny-qwen3-tied" : "tiny-qwen3");
    EXPECT_EQ(c.head_dim, 32);
    fs::path dir = TestDir(tied ? "qwen3_tiny_tied" : "qwen3_tiny");
    Write(c, dir, 1);
    Shapes want = ExpectedLlama(512, 64, 160, 4, 4, 2, tied);
    for (int i = 0; i < 4; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".self_attn.";
      want[p + "q_proj.weight"] = {128, 64};
      want[p + "k_proj.weight"] = {64, 64};
      want[p + "v_proj.weight"] = {64, 64};
      want[p + "o_proj.weight"] = {64, 128};
      want[p + "q_norm.weight"] = {32};
      want[p + "k_norm.weight"] = {32};
    }
    ExpectExactly(dir, want, DType::kF32);
  }
  // head_dim is Qwen3's own: kept when the heads change, overridden only by --head_dim.
  ModelOverrides o;
  o.num_heads = 8;
  o.num_kv_heads = 4;
  auto c = ApplyOverrides(Preset("tiny-qwen3"), o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 32);
  o.head_dim = 16;
  c = ApplyOverrides(Preset("tiny-qwen3"), o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 16);
  o.head_dim = 15;
  EXPECT_THAT(ApplyOverrides(Preset("tiny-qwen3"), o).status().message(), HasSubstr("--head_dim"));
  ModelOverrides llama;
  llama.head_dim = 32;
  EXPECT_THAT(ApplyOverrides(Preset("tiny-llama"), llama).status().message(),
              HasSubstr("--head_dim applies only to Qwen3"));
}

// Qwen2: a bias after each of q_proj, k_proj and v_proj, none on o_proj; tied: no lm_head.
TEST(ModelGeneratorTest, QwenHasQkvBiasesAndLlamaWithAttentionBiasAlsoOnO) {
  std::map<std::string, std::vector<int64_t>> names;
  for (const TensorSpec& t : CheckpointTensors(Preset("qwen2.5-7b"))) names[t.name] = t.shape;
  EXPECT_EQ(names["model.layers.27.self_attn.q_proj.bias"], std::vector<int64_t>{3584});
  EXPECT_EQ(names["model.layers.27.self_attn.k_proj.bias"], std::vector<int64_t>{512});
  EXPECT_EQ(names["model.layers.0.self_attn.v_proj.bias"], std::vector<int64_t>{512});
  EXPECT_EQ(names.count("model.layers.0.self_attn.o_proj.bias"), 0u);
  EXPECT_EQ(names["lm_head.weight"], (std::vector<int64_t>{152064, 3584}));
  EXPECT_EQ(names.size(), 1u + 28u * 12u + 2u);

  fs::path dir = TestDir("qwen2_tiny");
  Write(Preset("tiny-qwen2"), dir, 1);
  Shapes want = ExpectedLlama(512, 64, 160, 4, 4, 2, /*tied=*/true);
  for (int i = 0; i < 4; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".self_attn.";
    want[p + "q_proj.bias"] = {64};
    want[p + "k_proj.bias"] = {32};
    want[p + "v_proj.bias"] = {32};
  }
  ExpectExactly(dir, want, DType::kF32);

  ModelConfig biased = Preset("tiny-llama");
  biased.qkv_bias = biased.o_bias = true;
  std::set<std::string> llama;
  for (const TensorSpec& t : CheckpointTensors(biased)) llama.insert(t.name);
  EXPECT_EQ(llama.count("model.layers.3.self_attn.o_proj.bias"), 1u);
  EXPECT_EQ(llama.count("model.layers.3.self_attn.k_proj.bias"), 1u);
}

// --sliding_window and --max_window_layers: Qwen2's window on the layers from max_window_layers
// on, written as use_sliding_window / sliding_window / max_window_layers.
TEST(ModelGeneratorTest, QwenWindowOverridesWindowTheLastLayers) {
  ModelOverrides o;
  o.sliding_window = 24;
  o.max_window_layers = 2;
  auto c = ApplyOverrides(Preset("tiny-qwen2"), o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->attention_window(1), 0);
  EXPECT_EQ(c->attention_window(2), 24);
  EXPECT_EQ(c->attention_window(3), 24);
  const nlohmann::json j = nlohmann::json::parse(ModelConfigToJson(*c));
  EXPECT_EQ(j["use_sliding_window"], true);
  EXPECT_EQ(j["sliding_window"], 24);
  EXPECT_EQ(j["max_window_layers"], 2);
  ModelOverrides none;
  none.sliding_window = 0;
  auto m = ApplyOverrides(Preset("tiny-mistral"), none);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(nlohmann::json::parse(ModelConfigToJson(*m))["sliding_window"].is_null());
}

TEST(ModelGeneratorTest, ShardedCheckpointIsReadableAndMatchesSingleFile) {
  const ModelConfig c = Preset("tiny-llama");
  fs::path single = TestDir("single"), sharded = TestDir("sharded");
  Write(c, single, 4);
  Write(c, sharded, 4, /*shard_bytes=*/200'000);
  EXPECT_FALSE(fs::exists(sharded / "model.safetensors"));
  std::ifstream in(sharded / "model.safetensors.index.json");
  auto index = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(index.is_discarded());

  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items())
    files.insert(file.get<std::string>());
  ASSERT_GT(files.size(), 2u);
  const int n = static_cast<int>(files.size());
  int64_t total = 0;
  for (int i = 1; i <= n; ++i) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05d-of-%05d.safetensors", i, n);
    EXPECT_TRUE(files.count(name)) << name;
    auto f = SafetensorsFile::Open(sharded / name);
    ASSERT_TRUE(f.ok()) << f.status();
    for (const std::string& t : (*f)->names()) {
      EXPECT_EQ(index["weight_map"][t], name) << t;
      total += static_cast<int64_t>((*f)->tensor(t)->data.size());
    }
  }
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), total);

  const Shapes expected = ExpectedLlama(512, 64, 160, 4, 4, 2, false);
  EXPECT_EQ(index["weight_map"].size(), expected.size());
  auto a = Checkpoint::Open(single), b = Checkpoint::Open(sharded);
  ASSERT_TRUE(a.ok() && b.ok()) << b.status();
  for (const auto& [name, shape] : expected) {
    auto vb = (*b)->ReadFloat(name, shape);
    ASSERT_TRUE(vb.ok()) << vb.status();
    EXPECT_EQ(ReadAll(**a, name), *vb) << name;  // values do not depend on the file layout
  }
}

TEST(ModelGeneratorTest, RewritingWithoutShardsRemovesStaleShards) {
  const ModelConfig c = Preset("tiny-llama");
  fs::path dir = TestDir("rewrite");
  Write(c, dir, 4, 200'000);
  ASSERT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  Write(c, dir, 4);
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  for (const auto& e : fs::directory_iterator(dir)) {
    EXPECT_EQ(e.path().filename().string().rfind("model-", 0), std::string::npos) << e.path();
  }
  EXPECT_TRUE(Checkpoint::Open(dir).ok());
}

TEST(ModelGeneratorTest, PresetsHaveTheirPublishedShapes) {
  EXPECT_THAT(
      PresetNames(),
      ElementsAre("tiny-gpt2", "tiny-llama", "tiny-llama-tied", "tiny-llama3", "tiny-mistral",
                  "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-tied", "tiny-openllama", "gpt2",
                  "tinyllama-1b", "openllama-3b", "llama2-7b", "llama2-13b", "llama3.2-1b",
                  "llama3.1-8b", "mistral-7b", "qwen2.5-7b", "qwen3-8b"));
  const ModelConfig o = Preset("openllama-3b");
  EXPECT_EQ(o.arch, Arch::kLlama);
  EXPECT_EQ(o.vocab_size, 32000);
  EXPECT_EQ(o.hidden_size, 3200);
  EXPECT_EQ(o.intermediate_size, 8640);
  EXPECT_EQ(o.num_layers, 26);
  EXPECT_EQ(o.num_heads, 32);
  EXPECT_EQ(o.num_kv_heads, 32);
  EXPECT_EQ(o.head_dim, 100);
  EXPECT_EQ(o.max_positions, 2048);
  EXPECT_FLOAT_EQ(o.norm_eps, 1e-6f);
  EXPECT_FALSE(o.tie_word_embeddings);
  EXPECT_EQ(o.dtype, DType::kF16);
  const ModelConfig t = Preset("tinyllama-1b");
  EXPECT_EQ(t.num_kv_heads, 4);
  EXPECT_EQ(t.num_layers, 22);
  EXPECT_EQ(t.intermediate_size, 5632);
  const ModelConfig g = Preset("gpt2");
  EXPECT_EQ(g.arch, Arch::kGpt2);
  EXPECT_EQ(g.vocab_size, 50257);
  EXPECT_EQ(g.eos_token_id, 50256);
  EXPECT_TRUE(g.tie_word_embeddings);
  const ModelConfig l = Preset("llama2-13b");
  EXPECT_EQ(l.hidden_size, 5120);
  EXPECT_EQ(l.intermediate_size, 13824);
  EXPECT_EQ(l.num_layers, 40);
  EXPECT_EQ(l.num_heads, 40);
  EXPECT_EQ(l.max_positions, 4096);
  for (const std::string& name : PresetNames()) {
    EXPECT_TRUE(ValidateGeneratorConfig(Preset(name)).ok()) << name;
  }
}

TEST(ModelGeneratorTest, UnknownPresetListsValidOnes) {
  auto c = PresetConfig("llama-9000");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("llama-9000"));
  for (const std::string& name : PresetNames()) {
    EXPECT_THAT(c.status().message(), HasSubstr(name));
  }
}

TEST(ModelGeneratorTest, OverridesKeepDependentDimensionsConsistent) {
  ModelOverrides o;
  o.hidden_size = 128;
  o.num_heads = 8;
  auto g = ApplyOverrides(Preset("tiny-gpt2"), o);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->intermediate_size, 512);  // GPT-2: 4 * hidden
  EXPECT_EQ(g->num_kv_heads, 8);
  EXPECT_EQ(g->head_dim, 16);

  auto l = ApplyOverrides(Preset("tinyllama-1b"), o);  // GQA preset keeps its kv heads
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->num_kv_heads, 4);
  EXPECT_EQ(l->intermediate_size, 5632);

  auto m = ApplyOverrides(Preset("llama2-7b"), o);  // MHA preset stays MHA
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->num_kv_heads, 8);

  ModelOverrides v;
  v.vocab_size = 1000;
  v.tie_word_embeddings = true;
  v.rope_theta = 500000.0f;
  v.norm_eps = 1e-6f;
  auto t = ApplyOverrides(Preset("tiny-llama"), v);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->eos_token_id, 999);  // the end-of-text id stays the last id
  EXPECT_TRUE(t->tie_word_embeddings);
  EXPECT_FLOAT_EQ(t->rope_theta, 500000.0f);
  EXPECT_FLOAT_EQ(t->norm_eps, 1e-6f);
}

// Each bad override is rejected with a message naming its flag.
TEST(ModelGeneratorTest, BadOverridesNameTheFlag) {
  struct Case {
    const char* preset;
    ModelOverrides o;
    const char* flag;
  };
  std::vector<Case> cases;
  auto add = [&](const char* preset, auto set, const char* flag) {
    Case c{preset, {}, flag};
    set(c.o);
    cases.push_back(c);
  };
  add(
      "tiny-llama", [](ModelOverrides& o) { o.num_heads = 5; }, "--num_heads");
  add(
      "tiny-llama", [](ModelOverrides& o) { o.num_kv_heads = 3; }, "--num_kv_heads");
  add(
      "tiny-gpt2", [](ModelOverrides& o) { o.num_kv_heads = 2; }, "--num_kv_heads");
  add(
      "tiny-llama", [](ModelOverrides& o) { o.hidden_size = 0; }, "--hidden_size");
  add(
      "tiny-llama", [](ModelOverrides& o) { o.vocab_size = -3; }, "--vocab_size");
  add(
      "tiny-llama", [](ModelOverrides& o) { o.vocab_size = 100; }, "--vocab_size");
  add(
      "tiny-llama", [](ModelOverrides& o) { o.intermediate_size = 0; }, "--intermediate_size");
  add(
      "tiny-llama", [](ModelOverrides& o) { o.num_layers = 0; }, "--num_layers");
  add(
      "tiny-llama", [](ModelOverrides& o) { o.num_heads = 0; }, "--num_heads");
  add(
      "tiny-llama", [](ModelOverrides& o) { o.num_kv_heads = -1; }, "--num_kv_heads");
  add(
      "tiny-llama", [](ModelOverrides& o) { o.max_positions = 0; }, "--max_positions");
  add(
      "tiny-llama", [](ModelOverrides& o) { o.norm_eps = 0.0f; }, "--norm_eps");
  add(
      "tiny-llama", [](ModelOverrides& o) { o.rope_theta = -1.0f; }, "--rope_theta");
  add(
      "tiny-gpt2", [](ModelOverrides& o) { o.rope_theta = 1e4f; }, "--rope_theta");
  add(
      "tiny-llama", [](ModelOverrides& o) { o.dtype = "f64"; }, "--dtype");
  add(
      "tiny-llama", [](ModelOverrides& o) { o.sliding_window = 8; }, "--sliding_window");
  add(
      "tiny-mistral", [](ModelOverrides& o) { o.sliding_window = -2; }, "--sliding_window");
  add(
      "tiny-mistral", [](ModelOverrides& o) { o.max_window_layers = 1; }, "--max_window_layers");
  add(
      "tiny-qwen2", [](ModelOverrides& o) { o.max_window_layers = -1; }, "--max_window_layers");
  add(
      "tiny-llama", [](ModelOverrides& o) { o.hidden_size = 12; }, "--hidden_size");  // hd 3
  add(
      "tiny-llama", [](ModelOverrides& o) { o.num_layers = 2000000000; }, "--num_layers");
  add(
      "tiny-llama",
      [](ModelOverrides& o) {
        o.hidden_size = 2000000000;
        o.num_heads = 2;
        o.num_kv_heads = 2;
        o.vocab_size = 2000000000;
      },
      "--hidden_size");
  for (const Case& c : cases) {
    auto r = ApplyOverrides(Preset(c.preset), c.o);
    ASSERT_FALSE(r.ok()) << c.flag;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.flag;
    EXPECT_THAT(r.status().message(), HasSubstr(c.flag));
  }
}

TEST(ModelGeneratorTest, WriteRejectsInvalidConfigAndWritesNothing) {
  ModelConfig c = Preset("tiny-llama");
  c.num_kv_heads = 3;
  fs::path dir = TestDir("invalid");
  absl::Status s = WriteRandomCheckpoint(c, {}, dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("--num_kv_heads"));
  EXPECT_FALSE(fs::exists(dir));

  GeneratorOptions o;
  o.max_shard_bytes = -1;
  s = WriteRandomCheckpoint(Preset("tiny-llama"), o, dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("max_shard"));
}

TEST(ModelGeneratorTest, WriteIntoAFileFails) {
  fs::path dir = TestDir("not_a_folder");
  fs::create_directories(dir.parent_path());
  std::ofstream(dir) << "x";
  absl::Status s = WriteRandomCheckpoint(Preset("tiny-llama"), {}, dir);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr(dir.string()));
  fs::remove(dir);
}

// --- tokenizer ---

TEST(ByteLevelBpeTest, ByteAlphabetIsGpt2s) {
  EXPECT_EQ(ByteToUnicode('!'), "!");
  EXPECT_EQ(ByteToUnicode(' '), "\xC4\xA0");   // U+0120 'Ġ'
  EXPECT_EQ(ByteToUnicode('\n'), "\xC4\x8A");  // U+010A 'Ċ'
  EXPECT_EQ(ByteToUnicode(0), "\xC4\x80");     // U+0100
  EXPECT_EQ(ByteToUnicode(0xAD), "\xC5\x83");  // soft hyphen is not printable: U+0143
  const BpeVocab v = TrainByteLevelBpe("", 1000);
  ASSERT_EQ(v.tokens.size(), 256u);
  EXPECT_EQ(v.tokens[0], "!");
  EXPECT_EQ(v.tokens[188], "\xC4\x80");  // GPT-2's ids: byte 0 is 188, space is 220
  EXPECT_EQ(v.tokens[220], "\xC4\xA0");
}

TEST(ByteLevelBpeTest, PreTokenizeSplitsLikeGpt2) {
  EXPECT_THAT(PreTokenize("Hello world's  end 42x,.\n"),
              ElementsAre("Hello", " world", "'s", " ", " end", " 42", "x", ",.", "\n"));
  // "\s+(?!\S)" backtracks one character before a word, even when that leaves a newline alone.
  EXPECT_THAT(PreTokenize("a\n\nb  "), ElementsAre("a", "\n", "\n", "b", "  "));
}

TEST(ByteLevelBpeTest, MergesMostFrequentPairWithSmallestPairOnTies) {
  const BpeVocab v = TrainByteLevelBpe("ab ab cd cd", 1000);
  using P = std::pair<std::string, std::string>;
  EXPECT_THAT(v.merges, ElementsAre(P{"a", "b"}, P{"c", "d"}, P{"\xC4\xA0", "cd"}));
  ASSERT_EQ(v.tokens.size(), 259u);
  EXPECT_EQ(v.tokens[256], "ab");
  EXPECT_EQ(v.tokens[258],
            "\xC4\xA0"
            "cd");
  EXPECT_EQ(TrainByteLevelBpe("ab ab cd cd", 257).merges.size(), 1u);  // stops at max_tokens
}

TEST(ByteLevelBpeTest, TokenizerJsonHasHuggingFaceStructure) {
  fs::path dir = TestDir("tokenizer_json");
  Write(Preset("tiny-gpt2"), dir, 1);
  std::ifstream in(dir / "tokenizer.json");
  auto j = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  EXPECT_EQ(j["version"], "1.0");
  EXPECT_EQ(j["model"]["type"], "BPE");
  EXPECT_EQ(j["pre_tokenizer"]["type"], "ByteLevel");
  EXPECT_EQ(j["pre_tokenizer"]["add_prefix_space"], false);
  EXPECT_EQ(j["decoder"]["type"], "ByteLevel");
  ASSERT_EQ(j["added_tokens"].size(), 1u);
  EXPECT_EQ(j["added_tokens"][0]["content"], "<|endoftext|>");
  EXPECT_EQ(j["added_tokens"][0]["id"], 511);
  EXPECT_EQ(j["added_tokens"][0]["special"], true);
  // The tiny vocabulary is full: ids 0..511 each once, every merge's parts and result known.
  const auto& vocab = j["model"]["vocab"];
  ASSERT_EQ(vocab.size(), 512u);
  std::vector<bool> seen(512);
  for (const auto& [tok, id] : vocab.items()) seen.at(id.get<int>()) = true;
  EXPECT_EQ(std::count(seen.begin(), seen.end(), true), 512);
  EXPECT_EQ(j["model"]["merges"].size(), 255u);
  for (const auto& m : j["model"]["merges"]) {
    const std::string s = m.get<std::string>();
    const size_t sp = s.find(' ');
    ASSERT_NE(sp, std::string::npos) << s;
    EXPECT_TRUE(vocab.contains(s.substr(0, sp))) << s;
    EXPECT_TRUE(vocab.contains(s.substr(sp + 1))) << s;
    EXPECT_TRUE(vocab.contains(s.substr(0, sp) + s.substr(sp + 1))) << s;
  }
}

TEST(ByteLevelBpeTest, GeneratedTokenizerLoadsAndRoundTrips) {
  fs::path dir = TestDir("tokenizer_load");
  Write(Preset("tiny-llama"), dir, 1);
  auto tok = Tokenizer::FromTokenizerJson(dir / "tokenizer.json");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::string text = "The bread is done when it sounds hollow.\n  Caf\xC3\xA9 42!";
  const std::vector<int32_t> ids = (*tok)->Encode(text).value();
  EXPECT_LT(ids.size(), text.size());  // merges were applied
  for (int32_t id : ids) EXPECT_LT(id, 511);
  auto back = (*tok)->Decode(ids);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, text);
  EXPECT_THAT((*tok)->Encode(" the").value(),
              ElementsAre(::testing::Ge(256)));  // one learned token
}

// --- the program ---

struct RunResult {
  int exit_code;
  std::string output;
};

RunResult RunMakeModel(const std::string& args) {
  const std::string cmd = std::string(TANDEM_MAKE_MODEL) + " " + args + " 2>&1";
  RunResult r{-1, ""};
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

TEST(MakeModelProgramTest, WritesACheckpointFromFlags) {
  fs::path dir = TestDir("program_ok");
  RunResult r = RunMakeModel(
      "--preset=tiny-llama --num_layers=2 --tie_word_embeddings=true "
      "--dtype=f16 --seed=3 --out=" +
      dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ExpectExactly(dir, ExpectedLlama(512, 64, 160, 2, 4, 2, true), DType::kF16);
}

TEST(MakeModelProgramTest, BareBoolFlagsOverrideThePreset) {
  fs::path dir = TestDir("program_bool");
  RunResult r = RunMakeModel("--preset=tiny-llama --tie_word_embeddings --out=" + dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(Checkpoint::Open(dir).value()->contains("lm_head.weight"));
  r = RunMakeModel("--preset=tiny-llama-tied --notie_word_embeddings --out=" + dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Checkpoint::Open(dir).value()->contains("lm_head.weight"));
  r = RunMakeModel("--preset=tiny-llama-tied --out=" + dir.string());  // the preset decides
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(Checkpoint::Open(dir).value()->contains("lm_head.weight"));
}

TEST(MakeModelProgramTest, ShardsWithMaxShardMb) {
  fs::path dir = TestDir("program_shards");
  RunResult r = RunMakeModel(
      "--preset=tiny-llama --hidden_size=256 --intermediate_size=1024 "
      "--max_shard_mb=1 --out=" +
      dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_TRUE(Checkpoint::Open(dir).ok());
}

TEST(MakeModelProgramTest, BadFlagsFailWithAMessageNamingThem) {
  fs::path dir = TestDir("program_bad");
  RunResult r = RunMakeModel("--preset=nope --out=" + dir.string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("tiny-llama"));  // lists the valid presets
  r = RunMakeModel("--preset=tiny-llama --num_heads=3 --out=" + dir.string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("--num_heads"));
  r = RunMakeModel("--preset=tiny-llama --dtype=int8 --out=" + dir.string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("--dtype"));
  r = RunMakeModel("--preset=tiny-llama --max_shard_mb=-1 --out=" + dir.string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("--max_shard_mb"));
  r = RunMakeModel("--preset=tiny-llama");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("--out"));
  r = RunMakeModel("--preset=tiny-llama --hidden_size=abc --out=" + dir.string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_FALSE(fs::exists(dir));
  for (const char* bad : {"1:x", "0.5", "1:2:3"}) {
    r = RunMakeModel(std::string("--preset=tiny-llama --kv_scales=") + bad +
                     " --out=" + dir.string());
    EXPECT_EQ(r.exit_code, 2) << bad;
    EXPECT_THAT(r.output, HasSubstr("--kv_scales '" + std::string(bad) + "'"));
  }
  r = RunMakeModel("--preset=tiny-llama --kv_scales=1:0 --out=" + dir.string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("--kv_scales: layer 0's v_scale 0"));
}

TEST(MakeModelProgramTest, KvScalesFlagWritesEachLayersScales) {
  fs::path dir = TestDir("program_kv_scales");
  RunResult r = RunMakeModel(
      "--preset=tiny-llama --kv_scales=0.5:0.25,1:2,4:8,0.125:0.0625 --out=" + dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::unique_ptr<Checkpoint> ckpt = Checkpoint::Open(dir).value();
  std::vector<float> got;
  for (int i = 0; i < 4; ++i) {
    for (const char* which : {"k_scale", "v_scale"}) {
      absl::StatusOr<TensorView> t =
          ckpt->tensor("model.layers." + std::to_string(i) + ".self_attn." + which);
      ASSERT_TRUE(t.ok()) << t.status();
      float v = 0;
      std::memcpy(&v, t->data.data(), sizeof v);
      got.push_back(v);
    }
  }
  EXPECT_THAT(got, ElementsAre(0.5f, 0.25f, 1.0f, 2.0f, 4.0f, 8.0f, 0.125f, 0.0625f));
}

// --kv_scales: each layer's k_scale and v_scale, F32 scalars of shape [] under the names an FP8
// KV-cache checkpoint gives them, after every other tensor (in the last shard).
TEST(ModelGeneratorTest, KvScalesAreWrittenAsF32ScalarsOfEveryLayer) {
  auto scale = [](Checkpoint& ckpt, const std::string& name) {
    absl::StatusOr<TensorView> t = ckpt.tensor(name);
    EXPECT_TRUE(t.ok()) << t.status();
    if (!t.ok()) return 0.0f;
    EXPECT_EQ(t->dtype, DType::kF32) << name;
    EXPECT_TRUE(t->shape.empty()) << name;
    float v = 0;
    std::memcpy(&v, t->data.data(), sizeof v);
    return v;
  };
  const ModelConfig llama = Preset("tiny-llama");  // 4 layers
  GeneratorOptions o;
  o.kv_scales = {{0.5f, 0.25f}, {0.125f, 2.0f}, {3.0f, 0.75f}, {1.5f, 0.0625f}};
  o.max_shard_bytes = 256 << 10;
  fs::path dir = TestDir("kv_scales_per_layer");
  ASSERT_TRUE(WriteRandomCheckpoint(llama, o, dir).ok());
  std::unique_ptr<Checkpoint> ckpt = Checkpoint::Open(dir).value();
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(scale(*ckpt, "model.layers." + std::to_string(i) + ".self_attn.k_scale"),
              o.kv_scales[i].first);
    EXPECT_EQ(scale(*ckpt, "model.layers." + std::to_string(i) + ".self_attn.v_scale"),
              o.kv_scales[i].second);
  }
  // One pair for every layer; GPT-2 names its attention module "attn".
  o = {};
  o.kv_scales = {{0.5f, 0.25f}};
  dir = TestDir("kv_scales_gpt2");
  ASSERT_TRUE(WriteRandomCheckpoint(Preset("tiny-gpt2"), o, dir).ok());
  ckpt = Checkpoint::Open(dir).value();
  for (int i = 0; i < Preset("tiny-gpt2").num_layers; ++i) {
    EXPECT_EQ(scale(*ckpt, "transformer.h." + std::to_string(i) + ".attn.k_scale"), 0.5f);
    EXPECT_EQ(scale(*ckpt, "transformer.h." + std::to_string(i) + ".attn.v_scale"), 0.25f);
  }
  // Without: none.
  dir = TestDir("kv_scales_none");
  ASSERT_TRUE(WriteRandomCheckpoint(llama, {}, dir).ok());
  EXPECT_FALSE(Checkpoint::Open(dir).value()->contains("model.layers.0.self_attn.k_scale"));
}

TEST(ModelGeneratorTest, KvScalesOfAnotherCountOrNotPositiveAreRefusedNamingTheFlag) {
  GeneratorOptions o;
  o.kv_scales = {{1.0f, 1.0f}, {1.0f, 1.0f}};  // tiny-llama has 4 layers
  absl::Status s = WriteRandomCheckpoint(Preset("tiny-llama"), o, TestDir("kv_scales_count"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("--kv_scales: 2 pairs for a model of 4 layers"));
  for (float bad : {0.0f, -1.0f, std::nanf("")}) {
    o.kv_scales = {{1.0f, bad}};
    s = WriteRandomCheckpoint(Preset("tiny-llama"), o, TestDir("kv_scales_bad"));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.message(), HasSubstr("--kv_scales: layer 0's v_scale")) << bad;
  }
}

// --- a real tokenizer's files beside the weights ---

// A tokenizer folder whose special tokens are added tokens past the BPE vocabulary (ids 600, 601,
// 602 of 603), named by tokenizer_config.json (bos as a string, eos as {"content": ...}) and
// special_tokens_map.json (pad), as Hugging Face folders name them.
fs::path TokenizerWithSpecials(const std::string& name) {
  const fs::path dir = TestDir(name);
  EXPECT_TRUE(WriteRandomCheckpoint(Preset("tiny-llama"), {}, dir).ok());
  nlohmann::json tok = nlohmann::json::parse(ReadBytes(dir / "tokenizer.json"));
  for (auto [id, content] :
       {std::pair{600, "<s>"}, std::pair{601, "</s>"}, std::pair{602, "<pad>"}}) {
    tok["added_tokens"].push_back({{"id", id},
                                   {"content", content},
                                   {"single_word", false},
                                   {"lstrip", false},
                                   {"rstrip", false},
                                   {"normalized", false},
                                   {"special", true}});
  }
  std::ofstream(dir / "tokenizer.json") << tok.dump();
  std::ofstream(dir / "tokenizer_config.json")
      << R"({"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": false}})";
  std::ofstream(dir / "special_tokens_map.json") << R"({"pad_token": "<pad>"})";
  for (const char* stale : {"config.json", "model.safetensors"}) fs::remove(dir / stale);
  return dir;
}

TEST(TokenizerSpecialsTest, VocabularyAndSpecialIdsComeFromTheTokenizerFiles) {
  absl::StatusOr<TokenizerSpecials> t = ReadTokenizerSpecials(TokenizerWithSpecials("specials"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->vocab_size, 603);
  EXPECT_EQ(t->bos_token_id, 600);
  EXPECT_EQ(t->eos_token_id, 601);
  EXPECT_EQ(t->pad_token_id, 602);
}

TEST(TokenizerSpecialsTest, ASpecialTokenMissingFromTheVocabularyIsNamed) {
  const fs::path dir = TokenizerWithSpecials("specials_missing");
  std::ofstream(dir / "tokenizer_config.json") << R"({"eos_token": "<|eot|>"})";
  absl::StatusOr<TokenizerSpecials> t = ReadTokenizerSpecials(dir);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), ::testing::AllOf(HasSubstr("tokenizer_config.json"),
                                                     HasSubstr("eos_token \"<|eot|>\"")));
  EXPECT_EQ(ReadTokenizerSpecials(TestDir("no_tokenizer")).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(MakeModelProgramTest, TokenizerFlagCopiesItsFilesAndTakesItsIds) {
  const fs::path tokenizer = TokenizerWithSpecials("program_tokenizer_src");
  const fs::path dir = TestDir("program_tokenizer");
  RunResult r = RunMakeModel("--preset=tiny-llama --tokenizer=" + tokenizer.string() +
                             " --out=" + dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}) {
    EXPECT_EQ(ReadBytes(dir / name), ReadBytes(tokenizer / name)) << name;
  }
  EXPECT_FALSE(fs::exists(dir / "tokenizer.model"));
  const nlohmann::json config = nlohmann::json::parse(ReadBytes(dir / "config.json"));
  EXPECT_EQ(config["vocab_size"], 603);
  EXPECT_EQ(config["bos_token_id"], 600);
  EXPECT_EQ(config["eos_token_id"], 601);
  EXPECT_EQ(config["pad_token_id"], 602);
  absl::StatusOr<ModelConfig> loaded = LoadModelConfig(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(Checkpoint::Open(dir).value()->tensor("model.embed_tokens.weight").value().shape,
            (std::vector<int64_t>{603, 64}));

  // A --vocab_size that holds every id pads the embedding; a smaller one is refused.
  r = RunMakeModel("--preset=tiny-llama --vocab_size=640 --tokenizer=" + tokenizer.string() +
                   " --out=" + dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(ReadBytes(dir / "config.json"))["vocab_size"], 640);
  r = RunMakeModel("--preset=tiny-llama --vocab_size=512 --tokenizer=" + tokenizer.string() +
                   " --out=" + dir.string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("--vocab_size 512 is smaller than the tokenizer's 603"));
}

}  // namespace
}  // namespace tandem
