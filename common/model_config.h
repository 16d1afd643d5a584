// The model's shape, read from a Hugging Face config.json: one struct for every architecture.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace tandem {

enum class Arch {
  kGpt2,   // learned positions, LayerNorm with bias, GELU-tanh MLP, Conv1D (in, out) weights
  kLlama,  // RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, Linear (out, in) weights
};
std::string_view ArchName(Arch a);  // "gpt2", "llama" (config.json's model_type)

struct ModelConfig {
  Arch arch = Arch::kLlama;
  int vocab_size = 0;            // rows of the token embedding and of the LM head
  int hidden_size = 0;           // width of the residual stream
  int intermediate_size = 0;     // MLP inner width (GPT-2: n_inner, default 4 * hidden)
  int num_layers = 0;            // transformer blocks
  int num_heads = 0;             // query heads
  int num_kv_heads = 0;          // key/value heads; == num_heads for GPT-2, divides num_heads
  int head_dim = 0;              // hidden_size / num_heads
  int max_positions = 0;         // context length (n_positions / max_position_embeddings)
  float norm_eps = 1e-5f;        // layer_norm_epsilon / rms_norm_eps
  float rope_theta = 10000.0f;   // RoPE base (Llama only)
  bool tie_word_embeddings = false;  // LM head shares the token embedding
  int bos_token_id = -1;         // -1: none
  int eos_token_id = -1;         // -1: none
  DType dtype = DType::kF32;     // torch_dtype: the checkpoint's weight type

  int q_dim() const { return num_heads * head_dim; }
  int kv_dim() const { return num_kv_heads * head_dim; }
};

// Parses config.json text; `source` names the file in error messages. Checks every field that the
// engine relies on (positive sizes, heads dividing hidden size and each other) and names the field
// that is wrong.
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text, std::string_view source);
// Reads `dir`/config.json.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::filesystem::path& dir);
// The config.json that Hugging Face transformers writes for this shape (GPT2Config/LlamaConfig).
std::string ModelConfigToJson(const ModelConfig& c);

}  // namespace tandem
