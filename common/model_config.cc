// config.json <-> ModelConfig, for GPT-2 (GPT2Config) and Llama (LlamaConfig) field names.
#include "common/model_config.h"

#include <charconv>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
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

// The double whose shortest decimal form is the float's (1e-5f is written 1e-05, not
// 9.999999747378752e-06), so that config.json reads like Hugging Face's.
double ShortestDouble(float f) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), f);
  return std::strtod(std::string(buf, end).c_str(), nullptr);
}

}  // namespace

std::string_view ArchName(Arch a) { return a == Arch::kGpt2 ? "gpt2" : "llama"; }

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text,
                                             std::string_view source_name) {
  const std::string source(source_name);
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON: ", e.what()));
  }
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
  if (type == "gpt2") {
    c.arch = Arch::kGpt2;
    ASSIGN_OR_RETURN(c.vocab_size, IntField(j, "vocab_size", source));
    ASSIGN_OR_RETURN(c.hidden_size, IntField(j, "n_embd", source));
    ASSIGN_OR_RETURN(c.num_layers, IntField(j, "n_layer", source));
    ASSIGN_OR_RETURN(c.num_heads, IntField(j, "n_head", source));
    ASSIGN_OR_RETURN(c.max_positions, IntField(j, "n_positions", source));
    ASSIGN_OR_RETURN(c.intermediate_size, IntField(j, "n_inner", source, 4 * c.hidden_size));
    ASSIGN_OR_RETURN(c.norm_eps, FloatField(j, "layer_norm_epsilon", source, 1e-5f));
    ASSIGN_OR_RETURN(c.tie_word_embeddings, BoolField(j, "tie_word_embeddings", source, true));
    c.num_kv_heads = c.num_heads;
    auto act = j.find("activation_function");
    if (act != j.end() && act->is_string() && *act != "gelu_new" && *act != "gelu_pytorch_tanh") {
      return absl::UnimplementedError(absl::StrCat(source, ": activation_function ", act->dump(),
                                                   " is not supported (gelu_new only)"));
    }
  } else if (type == "llama") {
    c.arch = Arch::kLlama;
    ASSIGN_OR_RETURN(c.vocab_size, IntField(j, "vocab_size", source));
    ASSIGN_OR_RETURN(c.hidden_size, IntField(j, "hidden_size", source));
    ASSIGN_OR_RETURN(c.intermediate_size, IntField(j, "intermediate_size", source));
    ASSIGN_OR_RETURN(c.num_layers, IntField(j, "num_hidden_layers", source));
    ASSIGN_OR_RETURN(c.num_heads, IntField(j, "num_attention_heads", source));
    ASSIGN_OR_RETURN(c.num_kv_heads, IntField(j, "num_key_value_heads", source, c.num_heads));
    ASSIGN_OR_RETURN(c.max_positions, IntField(j, "max_position_embeddings", source));
    ASSIGN_OR_RETURN(c.norm_eps, FloatField(j, "rms_norm_eps", source, 1e-6f));
    ASSIGN_OR_RETURN(c.tie_word_embeddings, BoolField(j, "tie_word_embeddings", source, false));
    // rope_theta at the top level, or inside rope_parameters (newer transformers).
    ASSIGN_OR_RETURN(c.rope_theta, FloatField(j, "rope_theta", source, 10000.0f));
    for (const char* key : {"rope_parameters", "rope_scaling"}) {
      auto it = j.find(key);
      if (it == j.end() || it->is_null()) continue;
      if (!it->is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": field \"", key, "\" must be an object"));
      }
      auto rt = it->find("rope_type");
      if (rt == it->end()) rt = it->find("type");
      if (rt != it->end() && *rt != "default") {
        return absl::UnimplementedError(absl::StrCat(source, ": ", key, ".rope_type ", rt->dump(),
                                                     " is not supported (default only)"));
      }
      ASSIGN_OR_RETURN(c.rope_theta, FloatField(*it, "rope_theta", source, c.rope_theta));
    }
    for (const char* key : {"attention_bias", "mlp_bias"}) {
      ASSIGN_OR_RETURN(bool bias, BoolField(j, key, source, false));
      if (bias) {
        return absl::UnimplementedError(absl::StrCat(source, ": ", key, " is not supported"));
      }
    }
    auto act = j.find("hidden_act");
    if (act != j.end() && act->is_string() && *act != "silu") {
      return absl::UnimplementedError(
          absl::StrCat(source, ": hidden_act ", act->dump(), " is not supported (silu only)"));
    }
  } else {
    return absl::UnimplementedError(absl::StrCat(source, ": unknown architecture model_type \"",
                                                 type, "\" (supported: gpt2, llama)"));
  }
  RETURN_IF_ERROR(Positive(c.vocab_size, "vocab_size", source));
  RETURN_IF_ERROR(Positive(c.hidden_size, "hidden_size", source));
  RETURN_IF_ERROR(Positive(c.intermediate_size, "intermediate_size", source));
  RETURN_IF_ERROR(Positive(c.num_layers, "num_layers", source));
  RETURN_IF_ERROR(Positive(c.num_heads, "num_attention_heads", source));
  RETURN_IF_ERROR(Positive(c.num_kv_heads, "num_key_value_heads", source));
  RETURN_IF_ERROR(Positive(c.max_positions, "max_positions", source));
  if (c.hidden_size % c.num_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": hidden size ", c.hidden_size,
                     " is not divisible by the number of attention heads ", c.num_heads));
  }
  if (c.num_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": num_attention_heads ", c.num_heads,
                     " is not divisible by num_key_value_heads ", c.num_kv_heads));
  }
  c.head_dim = c.hidden_size / c.num_heads;
  if (c.arch == Arch::kLlama) {
    ASSIGN_OR_RETURN(c.head_dim, IntField(j, "head_dim", source, c.head_dim));
    RETURN_IF_ERROR(Positive(c.head_dim, "head_dim", source));
    if (c.head_dim % 2 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": head_dim ", c.head_dim, " must be even for rotary embeddings"));
    }
  }
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
         {"scale_attn_weights", true},
         {"tie_word_embeddings", c.tie_word_embeddings}};
  } else {
    j = {{"architectures", {"LlamaForCausalLM"}},
         {"model_type", "llama"},
         {"vocab_size", c.vocab_size},
         {"hidden_size", c.hidden_size},
         {"intermediate_size", c.intermediate_size},
         {"num_hidden_layers", c.num_layers},
         {"num_attention_heads", c.num_heads},
         {"num_key_value_heads", c.num_kv_heads},
         {"head_dim", c.head_dim},
         {"max_position_embeddings", c.max_positions},
         {"rms_norm_eps", ShortestDouble(c.norm_eps)},
         {"rope_theta", ShortestDouble(c.rope_theta)},
         {"hidden_act", "silu"},
         {"attention_bias", false},
         {"mlp_bias", false},
         {"attention_dropout", 0.0},
         {"tie_word_embeddings", c.tie_word_embeddings}};
  }
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_id >= 0) j["eos_token_id"] = c.eos_token_id;
  j["torch_dtype"] = std::string(TorchDTypeName(c.dtype));
  return j.dump(2) + "\n";
}

}  // namespace tandem
