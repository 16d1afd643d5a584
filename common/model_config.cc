// config.json <-> ModelConfig, for GPT-2 (GPT2Config) and the Llama architecture (LlamaConfig,
// MistralConfig, Qwen2Config, Qwen3Config) field names.
#include "common/model_config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/bounded_json.h"
#include "common/checked_math.h"
#include "common/status_macros.h"

namespace tandem {
namespace {

using nlohmann::json;

// Reads an integer field; `fallback` when absent or null and a fallback is given.
absl::StatusOr<int> IntField(const json& j, const char* key, const std::string& source,
                             std::optional<int> fallback = std::nullopt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (fallback) return *fallback;
    return absl::InvalidArgumentError(absl::StrCat(source, ": missing field \"", key, "\""));
  }
  if (!it->is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field \"", key, "\" must be an integer, got ", it->dump()));
  }
  const int64_t v = it->get<int64_t>();
  if (v < INT32_MIN || v > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": field \"", key, "\" out of range"));
  }
  return static_cast<int>(v);
}

absl::StatusOr<float> FloatField(const json& j, const char* key, const std::string& source,
                                 float fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field \"", key, "\" must be a number, got ", it->dump()));
  }
  return it->get<float>();
}

absl::StatusOr<bool> BoolField(const json& j, const char* key, const std::string& source,
                               bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field \"", key, "\" must be true or false, got ", it->dump()));
  }
  return it->get<bool>();
}

// eos/bos may be an int or a list of ints (the first is used).
absl::StatusOr<int> TokenIdField(const json& j, const char* key, const std::string& source) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return -1;
  if (it->is_array() && !it->empty()) return IntField(json{{key, (*it)[0]}}, key, source);
  return IntField(j, key, source);
}

absl::Status Positive(int v, const char* key, const std::string& source) {
  if (v <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field \"", key, "\" must be positive, got ", v));
  }
  return absl::OkStatus();
}

// v in [1, limit].
absl::Status InRange(int v, const char* key, int limit, const std::string& source) {
  RETURN_IF_ERROR(Positive(v, key, source));
  if (v > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field \"", key, "\" is ", v, ", above tandem's limit of ", limit));
  }
  return absl::OkStatus();
}

// Every size the engine multiplies, each within its bound (model_config.h).
absl::Status CheckDimensions(const ModelConfig& c, const std::string& source) {
  RETURN_IF_ERROR(InRange(c.vocab_size, "vocab_size", kMaxVocabSize, source));
  RETURN_IF_ERROR(InRange(c.hidden_size, "hidden_size", kMaxHiddenSize, source));
  RETURN_IF_ERROR(InRange(c.intermediate_size, "intermediate_size", kMaxIntermediateSize, source));
  RETURN_IF_ERROR(InRange(c.num_layers, "num_layers", kMaxLayers, source));
  RETURN_IF_ERROR(InRange(c.num_heads, "num_attention_heads", kMaxHeads, source));
  RETURN_IF_ERROR(InRange(c.num_kv_heads, "num_key_value_heads", kMaxHeads, source));
  RETURN_IF_ERROR(InRange(c.head_dim, "head_dim", kMaxHeadDim, source));
  RETURN_IF_ERROR(Positive(c.max_positions, "max_positions", source));
  if (!CheckedProduct({c.num_heads, c.head_dim}, kMaxAttentionWidth)) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": num_attention_heads ", c.num_heads, " x head_dim ", c.head_dim,
        " is above tandem's limit of ", kMaxAttentionWidth, " for the attention width"));
  }
  return absl::OkStatus();
}

// The double whose shortest decimal form is the float's (1e-5f is written 1e-05, not
// 9.999999747378752e-06), so that config.json reads like Hugging Face's.
double ShortestDouble(float f) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), f);
  return std::strtod(std::string(buf, end).c_str(), nullptr);
}

// UNIMPLEMENTED naming a config field whose value changes the math in a way the engine does not
// compute, so that such a checkpoint is refused rather than served wrongly.
absl::Status Unsupported(const std::string& source, std::string_view field, const json& value,
                         std::string_view supported) {
  return absl::UnimplementedError(absl::StrCat(source, ": ", std::string(field), " ", value.dump(),
                                               " is not supported (", std::string(supported),
                                               ")"));
}

// A field that must be absent, null or `ok` (a value without effect).
absl::Status RequireDefault(const json& j, const char* key, const json& ok,
                            const std::string& source, std::string_view supported) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null() || *it == ok) return absl::OkStatus();
  return Unsupported(source, key, *it, supported);
}

absl::Status ParseGpt2(const json& j, const std::string& source, ModelConfig& c) {
  c.arch = Arch::kGpt2;
  ASSIGN_OR_RETURN(c.vocab_size, IntField(j, "vocab_size", source));
  ASSIGN_OR_RETURN(c.hidden_size, IntField(j, "n_embd", source));
  ASSIGN_OR_RETURN(c.num_layers, IntField(j, "n_layer", source));
  ASSIGN_OR_RETURN(c.num_heads, IntField(j, "n_head", source));
  ASSIGN_OR_RETURN(c.max_positions, IntField(j, "n_positions", source));
  ASSIGN_OR_RETURN(c.intermediate_size, IntField(j, "n_inner", source, 4 * c.hidden_size));
  ASSIGN_OR_RETURN(c.norm_eps, FloatField(j, "layer_norm_epsilon", source, 1e-5f));
  ASSIGN_OR_RETURN(c.tie_word_embeddings, BoolField(j, "tie_word_embeddings", source, true));
  ASSIGN_OR_RETURN(c.scale_attn_weights, BoolField(j, "scale_attn_weights", source, true));
  ASSIGN_OR_RETURN(c.scale_attn_by_inverse_layer_idx,
                   BoolField(j, "scale_attn_by_inverse_layer_idx", source, false));
  // reorder_and_upcast_attn computes the scores in fp32: every backend here does so anyway.
  ASSIGN_OR_RETURN(bool reorder, BoolField(j, "reorder_and_upcast_attn", source, false));
  (void)reorder;
  RETURN_IF_ERROR(RequireDefault(j, "add_cross_attention", false, source, "decoder only"));
  c.num_kv_heads = c.num_heads;
  auto act = j.find("activation_function");
  if (act != j.end() && act->is_string() && *act != "gelu_new" && *act != "gelu_pytorch_tanh") {
    return Unsupported(source, "activation_function", *act, "gelu_new only");
  }
  return absl::OkStatus();
}

// rope_theta and the frequency scaling, as transformers reads them: rope_scaling when set, else
// rope_parameters; rope_theta inside that object, else at the top level.
absl::Status ParseRope(const json& j, const std::string& source, ModelConfig& c) {
  ASSIGN_OR_RETURN(c.rope_theta, FloatField(j, "rope_theta", source, 10000.0f));
  RETURN_IF_ERROR(RequireDefault(j, "partial_rotary_factor", 1.0, source, "1.0 only"));
  const char* key = "rope_scaling";
  auto it = j.find(key);
  if (it == j.end() || it->is_null() || (it->is_object() && it->empty())) {
    key = "rope_parameters";
    it = j.find(key);
    if (it == j.end() || it->is_null()) return absl::OkStatus();
  }
  if (!it->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field \"", key, "\" must be an object"));
  }
  const json& rope = *it;
  ASSIGN_OR_RETURN(c.rope_theta, FloatField(rope, "rope_theta", source, c.rope_theta));
  RETURN_IF_ERROR(RequireDefault(rope, "partial_rotary_factor", 1.0, source, "1.0 only"));
  auto type_it = rope.find("rope_type");
  if (type_it == rope.end()) type_it = rope.find("type");
  const std::string type =
      type_it == rope.end() || !type_it->is_string() ? "default" : type_it->get<std::string>();
  const std::string field = absl::StrCat(key, ".rope_type");
  if (type == "default") return absl::OkStatus();
  const std::string where = absl::StrCat(source, ": ", key);
  if (type == "linear") {
    c.rope_scaling.type = RopeScaling::Type::kLinear;
  } else if (type == "llama3") {
    c.rope_scaling.type = RopeScaling::Type::kLlama3;
    ASSIGN_OR_RETURN(c.rope_scaling.low_freq_factor,
                     FloatField(rope, "low_freq_factor", where, -1));
    ASSIGN_OR_RETURN(c.rope_scaling.high_freq_factor,
                     FloatField(rope, "high_freq_factor", where, -1));
    ASSIGN_OR_RETURN(c.rope_scaling.original_max_positions,
                     IntField(rope, "original_max_position_embeddings", where, c.max_positions));
    if (!(c.rope_scaling.low_freq_factor > 0) ||
        !(c.rope_scaling.high_freq_factor > c.rope_scaling.low_freq_factor) ||
        c.rope_scaling.original_max_positions <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": llama3 scaling needs 0 < low_freq_factor < high_freq_factor and a positive "
                 "original_max_position_embeddings, got ",
          rope.dump()));
    }
  } else {
    return Unsupported(source, field, *type_it,
                       "default, linear and llama3; dynamic scaling changes the frequencies with "
                       "the sequence length");
  }
  ASSIGN_OR_RETURN(c.rope_scaling.factor, FloatField(rope, "factor", where, -1));
  if (!(c.rope_scaling.factor >= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": factor must be given and at least 1, got ", rope.dump()));
  }
  return absl::OkStatus();
}

// Qwen2's and Qwen3's window: layers from max_window_layers on (or those layer_types calls
// "sliding_attention") when use_sliding_window is true; none otherwise.
absl::Status ParseQwen2Window(const json& j, const std::string& source, ModelConfig& c) {
  ASSIGN_OR_RETURN(bool use, BoolField(j, "use_sliding_window", source, false));
  ASSIGN_OR_RETURN(int window, IntField(j, "sliding_window", source, 4096));
  ASSIGN_OR_RETURN(int first, IntField(j, "max_window_layers", source, 28));
  auto types = j.find("layer_types");
  std::vector<bool> windowed(c.num_layers, false);
  if (types != j.end() && !types->is_null()) {
    if (!types->is_array() || static_cast<int>(types->size()) != c.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, ": layer_types must list one type per layer (", c.num_layers, "), got ",
          types->dump()));
    }
    for (int l = 0; l < c.num_layers; ++l) {
      const json& t = (*types)[l];
      if (t == "sliding_attention") {
        windowed[l] = true;
      } else if (t != "full_attention") {
        return Unsupported(source, absl::StrCat("layer_types[", l, "]"), t,
                           "full_attention, sliding_attention");
      }
    }
  } else {
    // As transformers' Qwen2Config and Qwen3Config: layer i slides where i >= max_window_layers (every layer for
    // a negative one).
    for (int l = std::max(first, 0); l < c.num_layers; ++l) windowed[l] = true;
  }
  if (!use || std::find(windowed.begin(), windowed.end(), true) == windowed.end()) {
    return absl::OkStatus();
  }
  if (window <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": sliding_window must be positive, got ", window));
  }
  c.sliding_window = window;
  c.windowed_layers = std::move(windowed);
  return absl::OkStatus();
}

// Llama, Mistral, Qwen2 and Qwen3: one architecture whose members differ in biases, window, q/k
// norm and defaults.
absl::Status ParseLlamaFamily(const json& j, const std::string& type, const std::string& source,
                              ModelConfig& c) {
  c.arch = Arch::kLlama;
  c.model_type = type;
  const bool mistral = type == "mistral", qwen2 = type == "qwen2", qwen3 = type == "qwen3";
  ASSIGN_OR_RETURN(c.vocab_size, IntField(j, "vocab_size", source));
  ASSIGN_OR_RETURN(c.hidden_size, IntField(j, "hidden_size", source));
  ASSIGN_OR_RETURN(c.intermediate_size, IntField(j, "intermediate_size", source));
  ASSIGN_OR_RETURN(c.num_layers, IntField(j, "num_hidden_layers", source));
  ASSIGN_OR_RETURN(c.num_heads, IntField(j, "num_attention_heads", source));
  ASSIGN_OR_RETURN(c.num_kv_heads, IntField(j, "num_key_value_heads", source,
                                            mistral ? 8 : c.num_heads));
  ASSIGN_OR_RETURN(c.max_positions, IntField(j, "max_position_embeddings", source));
  ASSIGN_OR_RETURN(c.norm_eps, FloatField(j, "rms_norm_eps", source, 1e-6f));
  ASSIGN_OR_RETURN(c.tie_word_embeddings, BoolField(j, "tie_word_embeddings", source, false));
  RETURN_IF_ERROR(ParseRope(j, source, c));
  if (qwen2) {
    // Qwen2Attention: q, k and v with biases, o without.
    c.qkv_bias = true;
    RETURN_IF_ERROR(ParseQwen2Window(j, source, c));
  } else if (qwen3) {
    // Qwen3Attention: q_norm and k_norm over each head; all four projections biased or none.
    c.qk_norm = true;
    ASSIGN_OR_RETURN(bool bias, BoolField(j, "attention_bias", source, false));
    c.qkv_bias = c.o_bias = bias;
    RETURN_IF_ERROR(ParseQwen2Window(j, source, c));
    RETURN_IF_ERROR(RequireDefault(j, "mlp_bias", false, source, "MLP projections without bias"));
  } else {
    ASSIGN_OR_RETURN(bool bias, BoolField(j, "attention_bias", source, false));
    c.qkv_bias = c.o_bias = bias;
    RETURN_IF_ERROR(RequireDefault(j, "mlp_bias", false, source, "MLP projections without bias"));
  }
  if (mistral) {
    // null: no window; absent: MistralConfig's default.
    auto it = j.find("sliding_window");
    if (it == j.end()) {
      c.sliding_window = 4096;
    } else if (!it->is_null()) {
      ASSIGN_OR_RETURN(c.sliding_window, IntField(j, "sliding_window", source));
      if (c.sliding_window <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": sliding_window must be positive or null, got ", it->dump()));
      }
    }
    RETURN_IF_ERROR(RequireDefault(j, "layer_types", json(), source,
                                   "MistralForCausalLM windows every layer"));
  }
  auto act = j.find("hidden_act");
  if (act != j.end() && act->is_string() && *act != "silu") {
    return Unsupported(source, "hidden_act", *act, "silu only");
  }
  return absl::OkStatus();
}

}  // namespace

std::string_view ArchName(Arch a) { return a == Arch::kGpt2 ? "gpt2" : "llama"; }

float ModelConfig::attention_scale(int layer) const {
  float scale = scale_attn_weights ? 1.0f / std::sqrt(static_cast<float>(head_dim)) : 1.0f;
  if (scale_attn_by_inverse_layer_idx) scale /= static_cast<float>(layer + 1);
  return scale;
}

int ModelConfig::attention_window(int layer) const {
  if (sliding_window <= 0) return 0;
  if (windowed_layers.empty()) return sliding_window;
  return layer >= 0 && layer < static_cast<int>(windowed_layers.size()) && windowed_layers[layer]
             ? sliding_window
             : 0;
}

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text,
                                             std::string_view source_name) {
  const std::string source(source_name);
  absl::StatusOr<json> parsed = ParseBoundedJson(json_text, source);
  if (!parsed.ok()) return parsed.status();
  json j = *std::move(parsed);
  if (!j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": expected a JSON object"));
  }
  auto type_it = j.find("model_type");
  if (type_it == j.end() || !type_it->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": missing string field \"model_type\""));
  }
  const std::string type = type_it->get<std::string>();
  ModelConfig c;
  c.model_type = type;
  if (type == "gpt2") {
    RETURN_IF_ERROR(ParseGpt2(j, source, c));
  } else if (type == "llama" || type == "mistral" || type == "qwen2" || type == "qwen3") {
    RETURN_IF_ERROR(ParseLlamaFamily(j, type, source, c));
  } else {
    return absl::UnimplementedError(
        absl::StrCat(source, ": unknown architecture model_type \"", type,
                     "\" (supported: gpt2, llama, mistral, qwen2, qwen3)"));
  }
  RETURN_IF_ERROR(Positive(c.num_heads, "num_attention_heads", source));
  RETURN_IF_ERROR(Positive(c.num_kv_heads, "num_key_value_heads", source));
  if (c.num_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": num_attention_heads ", c.num_heads,
                     " is not divisible by num_key_value_heads ", c.num_kv_heads));
  }
  // head_dim given explicitly (Mistral, Llama 3.2 style) need not divide the hidden size; Qwen3's
  // always has one (Qwen3Config's default is 128).
  const bool qwen3 = type == "qwen3";
  const bool explicit_head_dim =
      qwen3 || (c.arch == Arch::kLlama && j.contains("head_dim") && !j["head_dim"].is_null());
  if (!explicit_head_dim && c.hidden_size % c.num_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": hidden size ", c.hidden_size,
                     " is not divisible by the number of attention heads ", c.num_heads));
  }
  c.head_dim = qwen3 ? 128 : c.hidden_size / c.num_heads;
  if (c.arch == Arch::kLlama) {
    ASSIGN_OR_RETURN(c.head_dim, IntField(j, "head_dim", source, c.head_dim));
    RETURN_IF_ERROR(Positive(c.head_dim, "head_dim", source));
    if (c.head_dim % 2 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": head_dim ", c.head_dim, " must be even for rotary embeddings"));
    }
  }
  RETURN_IF_ERROR(CheckDimensions(c, source));
  if (!(c.norm_eps > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": norm epsilon must be positive"));
  }
  if (!(c.rope_theta > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": rope_theta must be positive"));
  }
  ASSIGN_OR_RETURN(c.bos_token_id, TokenIdField(j, "bos_token_id", source));
  ASSIGN_OR_RETURN(c.eos_token_id, TokenIdField(j, "eos_token_id", source));
  for (const char* key : {"torch_dtype", "dtype"}) {
    auto it = j.find(key);
    if (it == j.end() || !it->is_string()) continue;
    auto dt = ParseTorchDType(it->get<std::string>());
    if (!dt.ok()) return absl::InvalidArgumentError(absl::StrCat(source, ": ", key, ": ",
                                                                 std::string(dt.status().message())));
    c.dtype = *dt;
  }
  ASSIGN_OR_RETURN(c.quantization, ParseQuantizationConfig(j, source));
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::filesystem::path& dir) {
  const std::filesystem::path path = dir / "config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseModelConfig(ss.str(), path.string());
}

std::string ModelConfigToJson(const ModelConfig& c) {
  json j;
  if (c.arch == Arch::kGpt2) {
    j = {{"architectures", {"GPT2LMHeadModel"}},
         {"model_type", "gpt2"},
         {"vocab_size", c.vocab_size},
         {"n_embd", c.hidden_size},
         {"n_layer", c.num_layers},
         {"n_head", c.num_heads},
         {"n_positions", c.max_positions},
         {"n_ctx", c.max_positions},
         {"n_inner", c.intermediate_size},
         {"activation_function", "gelu_new"},
         {"layer_norm_epsilon", ShortestDouble(c.norm_eps)},
         {"resid_pdrop", 0.0},
         {"embd_pdrop", 0.0},
         {"attn_pdrop", 0.0},
         {"scale_attn_weights", c.scale_attn_weights},
         {"scale_attn_by_inverse_layer_idx", c.scale_attn_by_inverse_layer_idx},
         {"tie_word_embeddings", c.tie_word_embeddings}};
  } else {
    const bool mistral = c.model_type == "mistral", qwen2 = c.model_type == "qwen2";
    const bool qwen3 = c.qk_norm;
    j = {{"architectures", {mistral ? "MistralForCausalLM"
                            : qwen2 ? "Qwen2ForCausalLM"
                            : qwen3 ? "Qwen3ForCausalLM"
                                    : "LlamaForCausalLM"}},
         {"model_type", mistral ? "mistral" : qwen2 ? "qwen2" : qwen3 ? "qwen3" : "llama"},
         {"vocab_size", c.vocab_size},
         {"hidden_size", c.hidden_size},
         {"intermediate_size", c.intermediate_size},
         {"num_hidden_layers", c.num_layers},
         {"num_attention_heads", c.num_heads},
         {"num_key_value_heads", c.num_kv_heads},
         {"max_position_embeddings", c.max_positions},
         {"rms_norm_eps", ShortestDouble(c.norm_eps)},
         {"rope_theta", ShortestDouble(c.rope_theta)},
         {"hidden_act", "silu"},
         {"attention_dropout", 0.0},
         {"tie_word_embeddings", c.tie_word_embeddings}};
    // Llama checkpoints spell head_dim out; Mistral 7B and Qwen2.5 only when it is not
    // hidden / heads.
    if (!(mistral || qwen2) || c.head_dim * c.num_heads != c.hidden_size) {
      j["head_dim"] = c.head_dim;
    }
    if (mistral) {
      j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json();
    } else if (qwen2 || qwen3) {
      // Windowed layers are a suffix from max_window_layers on.
      int first = c.num_layers;
      if (c.sliding_window > 0) {
        first = 0;
        while (first < c.num_layers && c.attention_window(first) == 0) ++first;
      }
      j["use_sliding_window"] = c.sliding_window > 0;
      j["sliding_window"] = c.sliding_window > 0 ? c.sliding_window : c.max_positions;
      j["max_window_layers"] = first;
    }
    if (!(mistral || qwen2)) {
      j["attention_bias"] = c.qkv_bias;
      j["mlp_bias"] = false;
    }
    const RopeScaling& rs = c.rope_scaling;
    if (rs.type == RopeScaling::Type::kLinear) {
      j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", ShortestDouble(rs.factor)}};
    } else if (rs.type == RopeScaling::Type::kLlama3) {
      j["rope_scaling"] = {{"factor", ShortestDouble(rs.factor)},
                           {"low_freq_factor", ShortestDouble(rs.low_freq_factor)},
                           {"high_freq_factor", ShortestDouble(rs.high_freq_factor)},
                           {"original_max_position_embeddings", rs.original_max_positions},
                           {"rope_type", "llama3"}};
    }
  }
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_id >= 0) j["eos_token_id"] = c.eos_token_id;
  j["torch_dtype"] = std::string(TorchDTypeName(c.dtype));
  if (c.quantization.fp8()) j["quantization_config"] = QuantizationConfigJson(c.quantization);
  return j.dump(2) + "\n";
}

std::string KvScaleTensorName(Arch arch, int layer, bool v) {
  return arch == Arch::kGpt2
             ? absl::StrCat("transformer.h.", layer, ".attn.", v ? "v_scale" : "k_scale")
             : absl::StrCat("model.layers.", layer, ".self_attn.", v ? "v_scale" : "k_scale");
}

bool CudaPagesTakeHeads(int head_dim, int group) {
  if (head_dim <= 0) return false;
  if (head_dim % 8 == 0) return true;
  return head_dim % 4 == 0 && head_dim <= 128 && group >= 1 && group <= 8;
}

}  // namespace tandem
