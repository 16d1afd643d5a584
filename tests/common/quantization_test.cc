// quantization_config: the fp8 and compressed-tensors forms published FP8 checkpoints use, the
// scale layouts they imply, and every other scheme refused by name.
#include "common/quantization.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/model_config.h"

namespace tandem {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using Q = WeightQuantization;
using nlohmann::json;

absl::StatusOr<Q> Parse(const std::string& qc) {
  return ParseQuantizationConfig(json::parse(R"({"quantization_config": )" + qc + "}"),
                                 "config.json");
}

// As Meta-Llama-3.1-8B-Instruct-FP8 (neuralmagic, compressed-tensors) ships it.
constexpr const char* kCompressedTensorsChannel = R"({
  "quant_method": "compressed-tensors", "format": "float-quantized",
  "quantization_status": "compressed", "ignore": ["lm_head"],
  "config_groups": {"group_0": {"targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": false,
                "symmetric": true},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true,
                          "symmetric": true}}}})";

TEST(QuantizationTest, AbsentOrNullIsNone) {
  EXPECT_FALSE(ParseQuantizationConfig(json::object(), "c")->fp8());
  EXPECT_FALSE(Parse("null")->fp8());
}

TEST(QuantizationTest, Fp8PerTensorDynamicAndStatic) {
  auto q = Parse(R"({"quant_method": "fp8", "activation_scheme": "dynamic"})");
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->method, Q::Method::kFp8);
  EXPECT_EQ(q->scales, Q::Scales::kTensor);
  EXPECT_FALSE(q->static_input_scales);
  EXPECT_EQ(q->scale_suffix(), "weight_scale");
  q = Parse(
      R"({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]})");
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(q->static_input_scales);
}

TEST(QuantizationTest, Fp8BlockSizeMeansBlockScalesCalledScaleInv) {
  auto q = Parse(
      R"({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 64]})");
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->scales, Q::Scales::kBlock);
  EXPECT_EQ(q->block_rows, 128);
  EXPECT_EQ(q->block_cols, 64);
  EXPECT_EQ(q->scale_suffix(), "weight_scale_inv");
}

TEST(QuantizationTest, CompressedTensorsChannelDynamicTokenAndTensorStatic) {
  auto q = Parse(kCompressedTensorsChannel);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->method, Q::Method::kCompressedTensors);
  EXPECT_EQ(q->scales, Q::Scales::kChannel);
  EXPECT_FALSE(q->static_input_scales);
  json j = json::parse(kCompressedTensorsChannel);
  j["config_groups"]["group_0"]["weights"]["strategy"] = "tensor";
  j["config_groups"]["group_0"]["input_activations"] = {
      {"num_bits", 8}, {"type", "float"}, {"strategy", "tensor"}, {"dynamic", false}};
  q = Parse(j.dump());
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->scales, Q::Scales::kTensor);
  EXPECT_TRUE(q->static_input_scales);
  j["config_groups"]["group_0"]["input_activations"] = nullptr;  // weight-only
  EXPECT_TRUE(Parse(j.dump()).ok());
}

TEST(QuantizationTest, OtherMethodsAndSchemesAreRefusedNamingFieldAndValue) {
  struct Case {
    std::string qc;
    std::string names;
  };
  json ct = json::parse(kCompressedTensorsChannel);
  json int8 = ct, group = ct, pack = ct, static_token = ct;
  int8["config_groups"]["group_0"]["weights"]["type"] = "int";
  group["config_groups"]["group_0"]["weights"]["strategy"] = "group";
  pack["format"] = "pack-quantized";
  static_token["config_groups"]["group_0"]["input_activations"]["dynamic"] = false;
  const std::vector<Case> cases = {
      {R"({"quant_method": "gptq", "bits": 4})", "\"gptq\""},
      {R"({"quant_method": "awq"})", "\"awq\""},
      {R"({"load_in_8bit": true})", "quant_method"},
      {R"({"quant_method": "fp8", "activation_scheme": "sometimes"})", "\"sometimes\""},
      {R"({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128]})",
       "weight_block_size"},
      {int8.dump(), "weights.type"},
      {group.dump(), "\"group\""},
      {pack.dump(), "\"pack-quantized\""},
      {static_token.dump(), "input_activations.strategy"},
  };
  for (const Case& c : cases) {
    auto q = Parse(c.qc);
    EXPECT_EQ(q.status().code(), absl::StatusCode::kUnimplemented) << c.qc;
    EXPECT_THAT(q.status().message(), AllOf(HasSubstr("config.json"), HasSubstr(c.names))) << c.qc;
  }
}

TEST(QuantizationTest, EveryFormSurvivesAConfigJsonRoundTrip) {
  auto base = ParseModelConfig(
      R"({"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64})",
      "c");
  ASSERT_TRUE(base.ok()) << base.status();
  for (
      const char* qc :
      {R"({"quant_method": "fp8", "activation_scheme": "static"})",
       R"({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})",
       kCompressedTensorsChannel}) {
    ModelConfig c = *base;
    c.quantization = *Parse(qc);
    auto back = ParseModelConfig(ModelConfigToJson(c), "c");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(QuantizationName(back->quantization), QuantizationName(c.quantization)) << qc;
    EXPECT_EQ(back->quantization.static_input_scales, c.quantization.static_input_scales);
  }
}

}  // namespace
}  // namespace tandem
