// The presets of tandem-make-model (model_generator.h): tiny models for tests and the published
// families' real shapes.
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tools/model_generator.h"

namespace tandem {
namespace {

// Tiny presets: small enough for unit tests, and a vocabulary that the embedded corpus fills with
// real merges (see TokenizerCorpus), so that every tiny-model id is a real token.
constexpr int kTinyVocab = 512;

ModelConfig TinyGpt2() {
  ModelConfig c;
  c.arch = Arch::kGpt2;
  c.vocab_size = kTinyVocab;
  c.hidden_size = 64;
  c.intermediate_size = 256;
  c.num_layers = 4;
  c.num_heads = 4;
  c.num_kv_heads = 4;
  c.max_positions = 256;
  c.norm_eps = 1e-5f;
  c.tie_word_embeddings = true;
  c.bos_token_id = kTinyVocab - 1;
  c.eos_token_id = kTinyVocab - 1;
  c.dtype = DType::kF32;
  return c;
}

ModelConfig TinyLlama(bool tied) {
  ModelConfig c;
  c.arch = Arch::kLlama;
  c.vocab_size = kTinyVocab;
  c.hidden_size = 64;
  c.intermediate_size = 160;
  c.num_layers = 4;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.max_positions = 256;
  c.norm_eps = 1e-5f;
  c.rope_theta = 10000.0f;
  c.tie_word_embeddings = tied;
  c.bos_token_id = kTinyVocab - 1;
  c.eos_token_id = kTinyVocab - 1;
  c.dtype = DType::kF32;
  return c;
}

ModelConfig Llama(int vocab, int hidden, int inter, int layers, int heads, int kv_heads,
                  int positions, float eps) {
  ModelConfig c;
  c.arch = Arch::kLlama;
  c.vocab_size = vocab;
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_layers = layers;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.max_positions = positions;
  c.norm_eps = eps;
  c.rope_theta = 10000.0f;
  c.tie_word_embeddings = false;
  c.bos_token_id = 1;
  c.eos_token_id = 2;
  c.dtype = DType::kF16;
  return c;
}

// The Llama-architecture families in their real shapes: bf16 as published, the special ids of
// their tokenizers.
ModelConfig Llama3(int vocab, int hidden, int inter, int layers, int heads, int kv_heads, bool tied,
                   float rope_factor) {
  ModelConfig c = Llama(vocab, hidden, inter, layers, heads, kv_heads, 131072, 1e-5f);
  c.rope_theta = 500000.0f;
  c.rope_scaling = {RopeScaling::Type::kLlama3, rope_factor, 1.0f, 4.0f, 8192};
  c.tie_word_embeddings = tied;
  c.bos_token_id = 128000;
  c.eos_token_id = 128001;
  c.dtype = DType::kBF16;
  return c;
}

ModelConfig Mistral7b() {
  ModelConfig c = Llama(32000, 4096, 14336, 32, 32, 8, 32768, 1e-5f);
  c.model_type = "mistral";
  c.sliding_window = 4096;
  c.dtype = DType::kBF16;
  return c;
}

ModelConfig Qwen25_7b() {
  ModelConfig c = Llama(152064, 3584, 18944, 28, 28, 4, 131072, 1e-6f);
  c.model_type = "qwen2";
  c.rope_theta = 1000000.0f;
  c.qkv_bias = true;
  c.bos_token_id = 151643;
  c.eos_token_id = 151643;
  c.dtype = DType::kBF16;
  return c;
}

ModelConfig Qwen3_8b() {
  ModelConfig c = Llama(151936, 4096, 12288, 36, 32, 8, 40960, 1e-6f);
  c.model_type = "qwen3";
  c.qk_norm = true;
  c.head_dim = 128;
  c.rope_theta = 1000000.0f;
  c.bos_token_id = 151643;
  c.eos_token_id = 151645;
  c.dtype = DType::kBF16;
  return c;
}

// Tiny members of the families, each with what sets it apart where the tests see it:
// tiny-llama3: Llama 3.1's rope scaling with the original context cut to 64, so that at the test
// prompts' positions its three bands all turn (wavelength 6.3 kept, 32 ramped, 166 and up
// divided by 8); tiny-mistral: a sliding window shorter than the test prompts; tiny-qwen2: q/k/v
// biases and a tied head; tiny-qwen3: the per-head q/k norm and a head_dim of 32 that is not
// hidden / heads (16), untied or tied; tiny-openllama: OpenLLaMA-3B's head_dim of 100, not a
// multiple of 8, in two heads.
ModelConfig TinyLlama3() {
  ModelConfig c = TinyLlama(false);
  c.rope_theta = 500000.0f;
  c.rope_scaling = {RopeScaling::Type::kLlama3, 8.0f, 1.0f, 4.0f, 64};
  return c;
}

ModelConfig TinyMistral() {
  ModelConfig c = TinyLlama(false);
  c.model_type = "mistral";
  c.sliding_window = 16;
  return c;
}

ModelConfig TinyQwen2() {
  ModelConfig c = TinyLlama(true);
  c.model_type = "qwen2";
  c.rope_theta = 1000000.0f;
  c.qkv_bias = true;
  return c;
}

ModelConfig TinyOpenLlama() {
  ModelConfig c = TinyLlama(false);
  c.hidden_size = 200;
  c.intermediate_size = 320;
  c.num_heads = 2;
  c.num_kv_heads = 2;
  c.norm_eps = 1e-6f;
  return c;
}

ModelConfig TinyQwen3(bool tied) {
  ModelConfig c = TinyLlama(tied);
  c.model_type = "qwen3";
  c.qk_norm = true;
  c.head_dim = 32;
  c.rope_theta = 1000000.0f;
  return c;
}

struct Preset {
  const char* name;
  ModelConfig (*make)();
};

const std::vector<Preset>& Presets() {
  static const std::vector<Preset> presets = {
      {"tiny-gpt2", [] { return TinyGpt2(); }},
      {"tiny-llama", [] { return TinyLlama(false); }},
      {"tiny-llama-tied", [] { return TinyLlama(true); }},
      {"tiny-llama3", [] { return TinyLlama3(); }},
      {"tiny-mistral", [] { return TinyMistral(); }},
      {"tiny-qwen2", [] { return TinyQwen2(); }},
      {"tiny-qwen3", [] { return TinyQwen3(false); }},
      {"tiny-qwen3-tied", [] { return TinyQwen3(true); }},
      {"tiny-openllama", [] { return TinyOpenLlama(); }},
      {"gpt2",
       [] {
         ModelConfig c;
         c.arch = Arch::kGpt2;
         c.vocab_size = 50257;
         c.hidden_size = 768;
         c.intermediate_size = 3072;
         c.num_layers = 12;
         c.num_heads = 12;
         c.num_kv_heads = 12;
         c.max_positions = 1024;
         c.norm_eps = 1e-5f;
         c.tie_word_embeddings = true;
         c.bos_token_id = 50256;
         c.eos_token_id = 50256;
         c.dtype = DType::kF16;
         return c;
       }},
      {"tinyllama-1b", [] { return Llama(32000, 2048, 5632, 22, 32, 4, 2048, 1e-5f); }},
      {"openllama-3b", [] { return Llama(32000, 3200, 8640, 26, 32, 32, 2048, 1e-6f); }},
      {"llama2-7b", [] { return Llama(32000, 4096, 11008, 32, 32, 32, 4096, 1e-5f); }},
      {"llama2-13b", [] { return Llama(32000, 5120, 13824, 40, 40, 40, 4096, 1e-5f); }},
      {"llama3.2-1b", [] { return Llama3(128256, 2048, 8192, 16, 32, 8, true, 32.0f); }},
      {"llama3.1-8b", [] { return Llama3(128256, 4096, 14336, 32, 32, 8, false, 8.0f); }},
      {"mistral-7b", [] { return Mistral7b(); }},
      {"qwen2.5-7b", [] { return Qwen25_7b(); }},
      {"qwen3-8b", [] { return Qwen3_8b(); }},
  };
  return presets;
}

}  // namespace

absl::StatusOr<ModelConfig> PresetConfig(std::string_view name) {
  for (const Preset& p : Presets()) {
    if (name == p.name) {
      ModelConfig c = p.make();
      if (c.head_dim == 0) c.head_dim = c.hidden_size / c.num_heads;
      if (c.arch == Arch::kGpt2) c.model_type = "gpt2";
      return c;
    }
  }
  return absl::NotFoundError(
      absl::StrCat("unknown preset '", std::string(name),
                   "'; valid presets: ", absl::StrJoin(PresetNames(), ", ")));
}

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const Preset& p : Presets()) names.emplace_back(p.name);
  return names;
}

}  // namespace tandem
