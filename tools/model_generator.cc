// Random-weight checkpoints in Hugging Face's layout; see model_generator.h.
//
// Bit-identical everywhere: every value is a fixed sequence of IEEE float additions and
// multiplications of counter-based random bits (this target is built with -ffp-contract=off so
// that no compiler fuses them into FMAs), then rounded by FromFloat.
#include "tools/model_generator.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <system_error>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/fp8_quantize.h"
#include "common/rng.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "common/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tools/byte_level_bpe.h"
#include "tools/safetensors_writer.h"

namespace tandem {
namespace {

uint64_t Fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char ch : s) {
    h ^= static_cast<unsigned char>(ch);
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t TensorStream(uint64_t seed, std::string_view name) { return Mix64(seed ^ Fnv1a64(name)); }

// Irwin-Hall with 4 terms: mean 2, variance 4/12, so (sum - 2) * sqrt(3) has mean 0, variance 1.
// Left-to-right float additions: the same rounding on every machine.
inline float StandardNormal(uint64_t stream, int64_t index) {
  const uint64_t c = static_cast<uint64_t>(index) * 4;
  const float sum = UniformFloat(stream, c) + UniformFloat(stream, c + 1) +
                    UniformFloat(stream, c + 2) + UniformFloat(stream, c + 3);
  return (sum - 2.0f) * 1.7320508075688772f;
}

inline float Sample(uint64_t stream, const TensorSpec& spec, int64_t index) {
  const float scaled = spec.stddev * StandardNormal(stream, index);
  return spec.mean + scaled;
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::Status Positive(int value, const char* flag) {
  if (value <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be positive, got ", value));
  }
  return absl::OkStatus();
}

// torch spellings (f16, float16, ...) or safetensors ones (F16, ...).
absl::StatusOr<DType> ParseDTypeFlag(std::string_view s) {
  if (absl::StatusOr<DType> t = ParseTorchDType(s); t.ok()) return t;
  if (absl::StatusOr<DType> t = ParseDType(s); t.ok()) return t;
  return absl::InvalidArgumentError(
      absl::StrCat("--dtype must be f32, f16 or bf16, got '", std::string(s), "'"));
}

absl::StatusOr<WeightQuantization> ParseQuantizationFlag(std::string_view s) {
  using Q = WeightQuantization;
  Q q;
  if (s == "none" || s.empty()) return q;
  if (s == "fp8" || s == "fp8-static" || s == "fp8-block") {
    q.method = Q::Method::kFp8;
    q.scales = s == "fp8-block" ? Q::Scales::kBlock : Q::Scales::kTensor;
    if (s == "fp8-block") q.block_rows = q.block_cols = 128;
    q.static_input_scales = s == "fp8-static";
    return q;
  }
  if (s == "compressed-tensors" || s == "compressed-tensors-tensor" ||
      s == "compressed-tensors-static") {
    q.method = Q::Method::kCompressedTensors;
    q.scales = s == "compressed-tensors" ? Q::Scales::kChannel : Q::Scales::kTensor;
    q.static_input_scales = s == "compressed-tensors-static";
    return q;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--quantization must be none, fp8, fp8-static, fp8-block, compressed-tensors, "
      "compressed-tensors-tensor or compressed-tensors-static, got '", std::string(s), "'"));
}

// A Llama layer's linear weight, which --quantization writes in FP8.
bool IsQuantizedLinear(const ModelConfig& c, const TensorSpec& spec) {
  return c.quantization.fp8() && c.arch == Arch::kLlama &&
         absl::StrContains(spec.name, ".layers.") && absl::EndsWith(spec.name, "_proj.weight");
}

// The tensors that stand for `spec` in an FP8 checkpoint, without their data: codes, scales, and
// with static input scales the input scale.
std::vector<SafetensorsEntry> QuantizedEntries(const TensorSpec& spec, const ModelConfig& c) {
  using Q = WeightQuantization;
  const Q& q = c.quantization;
  const int64_t rows = spec.shape[0], cols = spec.shape[1];
  const std::string module = spec.name.substr(0, spec.name.size() - std::string("weight").size());
  // A single scale is [] in quant_method fp8 checkpoints, [1] in compressed-tensors ones.
  const std::vector<int64_t> one =
      q.method == Q::Method::kFp8 ? std::vector<int64_t>{} : std::vector<int64_t>{1};
  std::vector<int64_t> scale_shape = one;
  if (q.scales == Q::Scales::kChannel) scale_shape = {rows, 1};
  if (q.scales == Q::Scales::kBlock) {
    scale_shape = {(rows + q.block_rows - 1) / q.block_rows,
                   (cols + q.block_cols - 1) / q.block_cols};
  }
  std::vector<SafetensorsEntry> out = {
      {spec.name, DType::kF8E4M3, spec.shape},
      {module + std::string(q.scale_suffix()), DType::kF32, scale_shape}};
  if (q.static_input_scales) out.push_back({module + "input_scale", DType::kF32, one});
  return out;
}

// QuantizedEntries with their data.
absl::StatusOr<std::vector<TensorToWrite>> QuantizedTensors(uint64_t seed, const TensorSpec& spec,
                                                            const ModelConfig& c) {
  using Q = WeightQuantization;
  const Q& q = c.quantization;
  const int64_t rows = spec.shape[0], cols = spec.shape[1];
  const uint64_t stream = TensorStream(seed, spec.name);
  std::vector<float> values(static_cast<size_t>(rows * cols));
  std::vector<std::byte> rounded(values.size() * DTypeSize(c.dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = Sample(stream, spec, static_cast<int64_t>(i));
  }
  FromFloat(c.dtype, values.data(), values.size(), rounded.data());
  ToFloat(c.dtype, rounded.data(), values.size(), values.data());
  int64_t br = rows, bc = cols;
  if (q.scales == Q::Scales::kChannel) br = 1;
  if (q.scales == Q::Scales::kBlock) br = q.block_rows, bc = q.block_cols;
  const int64_t sr = (rows + br - 1) / br, sc = (cols + bc - 1) / bc;
  std::vector<uint8_t> codes(values.size());
  std::vector<float> scales(static_cast<size_t>(sr * sc));
  RETURN_IF_ERROR(QuantizeE4M3(values.data(), rows, cols, br, bc, spec.name, codes.data(),
                               scales.data()));
  auto as_bytes = [](const void* p, size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    return std::vector<std::byte>(b, b + n);
  };
  const float in_scale = kGeneratedInputScale;
  std::vector<std::vector<std::byte>> data = {as_bytes(codes.data(), codes.size()),
                                              as_bytes(scales.data(), scales.size() * 4),
                                              as_bytes(&in_scale, sizeof(float))};
  std::vector<TensorToWrite> out;
  for (SafetensorsEntry& e : QuantizedEntries(spec, c)) {
    out.push_back({e.name, e.dtype, e.shape, std::move(data[out.size()])});
  }
  return out;
}

// The KV-cache scale tensors of options.kv_scales, with their data: k_scale and v_scale of each
// layer in turn. INVALID_ARGUMENT naming --kv_scales where the pairs are neither one nor one per
// layer, or a scale is not a finite number > 0.
absl::StatusOr<std::vector<TensorToWrite>> KvScaleTensors(const ModelConfig& c,
                                                          const GeneratorOptions& options) {
  const std::vector<std::pair<float, float>>& pairs = options.kv_scales;
  if (pairs.empty()) return std::vector<TensorToWrite>{};
  if (pairs.size() != 1 && pairs.size() != static_cast<size_t>(c.num_layers)) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_scales: ", pairs.size(),
                                                   " pairs for a model of ", c.num_layers,
                                                   " layers (give one, or one per layer)"));
  }
  std::vector<TensorToWrite> out;
  for (int i = 0; i < c.num_layers; ++i) {
    const auto [k, v] = pairs[pairs.size() == 1 ? 0 : i];
    for (const auto& [value, is_v] : {std::pair{k, false}, std::pair{v, true}}) {
      if (!std::isfinite(value) || value <= 0.0f) {
        return absl::InvalidArgumentError(absl::StrCat("--kv_scales: layer ", i, "'s ",
                                                       is_v ? "v" : "k", "_scale ", value,
                                                       " (each must be a finite number > 0)"));
      }
      TensorToWrite t{.name = KvScaleTensorName(c.arch, i, is_v), .dtype = DType::kF32};
      t.bytes.resize(sizeof(float));
      std::memcpy(t.bytes.data(), &value, sizeof(float));
      out.push_back(std::move(t));
    }
  }
  return out;
}

absl::Status WriteTextFile(const std::filesystem::path& path, const std::string& text) {
  std::filesystem::path tmp = path;
  tmp += ".partial";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.close();
    if (!out) {
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
      return absl::UnavailableError(absl::StrCat("cannot write ", tmp.string()));
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot rename ", tmp.string(), " to ", path.string(), ": ", ec.message()));
  }
  return absl::OkStatus();
}

// Generates `spec`'s values, rounds them to `dtype` and appends them to `out`, a bounded chunk at
// a time; large chunks are split across a few threads (each element depends only on its index).
absl::Status StreamTensor(uint64_t seed, const TensorSpec& spec, DType dtype,
                          SafetensorsStreamWriter& out) {
  constexpr int64_t kChunk = int64_t{1} << 22;      // elements per write
  constexpr int64_t kPerThread = int64_t{1} << 16;  // below this, threads cost more than they save
  const uint64_t stream = TensorStream(seed, spec.name);
  const int64_t n = Numel(spec.shape);
  const size_t esize = DTypeSize(dtype);
  const int max_threads =
      static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1, 8));
  std::vector<float> values(static_cast<size_t>(std::min(n, kChunk)));
  std::vector<std::byte> bytes(values.size() * esize);

  for (int64_t begin = 0; begin < n; begin += kChunk) {
    const int64_t len = std::min(kChunk, n - begin);
    auto fill = [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) values[i] = Sample(stream, spec, begin + i);
      FromFloat(dtype, values.data() + lo, static_cast<size_t>(hi - lo),
                bytes.data() + static_cast<size_t>(lo) * esize);
    };
    const int threads = static_cast<int>(std::clamp<int64_t>(len / kPerThread, 1, max_threads));
    if (threads == 1) {
      fill(0, len);
    } else {
      std::vector<std::thread> workers;
      const int64_t step = (len + threads - 1) / threads;
      for (int t = 0; t < threads; ++t) {
        const int64_t lo = t * step, hi = std::min(len, lo + step);
        if (lo < hi) workers.emplace_back(fill, lo, hi);
      }
      for (std::thread& w : workers) w.join();
    }
    RETURN_IF_ERROR(
        out.Append(std::span<const std::byte>(bytes.data(), static_cast<size_t>(len) * esize)));
  }
  return absl::OkStatus();
}

// Removes model files of either layout, so that a folder written twice with different sharding
// does not keep an index or shards that no longer match.
void RemoveStaleModelFiles(const std::filesystem::path& dir) {
  static const std::regex kShard(R"(model-\d+-of-\d+\.safetensors)");
  std::error_code ec;
  std::vector<std::filesystem::path> stale;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name == "model.safetensors" || name == "model.safetensors.index.json" ||
        std::regex_match(name, kShard)) {
      stale.push_back(entry.path());
    }
  }
  for (const auto& p : stale) std::filesystem::remove(p, ec);
}

std::string TokenizerConfigJson(const ModelConfig& c) {
  nlohmann::ordered_json j;
  j["tokenizer_class"] = "PreTrainedTokenizerFast";
  j["model_max_length"] = c.max_positions;
  j["bos_token"] = "<|endoftext|>";
  j["eos_token"] = "<|endoftext|>";
  j["add_prefix_space"] = false;
  j["clean_up_tokenization_spaces"] = false;
  return j.dump(2) + "\n";
}

// The special token's id: the end-of-text id where that is not one of the 256 byte tokens
// (tiny presets and GPT-2), else the last id (Llama presets, whose eos is 2).
int SpecialTokenId(const ModelConfig& c) {
  if (c.eos_token_id >= 256 && c.eos_token_id < c.vocab_size) return c.eos_token_id;
  return c.vocab_size - 1;
}

}  // namespace

absl::StatusOr<ModelConfig> ApplyOverrides(ModelConfig c, const ModelOverrides& o) {
  const int old_vocab = c.vocab_size;
  const bool mha = c.num_kv_heads == c.num_heads;
  if (o.vocab_size) {
    RETURN_IF_ERROR(Positive(*o.vocab_size, "vocab_size"));
    c.vocab_size = *o.vocab_size;
    if (c.eos_token_id == old_vocab - 1) c.eos_token_id = c.vocab_size - 1;
    if (c.bos_token_id == old_vocab - 1) c.bos_token_id = c.vocab_size - 1;
  }
  if (o.hidden_size) {
    RETURN_IF_ERROR(Positive(*o.hidden_size, "hidden_size"));
    c.hidden_size = *o.hidden_size;
    if (c.arch == Arch::kGpt2 && !o.intermediate_size) c.intermediate_size = 4 * c.hidden_size;
  }
  if (o.intermediate_size) c.intermediate_size = *o.intermediate_size;
  if (o.num_layers) c.num_layers = *o.num_layers;
  if (o.num_heads) {
    c.num_heads = *o.num_heads;
    if (mha && !o.num_kv_heads) c.num_kv_heads = c.num_heads;
  }
  if (o.num_kv_heads) c.num_kv_heads = *o.num_kv_heads;
  if (o.max_positions) c.max_positions = *o.max_positions;
  if (o.norm_eps) c.norm_eps = *o.norm_eps;
  if (o.rope_theta) {
    if (c.arch == Arch::kGpt2) {
      return absl::InvalidArgumentError(
          "--rope_theta applies only to Llama models (GPT-2 has "
          "learned positions)");
    }
    c.rope_theta = *o.rope_theta;
  }
  if (o.tie_word_embeddings) c.tie_word_embeddings = *o.tie_word_embeddings;
  if (o.sliding_window) {
    if (c.model_type != "mistral" && c.model_type != "qwen2" && c.model_type != "qwen3") {
      return absl::InvalidArgumentError(absl::StrCat(
          "--sliding_window applies only to Mistral, Qwen2 and Qwen3 models, not ", c.model_type));
    }
    if (*o.sliding_window < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--sliding_window must be 0 (none) or positive, got ", *o.sliding_window));
    }
    c.sliding_window = *o.sliding_window;
  }
  if (o.max_window_layers) {
    if (c.model_type != "qwen2" && c.model_type != "qwen3") {
      return absl::InvalidArgumentError("--max_window_layers applies only to Qwen2 and Qwen3 models");
    }
    if (*o.max_window_layers < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--max_window_layers must not be negative, got ", *o.max_window_layers));
    }
    c.windowed_layers.clear();
  }
  if (o.dtype) {
    ASSIGN_OR_RETURN(c.dtype, ParseDTypeFlag(*o.dtype));
  }
  if (o.quantization) {
    ASSIGN_OR_RETURN(c.quantization, ParseQuantizationFlag(*o.quantization));
    if (c.quantization.fp8() && c.arch != Arch::kLlama) {
      return absl::InvalidArgumentError(
          "--quantization applies only to Llama-architecture models (FP8 checkpoints of GPT-2 "
          "are not read)");
    }
  }
  // Qwen3 keeps its own head_dim, as Qwen3Config does; the others follow hidden / heads.
  if (o.head_dim) {
    if (!c.qk_norm) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--head_dim applies only to Qwen3 models (the others have hidden / heads), not ",
          c.model_type));
    }
    c.head_dim = *o.head_dim;
  } else if (c.num_heads > 0 && !c.qk_norm) {
    c.head_dim = c.hidden_size / c.num_heads;
  }
  // Qwen2 and Qwen3 window layers [max_window_layers, num_layers), once the layer count is known.
  if (o.max_window_layers && c.num_layers > 0) {
    c.windowed_layers.assign(c.num_layers, false);
    for (int l = std::min(*o.max_window_layers, c.num_layers); l < c.num_layers; ++l) {
      c.windowed_layers[l] = true;
    }
  }
  RETURN_IF_ERROR(ValidateGeneratorConfig(c));
  return c;
}

absl::Status ValidateGeneratorConfig(const ModelConfig& c) {
  RETURN_IF_ERROR(Positive(c.vocab_size, "vocab_size"));
  RETURN_IF_ERROR(Positive(c.hidden_size, "hidden_size"));
  RETURN_IF_ERROR(Positive(c.intermediate_size, "intermediate_size"));
  RETURN_IF_ERROR(Positive(c.num_layers, "num_layers"));
  RETURN_IF_ERROR(Positive(c.num_heads, "num_heads"));
  RETURN_IF_ERROR(Positive(c.num_kv_heads, "num_kv_heads"));
  RETURN_IF_ERROR(Positive(c.max_positions, "max_positions"));
  if (c.qk_norm) {
    RETURN_IF_ERROR(Positive(c.head_dim, "head_dim"));
  } else if (c.hidden_size % c.num_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num_heads (", c.num_heads, ") must divide --hidden_size (", c.hidden_size, ")"));
  }
  if (!c.qk_norm && c.head_dim != c.hidden_size / c.num_heads) {
    return absl::InvalidArgumentError(absl::StrCat("head_dim (", c.head_dim,
                                                   ") must be --hidden_size / --num_heads (",
                                                   c.hidden_size / c.num_heads, ")"));
  }
  if (c.arch == Arch::kGpt2 && c.num_kv_heads != c.num_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("--num_kv_heads (", c.num_kv_heads, ") must equal --num_heads (", c.num_heads,
                     ") for GPT-2, which has no grouped-query attention"));
  }
  if (c.num_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num_kv_heads (", c.num_kv_heads, ") must divide --num_heads (", c.num_heads, ")"));
  }
  if (c.arch == Arch::kLlama && c.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        c.qk_norm ? "--head_dim (" : "--hidden_size / --num_heads (", c.head_dim,
        ") must be even: RoPE rotates pairs"));
  }
  if (!(c.norm_eps > 0.0f) || !std::isfinite(c.norm_eps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--norm_eps must be positive and finite, got ", c.norm_eps));
  }
  if (c.arch == Arch::kLlama && (!(c.rope_theta > 0.0f) || !std::isfinite(c.rope_theta))) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rope_theta must be positive and finite, got ", c.rope_theta));
  }
  for (auto [id, what] :
       {std::pair{c.bos_token_id, "bos_token_id"}, std::pair{c.eos_token_id, "eos_token_id"}}) {
    if (id < -1 || id >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " ", id, " is outside --vocab_size (", c.vocab_size, ")"));
    }
  }
  // Parameter count in double, which cannot overflow: a guard against dimensions so large that
  // byte sizes would overflow int64 or the tensor list would not fit in memory.
  const double h = c.hidden_size, inter = c.intermediate_size, layers = c.num_layers;
  const double per_layer =
      c.arch == Arch::kGpt2
          ? 12.0 * h * h + 2.0 * h * inter + 13.0 * h + inter
          : 2.0 * h * (c.num_heads + c.num_kv_heads) * c.head_dim + 3.0 * h * inter + 2.0 * h;
  const double params = 2.0 * c.vocab_size * h + c.max_positions * h + layers * per_layer;
  constexpr double kMaxParams = 1e13;
  if (params > kMaxParams || c.num_layers > 100000) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "model too large: about %.3g parameters in %d layers (limits: %.0e parameters, 100000 "
        "layers); check --vocab_size, --hidden_size, --intermediate_size and --num_layers",
        params, c.num_layers, kMaxParams));
  }
  if (c.vocab_size < 257) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--vocab_size must be at least 257 (256 byte tokens + <|endoftext|>), got ", c.vocab_size));
  }
  return absl::OkStatus();
}

std::vector<TensorSpec> CheckpointTensors(const ModelConfig& c) {
  constexpr float kStd = 0.02f;     // matrices, embeddings, biases
  constexpr float kNormStd = 0.1f;  // norm weights scatter around 1 so that tests see them
  const int64_t h = c.hidden_size, inter = c.intermediate_size, vocab = c.vocab_size;
  std::vector<TensorSpec> t;
  auto matrix = [&](std::string name, std::vector<int64_t> shape) {
    t.push_back({std::move(name), std::move(shape), 0.0f, kStd});
  };
  auto norm = [&](std::string name, int64_t n) {
    t.push_back({std::move(name), {n}, 1.0f, kNormStd});
  };
  auto bias = [&](std::string name, int64_t n) { t.push_back({std::move(name), {n}, 0.0f, kStd}); };

  if (c.arch == Arch::kGpt2) {
    // Conv1D stores weights as (in, out); the LM head is always tied to wte.
    matrix("transformer.wte.weight", {vocab, h});
    matrix("transformer.wpe.weight", {c.max_positions, h});
    for (int i = 0; i < c.num_layers; ++i) {
      const std::string p = absl::StrCat("transformer.h.", i, ".");
      norm(p + "ln_1.weight", h);
      bias(p + "ln_1.bias", h);
      matrix(p + "attn.c_attn.weight", {h, 3 * h});
      bias(p + "attn.c_attn.bias", 3 * h);
      matrix(p + "attn.c_proj.weight", {h, h});
      bias(p + "attn.c_proj.bias", h);
      norm(p + "ln_2.weight", h);
      bias(p + "ln_2.bias", h);
      matrix(p + "mlp.c_fc.weight", {h, inter});
      bias(p + "mlp.c_fc.bias", inter);
      matrix(p + "mlp.c_proj.weight", {inter, h});
      bias(p + "mlp.c_proj.bias", h);
    }
    norm("transformer.ln_f.weight", h);
    bias("transformer.ln_f.bias", h);
    return t;
  }

  // Llama, Mistral, Qwen2, Qwen3: nn.Linear stores weights as (out, in), a bias after its weight;
  // Qwen3's q_norm and k_norm follow o_proj.
  const int64_t q = c.q_dim(), kv = c.kv_dim();
  matrix("model.embed_tokens.weight", {vocab, h});
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    matrix(p + "self_attn.q_proj.weight", {q, h});
    if (c.qkv_bias) bias(p + "self_attn.q_proj.bias", q);
    matrix(p + "self_attn.k_proj.weight", {kv, h});
    if (c.qkv_bias) bias(p + "self_attn.k_proj.bias", kv);
    matrix(p + "self_attn.v_proj.weight", {kv, h});
    if (c.qkv_bias) bias(p + "self_attn.v_proj.bias", kv);
    matrix(p + "self_attn.o_proj.weight", {h, q});
    if (c.o_bias) bias(p + "self_attn.o_proj.bias", h);
    if (c.qk_norm) {
      norm(p + "self_attn.q_norm.weight", c.head_dim);
      norm(p + "self_attn.k_norm.weight", c.head_dim);
    }
    matrix(p + "mlp.gate_proj.weight", {inter, h});
    matrix(p + "mlp.up_proj.weight", {inter, h});
    matrix(p + "mlp.down_proj.weight", {h, inter});
    norm(p + "input_layernorm.weight", h);
    norm(p + "post_attention_layernorm.weight", h);
  }
  norm("model.norm.weight", h);
  if (!c.tie_word_embeddings) matrix("lm_head.weight", {vocab, h});
  return t;
}

float RandomWeight(uint64_t seed, const TensorSpec& spec, int64_t index) {
  return Sample(TensorStream(seed, spec.name), spec, index);
}

namespace {

// A special token of tokenizer_config.json / special_tokens_map.json: a string, an
// {"content": ...} object, or null / absent (none).
std::optional<std::string> SpecialTokenText(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto content = it->find("content");
    if (content != it->end() && content->is_string()) return content->get<std::string>();
  }
  return std::nullopt;
}

absl::StatusOr<nlohmann::json> ReadJsonObject(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return nlohmann::json::object();
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": not a JSON object"));
  }
  return j;
}

}  // namespace

absl::StatusOr<TokenizerSpecials> ReadTokenizerSpecials(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::exists(dir / "tokenizer.json", ec) &&
      !std::filesystem::exists(dir / "tokenizer.model", ec)) {
    return absl::NotFoundError(absl::StrCat(
        "--tokenizer ", dir.string(),
        ": no tokenizer.json or tokenizer.model there; give the folder of a Hugging Face "
        "tokenizer"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, Tokenizer::FromDir(dir));
  ASSIGN_OR_RETURN(nlohmann::json config, ReadJsonObject(dir / "tokenizer_config.json"));
  ASSIGN_OR_RETURN(nlohmann::json map, ReadJsonObject(dir / "special_tokens_map.json"));
  TokenizerSpecials t;
  t.vocab_size = tokenizer->vocab_size();
  for (auto [key, id] :
       {std::pair{"bos_token", &t.bos_token_id}, std::pair{"eos_token", &t.eos_token_id},
        std::pair{"pad_token", &t.pad_token_id}}) {
    std::optional<std::string> text = SpecialTokenText(config, key);
    const char* file = "tokenizer_config.json";
    if (!text) {
      text = SpecialTokenText(map, key);
      file = "special_tokens_map.json";
    }
    if (!text) continue;
    const std::optional<int32_t> found = tokenizer->TokenToId(*text);
    if (!found) {
      return absl::InvalidArgumentError(absl::StrCat((dir / file).string(), ": ", key, " \"", *text,
                                                     "\" is not in the tokenizer"));
    }
    *id = *found;
  }
  return t;
}

absl::StatusOr<ModelConfig> FitToTokenizer(ModelConfig c, const TokenizerSpecials& t,
                                           bool keep_vocab_size) {
  if (!keep_vocab_size) {
    c.vocab_size = t.vocab_size;
  } else if (c.vocab_size < t.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("--vocab_size ", c.vocab_size, " is smaller than the tokenizer's ",
                     t.vocab_size, " ids; leave it out to take the tokenizer's"));
  }
  c.bos_token_id = t.bos_token_id;
  c.eos_token_id = t.eos_token_id;
  RETURN_IF_ERROR(ValidateGeneratorConfig(c));
  return c;
}

namespace {

// config.json, and with a real tokenizer its files copied in (stale ones of the other kind
// removed, so that a tokenizer.json left from an earlier run is not read instead).
absl::Status WriteConfigAndTokenizer(const ModelConfig& config, const GeneratorOptions& options,
                                     const std::filesystem::path& dir) {
  if (options.tokenizer_dir.empty()) {
    RETURN_IF_ERROR(WriteTextFile(dir / "config.json", ModelConfigToJson(config)));
    const int special_id = SpecialTokenId(config);
    const BpeVocab bpe = TrainByteLevelBpe(TokenizerCorpus(), special_id);
    RETURN_IF_ERROR(
        WriteTextFile(dir / "tokenizer.json", TokenizerJson(bpe, "<|endoftext|>", special_id)));
    return WriteTextFile(dir / "tokenizer_config.json", TokenizerConfigJson(config));
  }
  ASSIGN_OR_RETURN(TokenizerSpecials t, ReadTokenizerSpecials(options.tokenizer_dir));
  if (config.vocab_size < t.vocab_size || config.bos_token_id != t.bos_token_id ||
      config.eos_token_id != t.eos_token_id) {
    return absl::InvalidArgumentError(
        absl::StrCat("the config does not fit the tokenizer in ", options.tokenizer_dir.string(),
                     " (vocabulary ", t.vocab_size, ", bos ", t.bos_token_id, ", eos ",
                     t.eos_token_id, "): make it with FitToTokenizer"));
  }
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(ModelConfigToJson(config));
  if (t.pad_token_id >= 0) j["pad_token_id"] = t.pad_token_id;
  RETURN_IF_ERROR(WriteTextFile(dir / "config.json", j.dump(2) + "\n"));
  for (const char* name : kTokenizerFiles) {
    std::error_code ec;
    const std::filesystem::path from = options.tokenizer_dir / name, to = dir / name;
    if (!std::filesystem::exists(from, ec)) {
      std::filesystem::remove(to, ec);
      continue;
    }
    std::filesystem::copy_file(from, to, std::filesystem::copy_options::overwrite_existing, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("cannot copy ", from.string(), " to ", to.string(), ": ", ec.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteRandomCheckpoint(const ModelConfig& config, const GeneratorOptions& options,
                                   const std::filesystem::path& dir) {
  RETURN_IF_ERROR(ValidateGeneratorConfig(config));
  if (options.max_shard_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--max_shard_mb must not be negative, got ",
                                                   options.max_shard_bytes, " bytes"));
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot create folder ", dir.string(), ": ", ec.message()));
  }
  RemoveStaleModelFiles(dir);

  RETURN_IF_ERROR(WriteConfigAndTokenizer(config, options, dir));

  // Shards as save_pretrained cuts them: tensors in state_dict order, a new shard whenever the
  // next tensor would push a non-empty shard past the limit.
  const std::vector<TensorSpec> specs = CheckpointTensors(config);
  // FP8 linear weights: spec index -> the tensors written for it.
  std::map<size_t, std::vector<SafetensorsEntry>> quantized;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (IsQuantizedLinear(config, specs[i])) quantized[i] = QuantizedEntries(specs[i], config);
  }
  // The KV-cache scales, after every other tensor (in the last shard).
  ASSIGN_OR_RETURN(const std::vector<TensorToWrite> kv_scales, KvScaleTensors(config, options));
  std::vector<std::vector<size_t>> shards(1);
  int64_t shard_bytes = 0, total_bytes = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    int64_t nbytes = Numel(specs[i].shape) * static_cast<int64_t>(DTypeSize(config.dtype));
    if (auto q = quantized.find(i); q != quantized.end()) {
      nbytes = 0;
      for (const SafetensorsEntry& e : q->second) nbytes += e.nbytes();
    }
    if (options.max_shard_bytes > 0 && !shards.back().empty() &&
        shard_bytes + nbytes > options.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += nbytes;
    total_bytes += nbytes;
  }
  for (const TensorToWrite& t : kv_scales) total_bytes += static_cast<int64_t>(t.bytes.size());

  const int n = static_cast<int>(shards.size());
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (int s = 0; s < n; ++s) {
    const std::string file =
        n == 1 ? "model.safetensors" : absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, n);
    std::vector<SafetensorsEntry> entries;
    for (size_t i : shards[s]) {
      if (auto q = quantized.find(i); q != quantized.end()) {
        entries.insert(entries.end(), q->second.begin(), q->second.end());
      } else {
        entries.push_back({specs[i].name, config.dtype, specs[i].shape});
      }
    }
    const bool last = s + 1 == n;
    if (last) {
      for (const TensorToWrite& t : kv_scales) entries.push_back({t.name, t.dtype, t.shape});
    }
    ASSIGN_OR_RETURN(auto writer,
                     SafetensorsStreamWriter::Create(dir / file, entries, {{"format", "pt"}}));
    for (size_t i : shards[s]) {
      if (quantized.count(i) > 0) {
        // One tensor in memory at a time (a few hundred MB for the largest shapes).
        ASSIGN_OR_RETURN(std::vector<TensorToWrite> tensors,
                         QuantizedTensors(options.seed, specs[i], config));
        for (const TensorToWrite& t : tensors) {
          RETURN_IF_ERROR(writer->Append(t.bytes));
          weight_map[t.name] = file;
        }
        continue;
      }
      RETURN_IF_ERROR(StreamTensor(options.seed, specs[i], config.dtype, *writer));
      weight_map[specs[i].name] = file;
    }
    for (size_t i = 0; last && i < kv_scales.size(); ++i) {
      RETURN_IF_ERROR(writer->Append(kv_scales[i].bytes));
      weight_map[kv_scales[i].name] = file;
    }
    RETURN_IF_ERROR(writer->Finish());
  }
  if (n > 1) {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total_bytes}};
    index["weight_map"] = weight_map;
    RETURN_IF_ERROR(WriteTextFile(dir / "model.safetensors.index.json", index.dump(2) + "\n"));
  }
  return absl::OkStatus();
}

}  // namespace tandem
