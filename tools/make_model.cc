// tandem-make-model: writes a random-weight checkpoint folder in Hugging Face's layout.
//   tandem-make-model --preset=tiny-llama --out=/tmp/tiny-llama --seed=1
//   tandem-make-model --preset=tiny-qwen2 --tokenizer=DIR --out=/tmp/m  (a real tokenizer's files)
// Every dimension of the preset can be overridden; see --help.
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/flags_usage.h"
#include "tools/model_generator.h"

ABSL_FLAG(std::string, preset, "", "model shape to start from (required); see --help for names");
ABSL_FLAG(std::string, out, "", "checkpoint folder to write (required; created if missing)");
ABSL_FLAG(uint64_t, seed, 0, "random seed; the same seed gives the same bytes on every machine");
ABSL_FLAG(std::optional<std::string>, dtype, std::nullopt,
          "weight type: f32, f16 or bf16 (default: f32 for tiny presets, f16 otherwise)");
ABSL_FLAG(std::optional<std::string>, quantization, std::nullopt,
          "write FP8 (E4M3) linear weights, Llama only: fp8 (per-tensor scales), fp8-static (and "
          "static input scales), fp8-block (128x128 blocks), compressed-tensors (per-channel), "
          "compressed-tensors-tensor, compressed-tensors-static; none: 16/32-bit");
ABSL_FLAG(std::optional<int>, vocab_size, std::nullopt,
          "override: vocabulary size (with --tokenizer: the tokenizer's unless given)");
ABSL_FLAG(std::optional<int>, hidden_size, std::nullopt, "override: hidden size");
ABSL_FLAG(std::optional<int>, intermediate_size, std::nullopt, "override: MLP inner size");
ABSL_FLAG(std::optional<int>, num_layers, std::nullopt, "override: transformer blocks");
ABSL_FLAG(std::optional<int>, num_heads, std::nullopt, "override: attention (query) heads");
ABSL_FLAG(std::optional<int>, num_kv_heads, std::nullopt, "override: key/value heads (Llama)");
ABSL_FLAG(std::optional<int>, max_positions, std::nullopt, "override: context length");
ABSL_FLAG(std::optional<float>, norm_eps, std::nullopt, "override: LayerNorm/RMSNorm epsilon");
ABSL_FLAG(std::optional<float>, rope_theta, std::nullopt, "override: RoPE base (Llama)");
ABSL_FLAG(bool, tie_word_embeddings, false,
          "override: LM head shares the token embedding (Llama; GPT-2 is always tied); "
          "unless given, the preset decides");
ABSL_FLAG(std::optional<int>, sliding_window, std::nullopt,
          "override: attention window in positions, 0 for none (Mistral, Qwen2, Qwen3)");
ABSL_FLAG(std::optional<int>, max_window_layers, std::nullopt,
          "override: first layer the window applies to (Qwen2, Qwen3)");
ABSL_FLAG(std::optional<int>, head_dim, std::nullopt,
          "override: width of one attention head (Qwen3; the others have hidden / heads)");
ABSL_FLAG(std::string, tokenizer, "",
          "folder of a real Hugging Face tokenizer: its tokenizer.json, tokenizer_config.json, "
          "special_tokens_map.json and tokenizer.model (those present) are copied next to the "
          "weights, and the vocabulary size and BOS/EOS/pad ids are taken from it (empty: a "
          "small BPE tokenizer trained here)");
ABSL_FLAG(int64_t, max_shard_mb, 0,
          "> 0: split the weights into shards of at most this many MiB plus an index");
ABSL_FLAG(std::string, kv_scales, "",
          "write each layer's KV-cache scales (self_attn.k_scale and v_scale, F32 scalars, as "
          "checkpoints for an FP8 KV-cache publish them): K:V for every layer, or K:V,K:V,... "
          "one pair per layer (empty: none)");

// --kv_scales: "K:V" or "K:V,K:V,..." as (k_scale, v_scale) pairs; nullopt where it does not
// parse (WriteRandomCheckpoint checks the values and the count).
std::optional<std::vector<std::pair<float, float>>> ParseKvScales(const std::string& text) {
  std::vector<std::pair<float, float>> pairs;
  if (text.empty()) return pairs;
  for (absl::string_view pair : absl::StrSplit(text, ',')) {
    const std::vector<absl::string_view> kv = absl::StrSplit(pair, ':');
    float k = 0, v = 0;
    if (kv.size() != 2 || !absl::SimpleAtof(kv[0], &k) || !absl::SimpleAtof(kv[1], &v)) {
      return std::nullopt;
    }
    pairs.emplace_back(k, v);
  }
  return pairs;
}

// Whether the boolean flag `name` was given (--name, --name=..., --noname), which a plain bool
// flag cannot tell from its default. Stops at "--", where flags end.
bool BoolFlagGiven(int argc, char** argv, std::string_view name) {
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.empty() || arg[0] != '-') continue;
    arg.remove_prefix(arg.size() > 1 && arg[1] == '-' ? 2 : 1);
    arg = arg.substr(0, arg.find('='));
    if (arg == name || (arg.substr(0, 2) == "no" && arg.substr(2) == name)) return true;
  }
  return false;
}

int main(int argc, char** argv) {
  const std::string presets = absl::StrJoin(tandem::PresetNames(), ", ");
  tandem::SetProgramUsage(
      "writes a random-weight Hugging Face checkpoint folder (config.json, safetensors, "
      "tokenizer.json).\nPresets: " +
      presets + "\nExample: tandem-make-model --preset=tiny-llama --out=/tmp/m --seed=1");
  const bool tie_given = BoolFlagGiven(argc, argv, "tie_word_embeddings");
  const std::vector<char*> positional = tandem::ParseFlags(argc, argv);
  if (positional.size() > 1) {
    std::fprintf(stderr, "tandem-make-model: unexpected argument '%s'\n", positional[1]);
    return 2;
  }
  const std::string preset = absl::GetFlag(FLAGS_preset);
  const std::string out = absl::GetFlag(FLAGS_out);
  if (preset.empty() || out.empty()) {
    std::fprintf(stderr, "tandem-make-model: --preset and --out are required; presets: %s\n",
                 presets.c_str());
    return 2;
  }

  auto base = tandem::PresetConfig(preset);
  if (!base.ok()) {
    std::fprintf(stderr, "tandem-make-model: --preset: %s\n", base.status().ToString().c_str());
    return 2;
  }
  tandem::ModelOverrides o;
  o.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  o.hidden_size = absl::GetFlag(FLAGS_hidden_size);
  o.intermediate_size = absl::GetFlag(FLAGS_intermediate_size);
  o.num_layers = absl::GetFlag(FLAGS_num_layers);
  o.num_heads = absl::GetFlag(FLAGS_num_heads);
  o.num_kv_heads = absl::GetFlag(FLAGS_num_kv_heads);
  o.max_positions = absl::GetFlag(FLAGS_max_positions);
  o.norm_eps = absl::GetFlag(FLAGS_norm_eps);
  o.rope_theta = absl::GetFlag(FLAGS_rope_theta);
  if (tie_given) o.tie_word_embeddings = absl::GetFlag(FLAGS_tie_word_embeddings);
  o.sliding_window = absl::GetFlag(FLAGS_sliding_window);
  o.max_window_layers = absl::GetFlag(FLAGS_max_window_layers);
  o.head_dim = absl::GetFlag(FLAGS_head_dim);
  o.dtype = absl::GetFlag(FLAGS_dtype);
  o.quantization = absl::GetFlag(FLAGS_quantization);
  auto config = tandem::ApplyOverrides(*base, o);
  tandem::GeneratorOptions options;
  if (const std::string dir = absl::GetFlag(FLAGS_tokenizer); !dir.empty() && config.ok()) {
    options.tokenizer_dir = dir;
    absl::StatusOr<tandem::TokenizerSpecials> t = tandem::ReadTokenizerSpecials(dir);
    config = t.ok() ? tandem::FitToTokenizer(*config, *t, o.vocab_size.has_value())
                    : absl::StatusOr<tandem::ModelConfig>(t.status());
  }
  if (!config.ok()) {
    std::fprintf(stderr, "tandem-make-model: %s\n", std::string(config.status().message()).c_str());
    return 2;
  }

  const int64_t shard_mb = absl::GetFlag(FLAGS_max_shard_mb);
  if (shard_mb < 0 || shard_mb > (int64_t{1} << 40)) {
    std::fprintf(stderr, "tandem-make-model: --max_shard_mb must be between 0 and 2^40, got %lld\n",
                 static_cast<long long>(shard_mb));
    return 2;
  }
  options.seed = absl::GetFlag(FLAGS_seed);
  options.max_shard_bytes = shard_mb * 1024 * 1024;
  const std::optional<std::vector<std::pair<float, float>>> kv_scales =
      ParseKvScales(absl::GetFlag(FLAGS_kv_scales));
  if (!kv_scales) {
    std::fprintf(stderr,
                 "tandem-make-model: --kv_scales '%s': expected K:V or K:V,K:V,... "
                 "(numbers)\n",
                 absl::GetFlag(FLAGS_kv_scales).c_str());
    return 2;
  }
  options.kv_scales = *kv_scales;
  if (absl::Status s = tandem::WriteRandomCheckpoint(*config, options, out); !s.ok()) {
    std::fprintf(stderr, "tandem-make-model: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("wrote %s (%s, seed %llu)\n", out.c_str(), preset.c_str(),
              static_cast<unsigned long long>(options.seed));
  return 0;
}
