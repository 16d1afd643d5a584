#include "common/model_config.h"

#include <gtest/gtest.h>

namespace tandem {
namespace {

constexpr char kLlama[] = R"({
  "model_type": "llama", "vocab_size": 32000, "hidden_size": 3200, "intermediate_size": 8640,
  "num_hidden_layers": 26, "num_attention_heads": 32, "num_key_value_heads": 8,
  "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
  "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16"})";

constexpr char kGpt2[] = R"({
  "model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
  "n_positions": 1024, "n_inner": null, "layer_norm_epsilon": 1e-5, "eos_token_id": 50256})";

TEST(ModelConfigTest, ParsesLlamaWithGroupedQueryHeads) {
  auto c = ParseModelConfig(kLlama, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Arch::kLlama);
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 100);
  EXPECT_EQ(c->kv_dim(), 800);
  EXPECT_FLOAT_EQ(c->norm_eps, 1e-6f);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->dtype, DType::kF16);
  EXPECT_EQ(c->eos_token_id, 2);
}

TEST(ModelConfigTest, ParsesGpt2WithDefaults) {
  auto c = ParseModelConfig(kGpt2, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Arch::kGpt2);
  EXPECT_EQ(c->intermediate_size, 4 * 768);  // n_inner null
  EXPECT_EQ(c->num_kv_heads, 12);
  EXPECT_TRUE(c->tie_word_embeddings);       // GPT-2 ties by default
  EXPECT_EQ(c->max_positions, 1024);
}

TEST(ModelConfigTest, RopeThetaInsideRopeParameters) {
  std::string j = kLlama;
  j.replace(j.find("\"rope_theta\": 10000.0"), 21,
            R"("rope_parameters": {"rope_type": "default", "rope_theta": 500000.0})");
  auto c = ParseModelConfig(j, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FLOAT_EQ(c->rope_theta, 500000.0f);
}

TEST(ModelConfigTest, RoundTripsThroughJson) {
  for (const char* text : {kLlama, kGpt2}) {
    auto c = ParseModelConfig(text, "a");
    ASSERT_TRUE(c.ok());
    auto again = ParseModelConfig(ModelConfigToJson(*c), "b");
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->arch, c->arch);
    EXPECT_EQ(again->hidden_size, c->hidden_size);
    EXPECT_EQ(again->intermediate_size, c->intermediate_size);
    EXPECT_EQ(again->num_kv_heads, c->num_kv_heads);
    EXPECT_EQ(again->tie_word_embeddings, c->tie_word_embeddings);
    EXPECT_FLOAT_EQ(again->norm_eps, c->norm_eps);
    EXPECT_EQ(again->eos_token_id, c->eos_token_id);
  }
}

struct BadConfig {
  const char* name;
  std::string json;
  absl::StatusCode code;
  const char* mentions;  // the message names the problem
};

TEST(ModelConfigTest, BadConfigsGetErrorsNamingTheProblem) {
  auto with = [](std::string base, const std::string& from, const std::string& to) {
    base.replace(base.find(from), from.size(), to);
    return base;
  };
  const std::vector<BadConfig> cases = {
      {"not json", "{ nope", absl::StatusCode::kInvalidArgument, "not valid JSON"},
      {"array", "[1, 2]", absl::StatusCode::kInvalidArgument, "JSON object"},
      {"no model_type", "{\"vocab_size\": 3}", absl::StatusCode::kInvalidArgument, "model_type"},
      {"unknown arch", with(kLlama, "\"llama\"", "\"mamba\""), absl::StatusCode::kUnimplemented,
       "mamba"},
      {"missing field", with(kLlama, "\"hidden_size\": 3200,", ""),
       absl::StatusCode::kInvalidArgument, "hidden_size"},
      {"string size", with(kLlama, "\"hidden_size\": 3200", "\"hidden_size\": \"big\""),
       absl::StatusCode::kInvalidArgument, "hidden_size"},
      {"negative layers", with(kLlama, "\"num_hidden_layers\": 26", "\"num_hidden_layers\": -1"),
       absl::StatusCode::kInvalidArgument, "num_layers"},
      {"kv heads", with(kLlama, "\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5"),
       absl::StatusCode::kInvalidArgument, "num_key_value_heads"},
      {"heads vs hidden", with(kGpt2, "\"n_head\": 12", "\"n_head\": 7"),
       absl::StatusCode::kInvalidArgument, "divisible"},
      {"rope scaling", with(kLlama, "\"rope_theta\": 10000.0",
                            R"("rope_scaling": {"rope_type": "yarn", "factor": 4.0})"),
       absl::StatusCode::kUnimplemented, "yarn"},
      {"dtype", with(kLlama, "\"float16\"", "\"int4\""), absl::StatusCode::kInvalidArgument,
       "int4"},
  };
  for (const auto& bad : cases) {
    auto c = ParseModelConfig(bad.json, "/models/x/config.json");
    ASSERT_FALSE(c.ok()) << bad.name;
    EXPECT_EQ(c.status().code(), bad.code) << bad.name << ": " << c.status();
    EXPECT_NE(c.status().message().find(bad.mentions), std::string::npos)
        << bad.name << ": " << c.status();
    EXPECT_NE(c.status().message().find("/models/x/config.json"), std::string::npos) << bad.name;
  }
}

// Sizes whose products would wrap (head_dim 2^30 made q_dim() overflow) are refused at load,
// naming the field and the bound; the largest published shapes still load.
TEST(ModelConfigTest, DimensionsBeyondTheBoundsAreRefusedNamingFieldAndLimit) {
  auto with = [](std::string base, const std::string& from, const std::string& to) {
    base.replace(base.find(from), from.size(), to);
    return base;
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {with(kLlama, "\"rope_theta\"", "\"head_dim\": 1073741824, \"rope_theta\""),
       "\"head_dim\" is 1073741824, above tandem's limit of 4096"},
      {with(kLlama, "\"vocab_size\": 32000", "\"vocab_size\": 2147483647"),
       "\"vocab_size\" is 2147483647, above tandem's limit of 4194304"},
      {with(kLlama, "\"hidden_size\": 3200", "\"hidden_size\": 131072"),
       "\"hidden_size\" is 131072, above tandem's limit of 65536"},
      {with(kLlama, "\"intermediate_size\": 8640", "\"intermediate_size\": 1000000"),
       "\"intermediate_size\" is 1000000"},
      {with(kLlama, "\"num_hidden_layers\": 26", "\"num_hidden_layers\": 100000"),
       "\"num_layers\" is 100000"},
      {with(with(kLlama, "\"num_attention_heads\": 32", "\"num_attention_heads\": 1024"),
            "\"rope_theta\"", "\"head_dim\": 4096, \"rope_theta\""),
       "num_attention_heads 1024 x head_dim 4096 is above tandem's limit of 1048576"},
  };
  for (const auto& [json, message] : cases) {
    auto c = ParseModelConfig(json, "/models/x/config.json");
    ASSERT_FALSE(c.ok()) << message;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
    EXPECT_NE(c.status().message().find(message), std::string::npos) << c.status();
  }
  auto largest = ParseModelConfig(
      R"({"model_type": "llama", "vocab_size": 262144, "hidden_size": 16384,
          "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128,
          "num_key_value_heads": 8, "max_position_embeddings": 2147483647})",
      "config.json");
  ASSERT_TRUE(largest.ok()) << largest.status();
  EXPECT_EQ(largest->q_dim(), 16384);
  EXPECT_EQ(largest->max_positions, 2147483647);
}

TEST(ModelConfigTest, Llama31RopeScalingIsRead) {
  std::string j = kLlama;
  j.replace(j.find("\"rope_theta\": 10000.0"), 21,
            R"("rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
               "rope_type": "llama3"})");
  auto c = ParseModelConfig(j, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FLOAT_EQ(c->rope_theta, 500000.0f);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_FLOAT_EQ(c->rope_scaling.factor, 8.0f);
  EXPECT_FLOAT_EQ(c->rope_scaling.low_freq_factor, 1.0f);
  EXPECT_FLOAT_EQ(c->rope_scaling.high_freq_factor, 4.0f);
  EXPECT_EQ(c->rope_scaling.original_max_positions, 8192);
  // transformers 5 spells it rope_parameters, rope_theta inside; "type" is the older key.
  std::string k = kLlama;
  k.replace(k.find("\"rope_theta\": 10000.0"), 21,
            R"("rope_parameters": {"type": "linear", "factor": 2.0, "rope_theta": 1e6})");
  auto linear = ParseModelConfig(k, "config.json");
  ASSERT_TRUE(linear.ok()) << linear.status();
  EXPECT_EQ(linear->rope_scaling.type, RopeScaling::Type::kLinear);
  EXPECT_FLOAT_EQ(linear->rope_scaling.factor, 2.0f);
  EXPECT_FLOAT_EQ(linear->rope_theta, 1e6f);
}

TEST(ModelConfigTest, MistralWindowIsReadAndNullMeansNone) {
  std::string j = kLlama;
  j.replace(j.find("\"llama\""), 7, "\"mistral\"");
  auto absent = ParseModelConfig(j, "config.json");
  ASSERT_TRUE(absent.ok()) << absent.status();
  EXPECT_EQ(absent->model_type, "mistral");
  EXPECT_EQ(absent->attention_window(0), 4096);  // MistralConfig's default
  auto given = ParseModelConfig(j.substr(0, j.size() - 1) + R"(, "sliding_window": 32})", "c");
  ASSERT_TRUE(given.ok()) << given.status();
  EXPECT_EQ(given->attention_window(25), 32);
  auto none = ParseModelConfig(j.substr(0, j.size() - 1) + R"(, "sliding_window": null})", "c");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->attention_window(0), 0);
}

// Qwen2: q/k/v biases always; the window only with use_sliding_window, on the layers from
// max_window_layers on or those layer_types names sliding.
TEST(ModelConfigTest, Qwen2BiasesAndWindowedLayers) {
  std::string j = kLlama;
  j.replace(j.find("\"llama\""), 7, "\"qwen2\"");
  auto with = [&](const std::string& extra) {
    return ParseModelConfig(j.substr(0, j.size() - 1) + ", " + extra + "}", "config.json");
  };
  auto off = with(R"("use_sliding_window": false, "sliding_window": 131072,
                     "max_window_layers": 20)");
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_TRUE(off->qkv_bias);
  EXPECT_FALSE(off->o_bias);
  for (int l = 0; l < 26; ++l) EXPECT_EQ(off->attention_window(l), 0) << l;
  auto on = with(R"("use_sliding_window": true, "sliding_window": 64, "max_window_layers": 20)");
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(on->attention_window(19), 0);
  EXPECT_EQ(on->attention_window(20), 64);
  EXPECT_EQ(on->attention_window(25), 64);
  // A negative max_window_layers: every layer slides (i >= max_window_layers for all i).
  auto all = with(R"("use_sliding_window": true, "sliding_window": 64, "max_window_layers": -1)");
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->attention_window(0), 64);
  EXPECT_EQ(all->attention_window(25), 64);
  std::string types = R"("use_sliding_window": true, "sliding_window": 64, "layer_types": [)";
  for (int l = 0; l < 26; ++l) {
    types += std::string(l ? ", " : "") + (l % 2 ? "\"sliding_attention\"" : "\"full_attention\"");
  }
  auto listed = with(types + "]");
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->attention_window(0), 0);
  EXPECT_EQ(listed->attention_window(1), 64);
}

// Qwen3 (Qwen/Qwen3-0.6B's shape: head_dim 128 with hidden 1024 and 16 heads): the per-head q/k
// norm, head_dim as given or Qwen3Config's 128, attention_bias on all four projections, Qwen2's
// window fields; written back as Qwen3ForCausalLM.
TEST(ModelConfigTest, Qwen3QkNormHeadDimBiasAndWindow) {
  constexpr char kQwen3[] = R"({
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
    "rope_scaling": null, "attention_bias": false, "use_sliding_window": false,
    "sliding_window": null, "max_window_layers": 28, "tie_word_embeddings": true,
    "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645,
    "torch_dtype": "bfloat16"})";
  std::string j = kQwen3;
  auto with = [&](const std::string& extra) {
    return ParseModelConfig(j.substr(0, j.size() - 1) + ", " + extra + "}", "config.json");
  };
  auto c = ParseModelConfig(j, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Arch::kLlama);
  EXPECT_EQ(c->model_type, "qwen3");
  EXPECT_TRUE(c->qk_norm);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->q_dim(), 2048);
  EXPECT_EQ(c->kv_dim(), 1024);
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_FALSE(c->o_bias);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->attention_window(27), 0);
  EXPECT_FLOAT_EQ(c->rope_theta, 1e6f);
  EXPECT_EQ(c->eos_token_id, 151645);
  auto biased = with(R"("attention_bias": true)");
  ASSERT_TRUE(biased.ok()) << biased.status();
  EXPECT_TRUE(biased->qkv_bias);
  EXPECT_TRUE(biased->o_bias);
  auto windowed = with(R"("use_sliding_window": true, "sliding_window": 64,
                          "max_window_layers": 20)");
  ASSERT_TRUE(windowed.ok()) << windowed.status();
  EXPECT_EQ(windowed->attention_window(19), 0);
  EXPECT_EQ(windowed->attention_window(20), 64);
  // Without head_dim: Qwen3Config's default of 128, not hidden / heads (64).
  std::string no_hd = j;
  no_hd.erase(no_hd.find(R"("head_dim": 128,)"), 16);
  auto defaulted = ParseModelConfig(no_hd, "config.json");
  ASSERT_TRUE(defaulted.ok()) << defaulted.status();
  EXPECT_EQ(defaulted->head_dim, 128);
  auto mlp_bias = with(R"("mlp_bias": true)");
  EXPECT_EQ(mlp_bias.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(mlp_bias.status().message().find("mlp_bias"), std::string::npos);
  // Round trip: the same shape and the qwen3 names.
  const std::string written = ModelConfigToJson(*windowed);
  EXPECT_NE(written.find("Qwen3ForCausalLM"), std::string::npos);
  auto back = ParseModelConfig(written, "written");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->model_type, "qwen3");
  EXPECT_TRUE(back->qk_norm);
  EXPECT_EQ(back->head_dim, 128);
  EXPECT_EQ(back->attention_window(19), 0);
  EXPECT_EQ(back->attention_window(20), 64);
  // Other Llama-family types have no q/k norm.
  auto llama = ParseModelConfig(kLlama, "config.json");
  ASSERT_TRUE(llama.ok());
  EXPECT_FALSE(llama->qk_norm);
}

TEST(ModelConfigTest, ExplicitHeadDimAndGpt2ScalingFlagsAreRead) {
  std::string j = kLlama;
  auto hd = ParseModelConfig(j.substr(0, j.size() - 1) + R"(, "head_dim": 128})", "c");
  ASSERT_TRUE(hd.ok()) << hd.status();
  EXPECT_EQ(hd->head_dim, 128);
  EXPECT_EQ(hd->q_dim(), 4096);
  std::string g = kGpt2;
  g = g.substr(0, g.size() - 1) +
      R"(, "scale_attn_weights": false, "scale_attn_by_inverse_layer_idx": true,
          "reorder_and_upcast_attn": true})";
  auto gpt2 = ParseModelConfig(g, "c");
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  EXPECT_FLOAT_EQ(gpt2->attention_scale(0), 1.0f);
  EXPECT_FLOAT_EQ(gpt2->attention_scale(3), 0.25f);
  auto plain = ParseModelConfig(kGpt2, "c");
  EXPECT_FLOAT_EQ(plain->attention_scale(5), 0.125f);  // 1 / sqrt(64)
}

// Fields that change the math in ways not implemented are refused, naming the field.
TEST(ModelConfigTest, UnimplementedMathIsRefusedNamingTheField) {
  auto add = [](std::string base, const std::string& extra) {
    return base.substr(0, base.size() - 1) + ", " + extra + "}";
  };
  std::string mistral = kLlama;
  mistral.replace(mistral.find("\"llama\""), 7, "\"mistral\"");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {add(kLlama, R"("mlp_bias": true)"), "mlp_bias"},
      {add(kLlama, R"("rope_scaling": {"rope_type": "dynamic", "factor": 2.0})"), "dynamic"},
      {add(kLlama, R"("rope_scaling": {"type": "yarn", "factor": 4.0})"), "yarn"},
      {add(kLlama, R"("partial_rotary_factor": 0.5)"), "partial_rotary_factor"},
      {add(kLlama, R"("hidden_act": "gelu")"), "hidden_act"},
      {add(kGpt2, R"("add_cross_attention": true)"), "add_cross_attention"},
      {add(mistral, R"("layer_types": ["full_attention"])"), "layer_types"},
  };
  for (const auto& [json, field] : cases) {
    auto c = ParseModelConfig(json, "/m/config.json");
    ASSERT_FALSE(c.ok()) << field;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented) << c.status();
    EXPECT_NE(c.status().message().find(field), std::string::npos) << c.status();
  }
  // Llama's attention_bias is implemented: q, k, v and o biases.
  auto bias = ParseModelConfig(add(kLlama, R"("attention_bias": true)"), "c");
  ASSERT_TRUE(bias.ok()) << bias.status();
  EXPECT_TRUE(bias->qkv_bias && bias->o_bias);
}

TEST(ModelConfigTest, MissingFileIsNotFound) {
  auto c = LoadModelConfig("/nonexistent/model");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(c.status().message().find("/nonexistent/model/config.json"), std::string::npos);
}

TEST(ModelConfigTest, ConfigNestedPastTheJsonBoundIsRefusedNamingTheField) {
  std::string text = kLlama;
  // The object plus `levels` arrays in "architectures".
  auto with_nesting = [&](int levels) {
    return std::string(text).insert(
        1, "\"architectures\": " + std::string(levels, '[') + std::string(levels, ']') + ", ");
  };
  EXPECT_TRUE(ParseModelConfig(with_nesting(127), "config.json").ok());
  for (int levels : {128, 100000}) {
    auto c = ParseModelConfig(with_nesting(levels), "config.json");
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find("config.json: architectures[0]"), std::string::npos)
        << c.status();
    EXPECT_NE(c.status().message().find("deeper than 128 levels"), std::string::npos);
  }
}

// Which heads the CUDA backend pages: any group where head_dim is a multiple of 8; a multiple of 4
// (openllama-3b's 100) up to 128 with at most 8 query heads per kv head; nothing else.
TEST(ModelConfigTest, CudaPagesTakeHeadsOfTheDecodeKernelsReach) {
  EXPECT_TRUE(CudaPagesTakeHeads(128, 4));
  EXPECT_TRUE(CudaPagesTakeHeads(64, 16));
  EXPECT_TRUE(CudaPagesTakeHeads(256, 16));
  EXPECT_TRUE(CudaPagesTakeHeads(100, 1));
  EXPECT_TRUE(CudaPagesTakeHeads(100, 8));
  EXPECT_TRUE(CudaPagesTakeHeads(124, 7));
  EXPECT_FALSE(CudaPagesTakeHeads(100, 9));
  EXPECT_FALSE(CudaPagesTakeHeads(132, 1));
  EXPECT_FALSE(CudaPagesTakeHeads(98, 1));
  EXPECT_FALSE(CudaPagesTakeHeads(102, 2));
  EXPECT_FALSE(CudaPagesTakeHeads(0, 1));
  EXPECT_FALSE(CudaPagesTakeHeads(100, 0));
}

}  // namespace
}  // namespace tandem
