// config.json's quantization_config: how a checkpoint's linear-layer weights are stored in FP8
// (E4M3), in the two forms published FP8 models use.
//
//   quant_method "fp8" (transformers' FP8 / vLLM's Fp8Config):
//     without weight_block_size: per-tensor `weight_scale` (shape [] or [1]) per weight, and with
//       activation_scheme "static" a per-tensor `input_scale`;
//     with weight_block_size [bo, bi]: `weight_scale_inv` of shape [ceil(out/bo), ceil(in/bi)],
//       one scale per block (multiplied in, despite the name); activations are always dynamic.
//   quant_method "compressed-tensors", format "float-quantized" (one config group, weights
//     num_bits 8 type float, strategy "channel" (weight_scale [out, 1]) or "tensor" ([1])):
//     input_activations null (weight-only) or dynamic (per token or per tensor), or static with
//     strategy "tensor" (`input_scale` [1]).
// Everywhere: value = fp8 * scale. Which linear layers are FP8 the tensors' dtype says (ignored
// modules such as lm_head stay 16-bit).
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"

namespace tandem {

struct WeightQuantization {
  enum class Method {
    kNone,               // 16/32-bit weights
    kFp8,                // quant_method "fp8"
    kCompressedTensors,  // quant_method "compressed-tensors", float-quantized
  };
  enum class Scales {
    kTensor,   // one weight_scale per tensor
    kChannel,  // one per output row: weight_scale (out, 1)
    kBlock,    // weight_scale_inv (ceil(out / block_rows), ceil(in / block_cols))
  };
  Method method = Method::kNone;
  Scales scales = Scales::kTensor;
  int block_rows = 0;  // kBlock only
  int block_cols = 0;
  // Activations quantized with the checkpoint's input_scale (static) rather than scales computed
  // per token at run time (dynamic).
  bool static_input_scales = false;

  bool fp8() const { return method != Method::kNone; }
  // The tensor that holds a weight's scales, next to "<module>.weight": "weight_scale" or
  // "weight_scale_inv".
  std::string_view scale_suffix() const {
    return scales == Scales::kBlock ? "weight_scale_inv" : "weight_scale";
  }
};

// "none", "fp8 per-tensor", "compressed-tensors per-channel", ...: for logs and errors.
std::string QuantizationName(const WeightQuantization& q);

// Reads config.json's "quantization_config" (absent or null: kNone). Any other quant_method,
// format, bit width, type or strategy is UNIMPLEMENTED naming the field and its value.
absl::StatusOr<WeightQuantization> ParseQuantizationConfig(const nlohmann::json& config,
                                                           std::string_view source);
// The quantization_config object of `q` (null for kNone), in the form ParseQuantizationConfig
// reads.
nlohmann::json QuantizationConfigJson(const WeightQuantization& q);

}  // namespace tandem
