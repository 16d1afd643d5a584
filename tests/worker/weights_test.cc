// LoadStageWeights: Hugging Face names and layouts to the engine's (out, in) layout, layer ranges,
// tied and untied heads, and errors for missing or misshapen tensors.
#include "worker/weights.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "common/model_config.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// A value unique to (tensor, element), so that a misplaced element shows.
float Value(int tensor, int64_t element) {
  return static_cast<float>(tensor) + 0.001f * static_cast<float>(element);
}

// The tensors of a checkpoint, by name, as float values and shape.
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
};
using TensorMap = std::map<std::string, Tensor>;

void Add(TensorMap& m, const std::string& name, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  Tensor t{std::move(shape), std::vector<float>(n)};
  const int id = static_cast<int>(m.size()) + 1;
  for (int64_t e = 0; e < n; ++e) t.values[e] = Value(id, e);
  m[name] = std::move(t);
}

ModelConfig Gpt2Config() {
  ModelConfig c;
  c.arch = Arch::kGpt2;
  c.vocab_size = 11;
  c.hidden_size = 4;
  c.intermediate_size = 6;
  c.num_layers = 3;
  c.num_heads = 2;
  c.num_kv_heads = 2;
  c.head_dim = 2;
  c.max_positions = 8;
  c.tie_word_embeddings = true;
  return c;
}

ModelConfig LlamaConfig(bool tied) {
  ModelConfig c;
  c.arch = Arch::kLlama;
  c.vocab_size = 11;
  c.hidden_size = 8;
  c.intermediate_size = 5;
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 2;
  c.max_positions = 8;
  c.tie_word_embeddings = tied;
  return c;
}

// GPT-2 as transformers saves it: Conv1D weights (in, out), plus the attn.bias mask buffers.
TensorMap Gpt2Tensors(const ModelConfig& c, const std::string& prefix) {
  const int64_t h = c.hidden_size, inter = c.intermediate_size;
  TensorMap m;
  Add(m, prefix + "wte.weight", {c.vocab_size, h});
  Add(m, prefix + "wpe.weight", {c.max_positions, h});
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = prefix + "h." + std::to_string(i) + ".";
    Add(m, p + "ln_1.weight", {h});
    Add(m, p + "ln_1.bias", {h});
    Add(m, p + "attn.bias", {1, 1, c.max_positions, c.max_positions});
    Add(m, p + "attn.masked_bias", {});
    Add(m, p + "attn.c_attn.weight", {h, 3 * h});
    Add(m, p + "attn.c_attn.bias", {3 * h});
    Add(m, p + "attn.c_proj.weight", {h, h});
    Add(m, p + "attn.c_proj.bias", {h});
    Add(m, p + "ln_2.weight", {h});
    Add(m, p + "ln_2.bias", {h});
    Add(m, p + "mlp.c_fc.weight", {h, inter});
    Add(m, p + "mlp.c_fc.bias", {inter});
    Add(m, p + "mlp.c_proj.weight", {inter, h});
    Add(m, p + "mlp.c_proj.bias", {h});
  }
  Add(m, prefix + "ln_f.weight", {h});
  Add(m, prefix + "ln_f.bias", {h});
  return m;
}

TensorMap LlamaTensors(const ModelConfig& c, const std::string& prefix, bool with_lm_head) {
  const int64_t h = c.hidden_size, inter = c.intermediate_size;
  TensorMap m;
  Add(m, prefix + "embed_tokens.weight", {c.vocab_size, h});
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = prefix + "layers." + std::to_string(i) + ".";
    Add(m, p + "input_layernorm.weight", {h});
    Add(m, p + "self_attn.q_proj.weight", {c.q_dim(), h});
    Add(m, p + "self_attn.k_proj.weight", {c.kv_dim(), h});
    Add(m, p + "self_attn.v_proj.weight", {c.kv_dim(), h});
    Add(m, p + "self_attn.o_proj.weight", {h, c.q_dim()});
    Add(m, p + "post_attention_layernorm.weight", {h});
    Add(m, p + "mlp.gate_proj.weight", {inter, h});
    Add(m, p + "mlp.up_proj.weight", {inter, h});
    Add(m, p + "mlp.down_proj.weight", {h, inter});
  }
  Add(m, prefix + "norm.weight", {h});
  if (with_lm_head) Add(m, "lm_head.weight", {c.vocab_size, h});
  return m;
}

class LoadStageWeightsTest : public ::testing::Test {
 protected:
  // Writes config.json and model.safetensors into a fresh folder and opens it; tensors are F32
  // unless `dtypes` names them (their values then rounded to that dtype).
  std::unique_ptr<Checkpoint> Write(const ModelConfig& c, const TensorMap& tensors,
                                    const std::map<std::string, DType>& dtypes = {}) {
    const std::filesystem::path dir =
        std::filesystem::path(TANDEM_TEST_TMPDIR) / "weights_test" /
        ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "config.json") << ModelConfigToJson(c);
    std::vector<TensorToWrite> out;
    for (const auto& [name, t] : tensors) {
      const auto d = dtypes.find(name);
      const DType dtype = d == dtypes.end() ? DType::kF32 : d->second;
      TensorToWrite w{name, dtype, t.shape,
                      std::vector<std::byte>(t.values.size() * DTypeSize(dtype))};
      FromFloat(dtype, t.values.data(), t.values.size(), w.bytes.data());
      out.push_back(std::move(w));
    }
    EXPECT_TRUE(WriteSafetensors(dir / "model.safetensors", out).ok());
    auto ckpt = Checkpoint::Open(dir);
    EXPECT_TRUE(ckpt.ok()) << ckpt.status();
    return ckpt.ok() ? std::move(ckpt).value() : nullptr;
  }
};

// Stored (in, out) row-major, expected (out, in) row-major.
void ExpectTransposed(const std::vector<float>& got, const Tensor& stored) {
  const int64_t in = stored.shape[0], out = stored.shape[1];
  ASSERT_EQ(got.size(), stored.values.size());
  for (int64_t i = 0; i < in; ++i) {
    for (int64_t o = 0; o < out; ++o) {
      ASSERT_EQ(got[o * in + i], stored.values[i * out + o]) << "in " << i << " out " << o;
    }
  }
}

std::vector<float> Concat(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> all;
  for (const auto* p : parts) all.insert(all.end(), p->begin(), p->end());
  return all;
}

TEST_F(LoadStageWeightsTest, Gpt2ConvWeightsAreTransposedToOutIn) {
  const ModelConfig c = Gpt2Config();
  const TensorMap t = Gpt2Tensors(c, "transformer.");
  auto ckpt = Write(c, t);
  auto w = LoadStageWeights(*ckpt, 0, c.num_layers);
  ASSERT_TRUE(w.ok()) << w.status();
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = "transformer.h." + std::to_string(i) + ".";
    const LayerWeights& l = w->layers[i];
    // c_attn's q, k, v column blocks become row blocks of wqkv.
    ExpectTransposed(l.wqkv, t.at(p + "attn.c_attn.weight"));
    ExpectTransposed(l.wo, t.at(p + "attn.c_proj.weight"));
    ExpectTransposed(l.w_in, t.at(p + "mlp.c_fc.weight"));
    ExpectTransposed(l.w_out, t.at(p + "mlp.c_proj.weight"));
    EXPECT_EQ(l.attn_norm_w, t.at(p + "ln_1.weight").values);
    EXPECT_EQ(l.attn_norm_b, t.at(p + "ln_1.bias").values);
    EXPECT_EQ(l.bqkv, t.at(p + "attn.c_attn.bias").values);
    EXPECT_EQ(l.bo, t.at(p + "attn.c_proj.bias").values);
    EXPECT_EQ(l.mlp_norm_w, t.at(p + "ln_2.weight").values);
    EXPECT_EQ(l.mlp_norm_b, t.at(p + "ln_2.bias").values);
    EXPECT_EQ(l.b_in, t.at(p + "mlp.c_fc.bias").values);
    EXPECT_EQ(l.b_out, t.at(p + "mlp.c_proj.bias").values);
  }
  EXPECT_EQ(w->tok_embedding, t.at("transformer.wte.weight").values);
  EXPECT_EQ(w->pos_embedding, t.at("transformer.wpe.weight").values);
  EXPECT_EQ(w->final_norm_w, t.at("transformer.ln_f.weight").values);
  EXPECT_EQ(w->final_norm_b, t.at("transformer.ln_f.bias").values);
  EXPECT_EQ(w->lm_head, t.at("transformer.wte.weight").values);  // GPT-2 ties its head
}

TEST_F(LoadStageWeightsTest, Gpt2NamesWithoutTransformerPrefixLoadTheSame) {
  const ModelConfig c = Gpt2Config();
  const TensorMap t = Gpt2Tensors(c, "");
  auto ckpt = Write(c, t);
  auto w = LoadStageWeights(*ckpt, 0, c.num_layers);
  ASSERT_TRUE(w.ok()) << w.status();
  ExpectTransposed(w->layers[1].wqkv, t.at("h.1.attn.c_attn.weight"));
  EXPECT_EQ(w->tok_embedding, t.at("wte.weight").values);
  EXPECT_EQ(w->final_norm_b, t.at("ln_f.bias").values);
}

TEST_F(LoadStageWeightsTest, LlamaStacksQkvAndGateUpRows) {
  const ModelConfig c = LlamaConfig(/*tied=*/false);
  const TensorMap t = LlamaTensors(c, "model.", /*with_lm_head=*/true);
  auto ckpt = Write(c, t);
  auto w = LoadStageWeights(*ckpt, 0, c.num_layers);
  ASSERT_TRUE(w.ok()) << w.status();
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const LayerWeights& l = w->layers[i];
    EXPECT_EQ(l.wqkv, Concat({&t.at(p + "self_attn.q_proj.weight").values,
                              &t.at(p + "self_attn.k_proj.weight").values,
                              &t.at(p + "self_attn.v_proj.weight").values}));
    EXPECT_EQ(l.w_in, Concat({&t.at(p + "mlp.gate_proj.weight").values,
                              &t.at(p + "mlp.up_proj.weight").values}));
    EXPECT_EQ(l.wo, t.at(p + "self_attn.o_proj.weight").values);
    EXPECT_EQ(l.w_out, t.at(p + "mlp.down_proj.weight").values);
    EXPECT_EQ(l.attn_norm_w, t.at(p + "input_layernorm.weight").values);
    EXPECT_EQ(l.mlp_norm_w, t.at(p + "post_attention_layernorm.weight").values);
    EXPECT_TRUE(l.attn_norm_b.empty());
    EXPECT_TRUE(l.bqkv.empty());
    EXPECT_TRUE(l.b_in.empty());
  }
  EXPECT_TRUE(w->pos_embedding.empty());
  EXPECT_TRUE(w->final_norm_b.empty());
  EXPECT_EQ(w->final_norm_w, t.at("model.norm.weight").values);
  EXPECT_EQ(w->lm_head, t.at("lm_head.weight").values);
  EXPECT_NE(w->lm_head, w->tok_embedding);
}

// Values as a checkpoint stored in `dtype` holds them.
std::vector<float> Rounded(DType dtype, const std::vector<float>& v) {
  std::vector<uint16_t> stored(v.size());
  FromFloat(dtype, v.data(), v.size(), stored.data());
  std::vector<float> out(v.size());
  ToFloat(dtype, stored.data(), v.size(), out.data());
  return out;
}

TEST_F(LoadStageWeightsTest, PartsKeepTheirStoredDtypeAndReadAsTheirValues) {
  const ModelConfig c = LlamaConfig(/*tied=*/false);
  const TensorMap t = LlamaTensors(c, "model.", /*with_lm_head=*/true);
  std::map<std::string, DType> dtypes;
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    dtypes[p + "self_attn.q_proj.weight"] = DType::kF16;
    dtypes[p + "self_attn.k_proj.weight"] = DType::kBF16;
    dtypes[p + "mlp.down_proj.weight"] = DType::kBF16;
  }
  auto ckpt = Write(c, t, dtypes);
  auto sources = FindStageWeights(*ckpt, 0, c.num_layers);
  ASSERT_TRUE(sources.ok()) << sources.status();
  const TensorSource& qkv = sources->layers[1].wqkv;
  ASSERT_EQ(qkv.parts.size(), 3u);
  EXPECT_EQ(qkv.parts[0].name, "model.layers.1.self_attn.q_proj.weight");
  EXPECT_EQ(qkv.parts[0].dtype, DType::kF16);
  EXPECT_EQ(qkv.parts[1].dtype, DType::kBF16);
  EXPECT_EQ(qkv.parts[2].name, "model.layers.1.self_attn.v_proj.weight");
  EXPECT_EQ(qkv.parts[2].dtype, DType::kF32);
  EXPECT_FALSE(qkv.transposed);
  EXPECT_EQ(qkv.numel(), static_cast<int64_t>(c.q_dim() + 2 * c.kv_dim()) * c.hidden_size);

  auto w = LoadStageWeights(*ckpt, 0, c.num_layers);
  ASSERT_TRUE(w.ok()) << w.status();
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const std::vector<float> q = Rounded(DType::kF16, t.at(p + "self_attn.q_proj.weight").values);
    const std::vector<float> k = Rounded(DType::kBF16, t.at(p + "self_attn.k_proj.weight").values);
    EXPECT_EQ(w->layers[i].wqkv, Concat({&q, &k, &t.at(p + "self_attn.v_proj.weight").values}));
    EXPECT_EQ(w->layers[i].w_out, Rounded(DType::kBF16, t.at(p + "mlp.down_proj.weight").values));
  }
}

TEST_F(LoadStageWeightsTest, SmallConversionPiecesReadTheSame) {
  const ModelConfig c = LlamaConfig(/*tied=*/false);
  const TensorMap t = LlamaTensors(c, "model.", /*with_lm_head=*/true);
  auto ckpt = Write(c, t, {{"model.layers.0.self_attn.k_proj.weight", DType::kBF16}});
  auto sources = FindStageWeights(*ckpt, 0, c.num_layers);
  ASSERT_TRUE(sources.ok()) << sources.status();
  const StageWeights whole = ReadStageWeights(*sources);
  const StageWeights pieces = ReadStageWeights(*sources, /*piece_elements=*/5);
  EXPECT_EQ(pieces.tok_embedding, whole.tok_embedding);
  EXPECT_EQ(pieces.lm_head, whole.lm_head);
  for (int i = 0; i < c.num_layers; ++i) {
    EXPECT_EQ(pieces.layers[i].wqkv, whole.layers[i].wqkv) << "layer " << i;
    EXPECT_EQ(pieces.layers[i].w_in, whole.layers[i].w_in) << "layer " << i;
    EXPECT_EQ(pieces.layers[i].w_out, whole.layers[i].w_out) << "layer " << i;
  }
}

TEST_F(LoadStageWeightsTest, Gpt2ConvSourcesAreMarkedTransposed) {
  const ModelConfig c = Gpt2Config();
  auto ckpt = Write(c, Gpt2Tensors(c, "transformer."));
  auto sources = FindStageWeights(*ckpt, 0, 1);
  ASSERT_TRUE(sources.ok()) << sources.status();
  EXPECT_TRUE(sources->layers[0].wqkv.transposed);
  EXPECT_TRUE(sources->layers[0].w_out.transposed);
  EXPECT_FALSE(sources->layers[0].bqkv.transposed);
  EXPECT_FALSE(sources->tok_embedding.transposed);
}

TEST_F(LoadStageWeightsTest, LlamaNamesWithoutModelPrefixLoadTheSame) {
  const ModelConfig c = LlamaConfig(/*tied=*/false);
  const TensorMap t = LlamaTensors(c, "", /*with_lm_head=*/true);
  auto ckpt = Write(c, t);
  auto w = LoadStageWeights(*ckpt, 0, c.num_layers);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->tok_embedding, t.at("embed_tokens.weight").values);
  EXPECT_EQ(w->layers[2].wo, t.at("layers.2.self_attn.o_proj.weight").values);
}

TEST_F(LoadStageWeightsTest, RangesLoadOnlyTheirPartsOfTheModel) {
  const ModelConfig c = LlamaConfig(/*tied=*/false);
  const TensorMap t = LlamaTensors(c, "model.", /*with_lm_head=*/true);
  auto ckpt = Write(c, t);

  auto first = LoadStageWeights(*ckpt, 0, 1);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->has_embedding);
  EXPECT_FALSE(first->has_head);
  EXPECT_EQ(first->layers.size(), 1u);
  EXPECT_TRUE(first->lm_head.empty());
  EXPECT_TRUE(first->final_norm_w.empty());

  auto middle = LoadStageWeights(*ckpt, 1, 2);
  ASSERT_TRUE(middle.ok()) << middle.status();
  EXPECT_FALSE(middle->has_embedding);
  EXPECT_FALSE(middle->has_head);
  EXPECT_TRUE(middle->tok_embedding.empty());
  ASSERT_EQ(middle->layers.size(), 1u);
  EXPECT_EQ(middle->layers[0].wo, t.at("model.layers.1.self_attn.o_proj.weight").values);

  auto last = LoadStageWeights(*ckpt, 1, 3);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->first_layer, 1);
  EXPECT_EQ(last->last_layer, 3);
  EXPECT_FALSE(last->has_embedding);
  EXPECT_TRUE(last->has_head);
  ASSERT_EQ(last->layers.size(), 2u);
  EXPECT_EQ(last->layers[1].wo, t.at("model.layers.2.self_attn.o_proj.weight").values);
  EXPECT_EQ(last->lm_head, t.at("lm_head.weight").values);
}

TEST_F(LoadStageWeightsTest, TensorsOutsideTheRangeAreNotNeeded) {
  const ModelConfig c = LlamaConfig(/*tied=*/false);
  TensorMap t = LlamaTensors(c, "model.", /*with_lm_head=*/true);
  t.erase("model.embed_tokens.weight");
  t.erase("model.layers.0.self_attn.q_proj.weight");
  auto ckpt = Write(c, t);
  auto w = LoadStageWeights(*ckpt, 1, 3);
  EXPECT_TRUE(w.ok()) << w.status();
}

TEST_F(LoadStageWeightsTest, TiedHeadIsTheTokenEmbeddingEvenOnALaterStage) {
  const ModelConfig c = LlamaConfig(/*tied=*/true);
  const TensorMap t = LlamaTensors(c, "model.", /*with_lm_head=*/false);
  auto ckpt = Write(c, t);
  auto whole = LoadStageWeights(*ckpt, 0, 3);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->lm_head, t.at("model.embed_tokens.weight").values);
  auto last = LoadStageWeights(*ckpt, 2, 3);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_TRUE(last->tok_embedding.empty());
  EXPECT_EQ(last->lm_head, t.at("model.embed_tokens.weight").values);
}

TEST_F(LoadStageWeightsTest, UntiedHeadWithoutLmHeadIsNotFound) {
  const ModelConfig c = LlamaConfig(/*tied=*/false);
  auto ckpt = Write(c, LlamaTensors(c, "model.", /*with_lm_head=*/false));
  auto w = LoadStageWeights(*ckpt, 0, 3);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(w.status().message(), HasSubstr("lm_head.weight"));
  // A stage without the head does not need it.
  EXPECT_TRUE(LoadStageWeights(*ckpt, 0, 2).ok());
}

TEST_F(LoadStageWeightsTest, MissingTensorIsNotFoundNamingIt) {
  const ModelConfig c = Gpt2Config();
  TensorMap t = Gpt2Tensors(c, "transformer.");
  t.erase("transformer.h.1.mlp.c_fc.bias");
  auto ckpt = Write(c, t);
  auto w = LoadStageWeights(*ckpt, 0, 3);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(w.status().message(), HasSubstr("h.1.mlp.c_fc.bias"));
}

TEST_F(LoadStageWeightsTest, WrongShapeNamesTensorAndBothShapes) {
  const ModelConfig c = LlamaConfig(/*tied=*/false);
  TensorMap t = LlamaTensors(c, "model.", /*with_lm_head=*/true);
  // k_proj stored as if there were as many KV heads as query heads: (q_dim, hidden).
  t.erase("model.layers.1.self_attn.k_proj.weight");
  Add(t, "model.layers.1.self_attn.k_proj.weight", {c.q_dim(), c.hidden_size});
  auto ckpt = Write(c, t);
  auto w = LoadStageWeights(*ckpt, 0, 3);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(w.status().message(), AllOf(HasSubstr("model.layers.1.self_attn.k_proj.weight"),
                                          HasSubstr("[4, 8]"), HasSubstr("[8, 8]")));
}

TEST_F(LoadStageWeightsTest, Gpt2TransposedConvWeightIsAShapeError) {
  const ModelConfig c = Gpt2Config();
  TensorMap t = Gpt2Tensors(c, "transformer.");
  // c_fc written in Linear's (out, in) orientation instead of Conv1D's (in, out).
  t.erase("transformer.h.0.mlp.c_fc.weight");
  Add(t, "transformer.h.0.mlp.c_fc.weight", {c.intermediate_size, c.hidden_size});
  auto ckpt = Write(c, t);
  auto w = LoadStageWeights(*ckpt, 0, 1);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(w.status().message(),
              AllOf(HasSubstr("h.0.mlp.c_fc.weight"), HasSubstr("[4, 6]"), HasSubstr("[6, 4]")));
}

TEST_F(LoadStageWeightsTest, BadLayerRangesAreRejected) {
  const ModelConfig c = LlamaConfig(/*tied=*/false);
  auto ckpt = Write(c, LlamaTensors(c, "model.", /*with_lm_head=*/true));
  for (auto [first, last] : std::vector<std::pair<int, int>>{{-1, 2}, {0, 4}, {2, 2}, {3, 1}}) {
    auto w = LoadStageWeights(*ckpt, first, last);
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << first << ", " << last;
    EXPECT_THAT(w.status().message(), AllOf(HasSubstr("layer range [" + std::to_string(first) +
                                                      ", " + std::to_string(last) + ")"),
                                            HasSubstr("3 layers")));
  }
}

// A view of `values` stored as `dtype`, its bytes kept in `store`.
TensorView View(std::vector<std::vector<std::byte>>& store, DType dtype, std::vector<int64_t> shape,
                const std::vector<float>& values) {
  store.emplace_back(values.size() * DTypeSize(dtype));
  FromFloat(dtype, values.data(), values.size(), store.back().data());
  TensorView v;
  v.name = "t" + std::to_string(store.size());
  v.dtype = dtype;
  v.shape = std::move(shape);
  v.data = std::span<const std::byte>(store.back());
  return v;
}

// n (<= 15) distinct values, in an order of `tensor`'s own; integers of magnitude 1 to 15, which
// every dtype (E4M3 too) holds exactly.
std::vector<float> Values(int tensor, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) {
    v[e] = (e % 2 ? -1.0f : 1.0f) * static_cast<float>(1 + (e + 3 * tensor) % 15);
  }
  return v;
}

// Every row range of a source reads as those rows of the whole source's conversion: stacked parts
// of different dtypes, a transposed (Conv1D) part, FP8 parts with per-row and with block scales
// (ranges that start and end inside a block and across parts), and stacked 1-D tensors.
TEST(SourceRowsToFloatTest, AnyRowRangeReadsAsThoseRowsOfTheWholeConversion) {
  std::vector<std::vector<std::byte>> store;
  store.reserve(32);  // the views point into it
  struct Case {
    std::string name;
    TensorSource src;
    int64_t rows;  // in the engine's layout
  };
  std::vector<Case> cases;
  {
    Case c{"stacked q, k, v", {}, 6};
    c.src.parts = {View(store, DType::kF32, {2, 3}, Values(1, 6)),
                   View(store, DType::kBF16, {3, 3}, Values(2, 9)),
                   View(store, DType::kF16, {1, 3}, Values(3, 3))};
    cases.push_back(std::move(c));
  }
  {
    Case c{"Conv1D stored (3, 5)", {}, 5};
    c.src.parts = {View(store, DType::kF32, {3, 5}, Values(4, 15))};
    c.src.transposed = true;
    cases.push_back(std::move(c));
  }
  {
    Case c{"stacked biases", {}, 6};
    c.src.parts = {View(store, DType::kF32, {4}, Values(5, 4)),
                   View(store, DType::kBF16, {2}, Values(6, 2))};
    cases.push_back(std::move(c));
  }
  for (auto scales : {WeightQuantization::Scales::kChannel, WeightQuantization::Scales::kBlock}) {
    const bool block = scales == WeightQuantization::Scales::kBlock;
    Case c{block ? "FP8, 2 x 2 blocks" : "FP8, per row", {}, 8};
    c.src.quantization.method = WeightQuantization::Method::kFp8;
    c.src.quantization.scales = scales;
    c.src.quantization.block_rows = c.src.quantization.block_cols = block ? 2 : 0;
    c.src.parts = {View(store, DType::kF8E4M3, {5, 3}, Values(7, 15)),
                   View(store, DType::kF8E4M3, {3, 3}, Values(8, 9))};
    auto scale = [&](int64_t n, int first) {
      std::vector<float> v(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) v[i] = 0.25f * static_cast<float>(first + i + 1);
      return View(store, DType::kF32, {n, 1}, v);
    };
    c.src.scales = block ? std::vector<TensorView>{scale(6, 0), scale(4, 6)}
                         : std::vector<TensorView>{scale(5, 0), scale(3, 5)};
    if (block) {
      c.src.scales[0].shape = {3, 2};
      c.src.scales[1].shape = {2, 2};
    }
    cases.push_back(std::move(c));
  }
  for (const Case& c : cases) {
    const int64_t width = c.src.numel() / c.rows;
    std::vector<float> whole(static_cast<size_t>(c.src.numel()));
    SourceToFloat(c.src, whole.data());
    for (int64_t first = 0; first < c.rows; ++first) {
      for (int64_t n = 1; first + n <= c.rows; ++n) {
        constexpr float kUntouched = -12345.0f;
        std::vector<float> got(static_cast<size_t>(n * width + 1), kUntouched);
        SourceRowsToFloat(c.src, first, n, got.data());
        EXPECT_EQ(got.back(), kUntouched)
            << c.name << ": wrote past rows [" << first << ", " << first + n << ")";
        got.pop_back();
        EXPECT_EQ(got, std::vector<float>(whole.begin() + first * width,
                                          whole.begin() + (first + n) * width))
            << c.name << ": rows [" << first << ", " << first + n << ")";
      }
    }
  }
}

}  // namespace
}  // namespace tandem
