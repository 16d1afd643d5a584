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

TEST(ModelConfigTest, MissingFileIsNotFound) {
  auto c = LoadModelConfig("/nonexistent/model");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(c.status().message().find("/nonexistent/model/config.json"), std::string::npos);
}

}  // namespace
}  // namespace tandem
