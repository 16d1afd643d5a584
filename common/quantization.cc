// quantization_config <-> WeightQuantization (the forms are described in the header).
#include "common/quantization.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace tandem {
namespace {

using nlohmann::json;

absl::Status Refused(std::string_view source, std::string_view field, const json& value,
                     std::string_view supported) {
  return absl::UnimplementedError(absl::StrCat(std::string(source), ": quantization_config.",
                                               std::string(field), " ", value.dump(),
                                               " is not supported (", std::string(supported), ")"));
}

// j[key] when it is a string, else "".
std::string StringAt(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

absl::StatusOr<WeightQuantization> ParseFp8(const json& qc, std::string_view source) {
  WeightQuantization q;
  q.method = WeightQuantization::Method::kFp8;
  const std::string scheme = StringAt(qc, "activation_scheme");
  if (scheme != "dynamic" && scheme != "static") {
    return Refused(source, "activation_scheme", qc.value("activation_scheme", json()),
                   "\"dynamic\" or \"static\"");
  }
  q.static_input_scales = scheme == "static";
  auto block = qc.find("weight_block_size");
  if (block == qc.end() || block->is_null()) {
    q.scales = WeightQuantization::Scales::kTensor;
    return q;
  }
  if (!block->is_array() || block->size() != 2 || !(*block)[0].is_number_integer() ||
      !(*block)[1].is_number_integer() || (*block)[0].get<int64_t>() < 1 ||
      (*block)[1].get<int64_t>() < 1 || (*block)[0].get<int64_t>() > (1 << 16) ||
      (*block)[1].get<int64_t>() > (1 << 16)) {
    return Refused(source, "weight_block_size", *block, "two positive integers such as [128, 128]");
  }
  if (q.static_input_scales) {
    return Refused(source, "activation_scheme", scheme,
                   "block-wise weights take \"dynamic\" activations only");
  }
  q.scales = WeightQuantization::Scales::kBlock;
  q.block_rows = (*block)[0].get<int>();
  q.block_cols = (*block)[1].get<int>();
  return q;
}

// One side ("weights" or "input_activations") of a config group: 8-bit float.
absl::Status CheckFloat8(const json& args, std::string_view source, const std::string& where) {
  if (!args.is_object()) return Refused(source, where, args, "an object");
  if (args.value("num_bits", json()) != json(8)) {
    return Refused(source, where + ".num_bits", args.value("num_bits", json()), "8");
  }
  if (StringAt(args, "type") != "float") {
    return Refused(source, where + ".type", args.value("type", json()),
                   "\"float\": FP8 E4M3; integer schemes are not supported");
  }
  return absl::OkStatus();
}

absl::StatusOr<WeightQuantization> ParseCompressedTensors(const json& qc, std::string_view source) {
  WeightQuantization q;
  q.method = WeightQuantization::Method::kCompressedTensors;
  if (StringAt(qc, "format") != "float-quantized") {
    return Refused(source, "format", qc.value("format", json()), "\"float-quantized\"");
  }
  auto groups = qc.find("config_groups");
  if (groups == qc.end() || !groups->is_object() || groups->size() != 1) {
    return Refused(source, "config_groups", qc.value("config_groups", json()), "exactly one group");
  }
  const std::string name = groups->begin().key();
  const json& g = groups->begin().value();
  const std::string at = "config_groups." + name;
  if (!g.is_object()) return Refused(source, at, g, "an object");
  if (g.contains("format") && !g["format"].is_null() && g["format"] != "float-quantized") {
    return Refused(source, at + ".format", g["format"], "\"float-quantized\"");
  }
  const json weights = g.value("weights", json());
  if (absl::Status s = CheckFloat8(weights, source, at + ".weights"); !s.ok()) return s;
  const std::string strategy = StringAt(weights, "strategy");
  if (strategy == "channel") {
    q.scales = WeightQuantization::Scales::kChannel;
  } else if (strategy == "tensor") {
    q.scales = WeightQuantization::Scales::kTensor;
  } else {
    return Refused(source, at + ".weights.strategy", weights.value("strategy", json()),
                   "\"channel\" or \"tensor\"");
  }
  if (weights.value("dynamic", json(false)) != json(false)) {
    return Refused(source, at + ".weights.dynamic", weights["dynamic"], "false");
  }
  const json input = g.value("input_activations", json());
  if (input.is_null()) return q;  // weight-only
  if (absl::Status s = CheckFloat8(input, source, at + ".input_activations"); !s.ok()) return s;
  const json dynamic = input.value("dynamic", json(false));
  const std::string input_strategy = StringAt(input, "strategy");
  if (dynamic == json(true)) {
    if (input_strategy != "token" && input_strategy != "tensor") {
      return Refused(source, at + ".input_activations.strategy", input.value("strategy", json()),
                     "\"token\" or \"tensor\"");
    }
  } else if (dynamic == json(false)) {
    if (input_strategy != "tensor") {
      return Refused(source, at + ".input_activations.strategy", input.value("strategy", json()),
                     "static scales are per \"tensor\"");
    }
    q.static_input_scales = true;
  } else {
    return Refused(source, at + ".input_activations.dynamic", dynamic, "true or false");
  }
  return q;
}

}  // namespace

std::string QuantizationName(const WeightQuantization& q) {
  if (!q.fp8()) return "none";
  const char* method = q.method == WeightQuantization::Method::kFp8 ? "fp8" : "compressed-tensors";
  switch (q.scales) {
    case WeightQuantization::Scales::kTensor:
      return absl::StrCat(method, " per-tensor", q.static_input_scales ? " static" : "");
    case WeightQuantization::Scales::kChannel:
      return absl::StrCat(method, " per-channel", q.static_input_scales ? " static" : "");
    case WeightQuantization::Scales::kBlock:
      return absl::StrCat(method, " block ", q.block_rows, "x", q.block_cols);
  }
  return method;
}

absl::StatusOr<WeightQuantization> ParseQuantizationConfig(const json& config,
                                                           std::string_view source) {
  auto it = config.find("quantization_config");
  if (it == config.end() || it->is_null()) return WeightQuantization{};
  const json& qc = *it;
  if (!qc.is_object()) return Refused(source, "", qc, "an object");
  const std::string method = StringAt(qc, "quant_method");
  if (method == "fp8") return ParseFp8(qc, source);
  if (method == "compressed-tensors") return ParseCompressedTensors(qc, source);
  return Refused(source, "quant_method", qc.value("quant_method", json()),
                 "\"fp8\" and \"compressed-tensors\" (float-quantized) are; load the unquantized "
                 "checkpoint with --quantization fp8 instead");
}

json QuantizationConfigJson(const WeightQuantization& q) {
  switch (q.method) {
    case WeightQuantization::Method::kNone:
      return json();
    case WeightQuantization::Method::kFp8: {
      json j = {{"quant_method", "fp8"},
                {"activation_scheme", q.static_input_scales ? "static" : "dynamic"}};
      if (q.scales == WeightQuantization::Scales::kBlock) {
        j["weight_block_size"] = {q.block_rows, q.block_cols};
      }
      return j;
    }
    case WeightQuantization::Method::kCompressedTensors: {
      const bool channel = q.scales == WeightQuantization::Scales::kChannel;
      json weights = {{"num_bits", 8},
                      {"type", "float"},
                      {"symmetric", true},
                      {"dynamic", false},
                      {"strategy", channel ? "channel" : "tensor"}};
      json input = {{"num_bits", 8}, {"type", "float"}, {"symmetric", true}};
      input["dynamic"] = !q.static_input_scales;
      input["strategy"] = q.static_input_scales ? "tensor" : "token";
      return {{"quant_method", "compressed-tensors"},
              {"format", "float-quantized"},
              {"quantization_status", "compressed"},
              {"ignore", {"lm_head"}},
              {"config_groups",
               {{"group_0",
                 {{"targets", {"Linear"}}, {"weights", weights}, {"input_activations", input}}}}}};
    }
  }
  return json();
}

}  // namespace tandem
