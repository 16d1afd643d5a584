// The model's shape, read from a Hugging Face config.json: one struct for every architecture.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/quantization.h"

namespace tandem {

enum class Arch {
  kGpt2,   // learned positions, LayerNorm with bias, GELU-tanh MLP, Conv1D (in, out) weights
  kLlama,  // RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, Linear (out, in) weights
};
std::string_view ArchName(Arch a);  // "gpt2", "llama"

// How the rotary inverse frequencies theta^(-2i/d) are rescaled (rope_scaling / rope_parameters).
struct RopeScaling {
  enum class Type {
    kNone,    // "default"
    kLinear,  // every frequency divided by factor
    kLlama3,  // Llama 3.1: low frequencies divided by factor, high ones kept, a ramp between
  };
  Type type = Type::kNone;
  float factor = 1.0f;
  float low_freq_factor = 1.0f;     // llama3: wavelengths above original / this are divided
  float high_freq_factor = 4.0f;    // llama3: wavelengths below original / this are kept
  int original_max_positions = 0;   // llama3: the pretraining context (tokens)
};

struct ModelConfig {
  Arch arch = Arch::kLlama;
  // config.json's model_type: "gpt2", or for the Llama architecture "llama", "mistral", "qwen2" or
  // "qwen3", which differ only in the data below (biases, window, rope scaling, q/k norm).
  std::string model_type = "llama";
  int vocab_size = 0;            // rows of the token embedding and of the LM head
  int hidden_size = 0;           // width of the residual stream
  int intermediate_size = 0;     // MLP inner width (GPT-2: n_inner, default 4 * hidden)
  int num_layers = 0;            // transformer blocks
  int num_heads = 0;             // query heads
  int num_kv_heads = 0;          // key/value heads; == num_heads for GPT-2, divides num_heads
  int head_dim = 0;              // hidden_size / num_heads, or config.json's head_dim (Llama)
  // Qwen3: q and k RMSNorm-ed per head over head_dim (weights q_norm, k_norm of (head_dim), eps
  // norm_eps) after the projection and its bias, before the rotary embedding.
  bool qk_norm = false;
  int max_positions = 0;         // context length (n_positions / max_position_embeddings)
  float norm_eps = 1e-5f;        // layer_norm_epsilon / rms_norm_eps
  float rope_theta = 10000.0f;   // RoPE base (Llama only)
  RopeScaling rope_scaling;      // (Llama only)
  bool tie_word_embeddings = false;  // LM head shares the token embedding
  // Llama architecture: biases of the q, k, v projections (Qwen2; attention_bias of Llama and
  // Qwen3) and of the output projection (attention_bias). GPT-2 has every bias whatever these say.
  bool qkv_bias = false;
  bool o_bias = false;
  // > 0: windowed layers attend to the last sliding_window positions only, the query's own
  // included (Mistral's sliding_window; Qwen2's with use_sliding_window). 0: no window.
  int sliding_window = 0;
  // Which layers the window applies to: empty for all of them, else one flag per layer (Qwen2's
  // layer_types / max_window_layers).
  std::vector<bool> windowed_layers;
  bool scale_attn_weights = true;                // GPT-2: scores divided by sqrt(head_dim)
  bool scale_attn_by_inverse_layer_idx = false;  // GPT-2: and by the layer index + 1
  int bos_token_id = -1;         // -1: none
  int eos_token_id = -1;         // -1: none
  DType dtype = DType::kF32;     // torch_dtype: the checkpoint's weight type
  // quantization_config: FP8 linear-layer weights of a pre-quantized checkpoint (kNone: none).
  WeightQuantization quantization;

  // Formed in 64 bits; a parsed config keeps them within kMaxAttentionWidth, so they fit an int.
  int q_dim() const { return static_cast<int>(int64_t{num_heads} * head_dim); }
  int kv_dim() const { return static_cast<int>(int64_t{num_kv_heads} * head_dim); }
  // Attention of layer `layer` (0-based, of the whole model): the factor of q·k, and the window
  // (0: the whole causal prefix).
  float attention_scale(int layer) const;
  int attention_window(int layer) const;
};

// The largest dimensions a config may give: well above every published checkpoint (a 405B Llama
// has hidden 16384, intermediate 53248, 126 layers, 128 heads of 128; vocabularies reach 262144),
// and small enough that every product the engine forms from them (vocab x hidden elements,
// rows x q_dim) fits 64 bits, and each width an int.
inline constexpr int kMaxVocabSize = 1 << 22;
inline constexpr int kMaxHiddenSize = 1 << 16;
inline constexpr int kMaxIntermediateSize = 1 << 18;
inline constexpr int kMaxLayers = 1 << 10;
inline constexpr int kMaxHeads = 1 << 10;
inline constexpr int kMaxHeadDim = 1 << 12;
inline constexpr int kMaxAttentionWidth = 1 << 20;  // num_attention_heads x head_dim

// Parses config.json text; `source` names the file in error messages. Checks every field that the
// engine relies on (positive sizes within the bounds above, heads dividing hidden size and each
// other) and names the field that is wrong.
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text, std::string_view source);
// Reads `dir`/config.json.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::filesystem::path& dir);
// Whether the CUDA backend holds the KV-cache of heads of `head_dim`, `group` query heads to a kv
// head, in pages: its decode attention reads a key in 16-byte vectors (head_dim a multiple of 8),
// or in 8-byte ones in the register kernel built for head_dim up to 128 and groups up to 8
// (worker/cuda/attention.cu). The coordinator's default page size and the CUDA stage's check
// both ask this.
bool CudaPagesTakeHeads(int head_dim, int group);
// The checkpoint's name of the scale of layer `layer`'s K (of its V with `v`) in a KV-cache kept
// in FP8, as vLLM and compressed-tensors checkpoints with a kv_cache_scheme publish it (an fp32
// scalar): "model.layers.{layer}.self_attn.k_scale" / "v_scale"; for GPT-2, whose attention
// module is "attn", "transformer.h.{layer}.attn.k_scale" / "v_scale". Read by worker/kv_scales.h.
std::string KvScaleTensorName(Arch arch, int layer, bool v);
// The config.json of this shape with the fields and names of the real checkpoints of its
// model_type (GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config).
std::string ModelConfigToJson(const ModelConfig& c);

}  // namespace tandem
