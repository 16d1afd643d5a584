// Random-weight checkpoints of any GPT-2 or Llama shape, in exactly Hugging Face's layout
// (config.json, model.safetensors or shards + index, tokenizer.json). Seeded and bit-identical on
// every machine: weights come from the counter-based RNG in common/rng.h, never from <random>.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"

namespace tandem {

// Named shapes: tiny-gpt2, tiny-llama (GQA, untied head), tiny-llama-tied, tiny-llama3 (Llama 3.1
// rope scaling), tiny-mistral (sliding window 16), tiny-qwen2 (q/k/v biases, tied head),
// tiny-qwen3 and tiny-qwen3-tied (q/k norm, head_dim 32 != hidden / heads), tiny-openllama
// (head_dim 100, not a multiple of 8), gpt2 (124M),
// tinyllama-1b (GQA), openllama-3b, llama2-7b, llama2-13b, and with the config fields of the
// published checkpoints llama3.2-1b, llama3.1-8b, mistral-7b (v0.1), qwen2.5-7b and qwen3-8b.
// dtype defaults to F32 for tiny presets, BF16 for the Llama 3, Mistral and Qwen shapes (as
// published) and F16 for the rest.
absl::StatusOr<ModelConfig> PresetConfig(std::string_view name);
std::vector<std::string> PresetNames();

// Command-line overrides of a preset; unset fields keep the preset's value. Errors name the flag
// (--hidden_size, ...), since that is what the user typed.
struct ModelOverrides {
  std::optional<int> vocab_size;
  std::optional<int> hidden_size;
  std::optional<int> intermediate_size;
  std::optional<int> num_layers;
  std::optional<int> num_heads;
  std::optional<int> num_kv_heads;
  std::optional<int> max_positions;
  std::optional<float> norm_eps;
  std::optional<float> rope_theta;
  std::optional<bool> tie_word_embeddings;
  std::optional<int> sliding_window;     // Mistral, Qwen2; 0: none
  std::optional<int> max_window_layers;  // Qwen2, Qwen3: the window applies from this layer on
  std::optional<int> head_dim;           // Qwen3 only (the others have hidden / heads)
  std::optional<std::string> dtype;  // "f32", "f16", "bf16"
  // A pre-quantized FP8 checkpoint (Llama only; see FP8 below): "fp8" (quant_method fp8,
  // per-tensor scales, dynamic activations), "fp8-static" (and static input scales),
  // "fp8-block" (128 x 128 block scales), "compressed-tensors" (float-quantized, per-channel
  // scales, dynamic per-token activations), "compressed-tensors-tensor" (per-tensor scales),
  // "compressed-tensors-static" (per-tensor weights and static input scales).
  std::optional<std::string> quantization;
};

// Applies `o` to `base` and validates the result. Dimensions that follow others follow them:
// head_dim = hidden / heads (Qwen3 keeps its own unless --head_dim); GPT-2's intermediate size stays 4 * hidden and its kv heads equal its
// heads; an end-of-text id that was the last id stays the last id when the vocabulary changes.
absl::StatusOr<ModelConfig> ApplyOverrides(ModelConfig base, const ModelOverrides& o);

// INVALID_ARGUMENT naming the flag when a dimension is not positive, heads do not divide the
// hidden size, kv heads do not divide heads (GPT-2: differ from heads), a Llama head_dim is odd
// (RoPE rotates pairs), norm_eps or rope_theta is not positive, or a special id is outside the
// vocabulary.
absl::Status ValidateGeneratorConfig(const ModelConfig& config);

// What a real tokenizer folder fixes about the model beside it: tokenizer.json (else
// tokenizer.model) gives the vocabulary; tokenizer_config.json's (else special_tokens_map.json's)
// bos_token, eos_token and pad_token, strings or {"content": ...}, give the special ids.
struct TokenizerSpecials {
  int vocab_size = 0;     // highest id + 1 over the vocabulary and the added tokens
  int bos_token_id = -1;  // -1: the tokenizer names none
  int eos_token_id = -1;
  int pad_token_id = -1;
};
// NOT_FOUND without a tokenizer in `dir`; INVALID_ARGUMENT naming the file and the token when a
// special token is not in the vocabulary.
absl::StatusOr<TokenizerSpecials> ReadTokenizerSpecials(const std::filesystem::path& dir);

// `config` with the tokenizer's special ids, and its vocabulary size unless `keep_vocab_size`
// (a --vocab_size given), which must then hold every id of the tokenizer (checkpoints often pad
// the embedding past it).
absl::StatusOr<ModelConfig> FitToTokenizer(ModelConfig config, const TokenizerSpecials& t,
                                           bool keep_vocab_size);

// The tokenizer files that WriteRandomCheckpoint copies from GeneratorOptions::tokenizer_dir.
inline constexpr const char* kTokenizerFiles[] = {"tokenizer.json", "tokenizer_config.json",
                                                  "special_tokens_map.json", "tokenizer.model"};

struct GeneratorOptions {
  uint64_t seed = 0;
  int64_t max_shard_bytes = 0;  // > 0: split into model-0000i-of-0000n.safetensors + index
  // Non-empty: copy this folder's tokenizer files (kTokenizerFiles, those present) instead of
  // writing a BPE tokenizer trained here; the config must fit it (FitToTokenizer), and its pad
  // id goes into config.json.
  std::filesystem::path tokenizer_dir = {};
  // Non-empty: each layer's KV-cache scales too, as checkpoints for an FP8 KV-cache publish them
  // (F32 scalars of shape [] named by KvScaleTensorName, common/model_config.h): one (k_scale,
  // v_scale) pair for every layer, or one pair per layer. Each must be a finite number > 0.
  std::vector<std::pair<float, float>> kv_scales = {};
};

// One tensor of the checkpoint, in the order Hugging Face's state_dict lists it.
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  float mean = 0.0f;  // values are mean + stddev * N(0, 1)
  float stddev = 0.0f;
};
// Every tensor that save_pretrained writes for this shape (GPT2LMHeadModel / LlamaForCausalLM).
std::vector<TensorSpec> CheckpointTensors(const ModelConfig& config);

// Element `index` of tensor `name` before rounding to the dtype. Each tensor draws from its own
// stream, seed' = Mix64(seed ^ Fnv1a64(name)), so values do not depend on the order of generation.
// N(0, 1) is approximated without transcendental functions (bit-identical everywhere) by
// Irwin-Hall: (u0 + u1 + u2 + u3 - 2) * sqrt(3), ui = UniformFloat(seed', 4 * index + i).
float RandomWeight(uint64_t seed, const TensorSpec& spec, int64_t index);

// FP8: with config.quantization set, each linear weight of the Llama layers is written as
// F8_E4M3 codes of its values (drawn and rounded to config.dtype as without quantization)
// quantized by QuantizeE4M3 in the config's blocks, followed by its scales as F32
// ("weight_scale", or "weight_scale_inv" for blocks) and, with static input scales, an
// "input_scale" of kGeneratedInputScale. Every other tensor stays in config.dtype.
inline constexpr float kGeneratedInputScale = 0.02f;

// Writes the checkpoint folder `dir` (created if missing): config.json, tokenizer.json and
// tokenizer_config.json (or the files of options.tokenizer_dir), and model.safetensors or shards +
// model.safetensors.index.json (stale files of the other layout are removed). Streams tensor by
// tensor in bounded chunks, so a 13B model needs only a few MB of host memory.
absl::Status WriteRandomCheckpoint(const ModelConfig& config, const GeneratorOptions& options,
                                   const std::filesystem::path& dir);

}  // namespace tandem
