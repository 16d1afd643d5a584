// Finds one stage's tensors in a Hugging Face checkpoint, in the engine's layout, and reads them as
// fp32 for the CPU backend.
//
// Names, with or without the "transformer." (GPT-2) / "model." (Llama) prefix:
//   GPT-2: wte, wpe, h.{i}.ln_1, h.{i}.attn.c_attn (hidden, 3 * hidden), h.{i}.attn.c_proj,
//          h.{i}.ln_2, h.{i}.mlp.c_fc (hidden, inter), h.{i}.mlp.c_proj (inter, hidden), ln_f.
//          Conv1D stores (in, out); every matrix is transposed to (out, in) here.
//   Llama, Mistral, Qwen2, Qwen3: embed_tokens, layers.{i}.input_layernorm,
//          layers.{i}.self_attn.{q,k,v,o}_proj (.weight, and .bias where the config has biases:
//          q, k, v for Qwen2, all four for attention_bias of Llama and Qwen3),
//          layers.{i}.self_attn.{q,k}_norm.weight (Qwen3),
//          layers.{i}.post_attention_layernorm, layers.{i}.mlp.{gate,up,down}_proj, norm.
//   Both:  lm_head.weight (never prefixed), or the token embedding when the head is tied.
// GPT-2's attn.bias / attn.masked_bias are causal-mask buffers, not weights, and are never read.
#include "worker/weights.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace tandem {
namespace {

// Resolves a tensor name given without its architecture prefix to the spelling the checkpoint
// uses, and finds it after checking that its shape is exactly `shape`.
class TensorReader {
 public:
  TensorReader(Checkpoint& ckpt, std::string prefix) : ckpt_(ckpt), prefix_(std::move(prefix)) {}

  // FP8 only where `fp8` allows it (ReadLinear: a linear layer's weight, with its scales).
  absl::StatusOr<TensorSource> Read(const std::string& name, const std::vector<int64_t>& shape,
                                    bool fp8 = false) {
    ASSIGN_OR_RETURN(std::string found, Resolve(name));
    read_.insert(found);
    ASSIGN_OR_RETURN(TensorView view, ckpt_.tensor(found));
    if (view.shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", found, "' in ", ckpt_.dir().string(), ": expected shape [",
          absl::StrJoin(shape, ", "), "], found [", absl::StrJoin(view.shape, ", "), "]"));
    }
    if (view.dtype == DType::kF8E4M3 && !fp8) {
      return absl::UnimplementedError(absl::StrCat(
          "tensor '", found, "' in ", ckpt_.dir().string(),
          " is F8_E4M3; only the linear layers' weights of the decoder layers may be (the "
          "embeddings, norms, biases and LM head must be F32, F16 or BF16)"));
    }
    TensorSource src;
    src.parts.push_back(std::move(view));
    return src;
  }

  // A linear layer's "<module>.weight" of shape (out, in), with its scales when it is stored in
  // FP8: "<module>.weight_scale" or ".weight_scale_inv" as the config's quantization_config
  // says, and "<module>.input_scale" with static activation scales.
  absl::StatusOr<TensorSource> ReadLinear(const std::string& module,
                                          const std::vector<int64_t>& shape) {
    ASSIGN_OR_RETURN(TensorSource src, Read(module + ".weight", shape, /*fp8=*/true));
    const TensorView& w = src.parts[0];
    const WeightQuantization& q = ckpt_.config().quantization;
    if (w.dtype != DType::kF8E4M3) return src;
    if (!q.fp8()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", w.name, "' in ", ckpt_.dir().string(),
          " is F8_E4M3 but config.json has no quantization_config saying how it is scaled"));
    }
    if (ckpt_.config().arch != Arch::kLlama) {
      return absl::UnimplementedError(absl::StrCat(
          "tensor '", w.name, "' in ", ckpt_.dir().string(),
          ": FP8 checkpoints of the Llama architecture only are supported"));
    }
    const int64_t out = shape[0], in = shape[1];
    std::vector<int64_t> scale_shape;
    switch (q.scales) {
      case WeightQuantization::Scales::kTensor: break;
      case WeightQuantization::Scales::kChannel: scale_shape = {out, 1}; break;
      case WeightQuantization::Scales::kBlock:
        scale_shape = {(out + q.block_rows - 1) / q.block_rows,
                       (in + q.block_cols - 1) / q.block_cols};
        break;
    }
    ASSIGN_OR_RETURN(TensorView scale, ReadScale(module + "." + std::string(q.scale_suffix()),
                                                 scale_shape, QuantizationName(q)));
    src.scales.push_back(std::move(scale));
    src.quantization = q;
    if (q.static_input_scales) {
      ASSIGN_OR_RETURN(TensorView in_scale, ReadScale(module + ".input_scale", {}, "static"));
      float v = 0.0f;
      ToFloat(in_scale.dtype, in_scale.data.data(), 1, &v);
      if (!(v > 0.0f)) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", in_scale.name, "' in ",
                                                       ckpt_.dir().string(), " is ", v,
                                                       " (an activation scale must be > 0)"));
      }
      src.input_scale = v;
    }
    return src;
  }

  // Every tensor read so far, as the checkpoint spells it.
  const std::set<std::string>& read() const { return read_; }

  // A Conv1D weight stored (in, out), to be held as (out, in).
  absl::StatusOr<TensorSource> ReadTransposed(const std::string& name, int64_t in, int64_t out) {
    ASSIGN_OR_RETURN(TensorSource src, Read(name, {in, out}));
    src.transposed = true;
    return src;
  }

 private:
  // A scale tensor of `shape` (an empty shape: one value, stored as [] or [1]), F32, F16 or
  // BF16, every value finite and >= 0.
  absl::StatusOr<TensorView> ReadScale(const std::string& name, std::vector<int64_t> shape,
                                       const std::string& scheme) {
    ASSIGN_OR_RETURN(std::string found, Resolve(name));
    read_.insert(found);
    ASSIGN_OR_RETURN(TensorView view, ckpt_.tensor(found));
    const bool scalar =
        shape.empty() && (view.shape.empty() || view.shape == std::vector<int64_t>{1});
    if (!scalar && view.shape != shape) {
      if (shape.empty()) shape = {1};
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", found, "' in ", ckpt_.dir().string(), ": expected shape [",
          absl::StrJoin(shape, ", "), "] for ", scheme, " scales, found [",
          absl::StrJoin(view.shape, ", "), "]"));
    }
    if (view.dtype == DType::kF8E4M3) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", found, "' in ",
                                                     ckpt_.dir().string(),
                                                     ": scales must be F32, F16 or BF16"));
    }
    std::vector<float> values(static_cast<size_t>(view.numel()));
    ToFloat(view.dtype, view.data.data(), values.size(), values.data());
    for (size_t i = 0; i < values.size(); ++i) {
      if (!std::isfinite(values[i]) || values[i] < 0.0f) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", found, "' in ", ckpt_.dir().string(), ": scale ", values[i],
            " at element ", i, " (scales must be finite and >= 0)"));
      }
    }
    return view;
  }

  absl::StatusOr<std::string> Resolve(const std::string& name) const {
    const std::string prefixed = prefix_ + name;
    if (ckpt_.contains(prefixed)) return prefixed;
    if (ckpt_.contains(name)) return name;
    return absl::NotFoundError(absl::StrCat("checkpoint ", ckpt_.dir().string(), " has no tensor '",
                                            prefixed, "' (nor '", name, "')"));
  }

  Checkpoint& ckpt_;
  std::string prefix_;
  std::set<std::string> read_;
};

using LayerSources = LayerWeightsOf<TensorSource>;

absl::StatusOr<LayerSources> LoadGpt2Layer(TensorReader& r, const ModelConfig& c, int i) {
  const int64_t h = c.hidden_size, inter = c.intermediate_size;
  const std::string p = absl::StrCat("h.", i, ".");
  LayerSources l;
  ASSIGN_OR_RETURN(l.attn_norm_w, r.Read(p + "ln_1.weight", {h}));
  ASSIGN_OR_RETURN(l.attn_norm_b, r.Read(p + "ln_1.bias", {h}));
  // c_attn is (h, 3h) with q, k, v column blocks: transposed, they become q, k, v row blocks.
  ASSIGN_OR_RETURN(l.wqkv, r.ReadTransposed(p + "attn.c_attn.weight", h, 3 * h));
  ASSIGN_OR_RETURN(l.bqkv, r.Read(p + "attn.c_attn.bias", {3 * h}));
  ASSIGN_OR_RETURN(l.wo, r.ReadTransposed(p + "attn.c_proj.weight", h, h));
  ASSIGN_OR_RETURN(l.bo, r.Read(p + "attn.c_proj.bias", {h}));
  ASSIGN_OR_RETURN(l.mlp_norm_w, r.Read(p + "ln_2.weight", {h}));
  ASSIGN_OR_RETURN(l.mlp_norm_b, r.Read(p + "ln_2.bias", {h}));
  ASSIGN_OR_RETURN(l.w_in, r.ReadTransposed(p + "mlp.c_fc.weight", h, inter));
  ASSIGN_OR_RETURN(l.b_in, r.Read(p + "mlp.c_fc.bias", {inter}));
  ASSIGN_OR_RETURN(l.w_out, r.ReadTransposed(p + "mlp.c_proj.weight", inter, h));
  ASSIGN_OR_RETURN(l.b_out, r.Read(p + "mlp.c_proj.bias", {h}));
  return l;
}

// Appends `rows` to `dst`: stacking row-major (out, in) matrices that share `in`. Stacked parts
// are all FP8 or none.
absl::Status AppendRows(TensorSource& dst, const TensorSource& rows) {
  if (!dst.empty() && dst.fp8() != rows.fp8()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", rows.parts[0].name, "' is ", rows.fp8() ? "" : "not ", "FP8 but '",
        dst.parts[0].name, "', which the engine stacks with it, is ", dst.fp8() ? "" : "not"));
  }
  dst.parts.insert(dst.parts.end(), rows.parts.begin(), rows.parts.end());
  dst.scales.insert(dst.scales.end(), rows.scales.begin(), rows.scales.end());
  dst.quantization = rows.quantization;
  dst.input_scale = std::max(dst.input_scale, rows.input_scale);
  return absl::OkStatus();
}

absl::StatusOr<LayerSources> LoadLlamaLayer(TensorReader& r, const ModelConfig& c, int i) {
  const int64_t h = c.hidden_size, inter = c.intermediate_size;
  const int64_t q_dim = c.q_dim(), kv_dim = c.kv_dim();
  const std::string p = absl::StrCat("layers.", i, ".");
  LayerSources l;
  ASSIGN_OR_RETURN(l.attn_norm_w, r.Read(p + "input_layernorm.weight", {h}));
  ASSIGN_OR_RETURN(TensorSource wq, r.ReadLinear(p + "self_attn.q_proj", {q_dim, h}));
  ASSIGN_OR_RETURN(TensorSource wk, r.ReadLinear(p + "self_attn.k_proj", {kv_dim, h}));
  ASSIGN_OR_RETURN(TensorSource wv, r.ReadLinear(p + "self_attn.v_proj", {kv_dim, h}));
  RETURN_IF_ERROR(AppendRows(l.wqkv, wq));
  RETURN_IF_ERROR(AppendRows(l.wqkv, wk));
  RETURN_IF_ERROR(AppendRows(l.wqkv, wv));
  if (c.qkv_bias) {
    for (auto [name, n] : {std::pair{"q_proj", q_dim}, {"k_proj", kv_dim}, {"v_proj", kv_dim}}) {
      ASSIGN_OR_RETURN(TensorSource b, r.Read(p + "self_attn." + name + ".bias", {n}));
      RETURN_IF_ERROR(AppendRows(l.bqkv, b));
    }
  }
  if (c.qk_norm) {
    ASSIGN_OR_RETURN(l.q_norm_w, r.Read(p + "self_attn.q_norm.weight", {c.head_dim}));
    ASSIGN_OR_RETURN(l.k_norm_w, r.Read(p + "self_attn.k_norm.weight", {c.head_dim}));
  }
  ASSIGN_OR_RETURN(l.wo, r.ReadLinear(p + "self_attn.o_proj", {h, q_dim}));
  if (c.o_bias) {
    ASSIGN_OR_RETURN(l.bo, r.Read(p + "self_attn.o_proj.bias", {h}));
  }
  ASSIGN_OR_RETURN(l.mlp_norm_w, r.Read(p + "post_attention_layernorm.weight", {h}));
  ASSIGN_OR_RETURN(TensorSource gate, r.ReadLinear(p + "mlp.gate_proj", {inter, h}));
  ASSIGN_OR_RETURN(TensorSource up, r.ReadLinear(p + "mlp.up_proj", {inter, h}));
  RETURN_IF_ERROR(AppendRows(l.w_in, gate));
  RETURN_IF_ERROR(AppendRows(l.w_in, up));
  ASSIGN_OR_RETURN(l.w_out, r.ReadLinear(p + "mlp.down_proj", {h, inter}));
  return l;
}

// Refuses a checkpoint holding a tensor that the model as configured never reads (a bias under a
// config that says none, a layer beyond num_layers), which would otherwise be silently ignored:
// every tensor of the stage's layers must have been read, and every tensor outside the layers
// must be one of the model's own. Buffers that transformers recomputes are allowed, and the
// layers' KV-cache scales (read apart, by LoadKvScales).
absl::Status CheckNoUnusedTensors(const Checkpoint& ckpt, const std::set<std::string>& read,
                                  int first_layer, int last_layer) {
  const bool gpt2 = ckpt.config().arch == Arch::kGpt2;
  const absl::string_view prefix = gpt2 ? "transformer." : "model.";
  const absl::string_view layers = gpt2 ? "h." : "layers.";
  const std::set<absl::string_view> globals =
      gpt2 ? std::set<absl::string_view>{"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias",
                                        "lm_head.weight"}
           : std::set<absl::string_view>{"embed_tokens.weight", "norm.weight", "lm_head.weight"};
  for (const std::string& name : ckpt.names()) {
    if (read.count(name) > 0) continue;
    absl::string_view n = name;
    absl::ConsumePrefix(&n, prefix);
    const bool buffer =
        gpt2 ? absl::EndsWith(n, ".attn.bias") || absl::EndsWith(n, ".attn.masked_bias")
             : absl::EndsWith(n, ".rotary_emb.inv_freq");
    if (buffer) continue;
    if (absl::ConsumePrefix(&n, layers)) {
      int layer = -1;
      const size_t dot = n.find('.');
      if (dot != absl::string_view::npos && absl::SimpleAtoi(n.substr(0, dot), &layer) &&
          layer >= 0 && layer < ckpt.config().num_layers) {
        if (layer < first_layer || layer >= last_layer) continue;  // another stage's
        // The FP8 KV-cache's scales, which LoadKvScales reads (worker/kv_scales.h).
        const std::string prefixed = absl::StrCat(prefix, layers, n);
        if (prefixed == KvScaleTensorName(ckpt.config().arch, layer, false) ||
            prefixed == KvScaleTensorName(ckpt.config().arch, layer, true)) {
          continue;
        }
      }
    } else if (globals.count(n) > 0) {
      continue;
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint ", ckpt.dir().string(), " has tensor '", name,
        "' that the model as config.json describes does not use (model_type ",
        ckpt.config().model_type,
        "; a bias needs attention_bias or the model type that has it, q_norm/k_norm need qwen3)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StageSources> FindStageWeights(Checkpoint& ckpt, int first_layer, int last_layer) {
  const ModelConfig& c = ckpt.config();
  if (first_layer < 0 || last_layer > c.num_layers || first_layer >= last_layer) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer range [", first_layer, ", ", last_layer, ") of ", ckpt.dir().string(),
                     " is not a non-empty range within the model's ", c.num_layers,
                     " layers (need 0 <= first < last <= ", c.num_layers, ")"));
  }
  const bool gpt2 = c.arch == Arch::kGpt2;
  TensorReader r(ckpt, gpt2 ? "transformer." : "model.");
  const int64_t h = c.hidden_size, vocab = c.vocab_size;
  const std::string tok_name = gpt2 ? "wte.weight" : "embed_tokens.weight";

  StageSources w;
  w.first_layer = first_layer;
  w.last_layer = last_layer;
  w.has_embedding = first_layer == 0;
  w.has_head = last_layer == c.num_layers;

  if (w.has_embedding) {
    ASSIGN_OR_RETURN(w.tok_embedding, r.Read(tok_name, {vocab, h}));
    if (gpt2) {
      ASSIGN_OR_RETURN(w.pos_embedding, r.Read("wpe.weight", {c.max_positions, h}));
    }
  }
  w.layers.reserve(last_layer - first_layer);
  for (int i = first_layer; i < last_layer; ++i) {
    ASSIGN_OR_RETURN(LayerSources l, gpt2 ? LoadGpt2Layer(r, c, i) : LoadLlamaLayer(r, c, i));
    w.layers.push_back(std::move(l));
  }
  if (w.has_head) {
    ASSIGN_OR_RETURN(w.final_norm_w, r.Read(gpt2 ? "ln_f.weight" : "norm.weight", {h}));
    if (gpt2) {
      ASSIGN_OR_RETURN(w.final_norm_b, r.Read("ln_f.bias", {h}));
    }
    // Tied: the head is the token embedding, whatever lm_head.weight holds (as in transformers).
    if (c.tie_word_embeddings) {
      if (w.has_embedding) {
        w.lm_head = w.tok_embedding;
      } else {
        ASSIGN_OR_RETURN(w.lm_head, r.Read(tok_name, {vocab, h}));
      }
    } else {
      // lm_head sits outside "model."/"transformer."; TensorReader also tries it unprefixed.
      ASSIGN_OR_RETURN(w.lm_head, r.Read("lm_head.weight", {vocab, h}));
    }
  }
  RETURN_IF_ERROR(CheckNoUnusedTensors(ckpt, r.read(), first_layer, last_layer));
  return w;
}

int64_t TensorSource::numel() const {
  int64_t n = 0;
  for (const TensorView& part : parts) n += part.numel();
  return n;
}

void SourceToFloat(const TensorSource& src, float* dst) {
  for (const TensorView& part : src.parts) {
    const size_t n = static_cast<size_t>(part.numel());
    if (src.transposed) {
      // Stored (in, out), held (out, in).
      const int64_t in = part.shape[0], out = part.shape[1];
      std::vector<float> stored(n);
      ToFloat(part.dtype, part.data.data(), n, stored.data());
      for (int64_t i = 0; i < in; ++i) {
        for (int64_t o = 0; o < out; ++o) dst[o * in + i] = stored[i * out + o];
      }
    } else {
      ToFloat(part.dtype, part.data.data(), n, dst);
    }
    dst += n;
  }
  ApplyFp8Scales(src, dst - src.numel());
}

namespace {

// Runs fn(0) ... fn(n - 1) on up to 16 threads, each taking the next index as it finishes one.
template <typename Fn>
void ParallelFor(size_t n, const Fn& fn) {
  const size_t threads =
      std::min<size_t>({n, 16, std::max(1u, std::thread::hardware_concurrency())});
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < n; i = next++) fn(i);
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& th : pool) th.join();
}

// Multiplies rows [first_row, first_row + rows) of the FP8 part `p` of `src`, held at `dst` in the
// engine's layout, by their scales.
void ScalePartRows(const TensorSource& src, size_t p, int64_t first_row, int64_t rows, float* dst) {
  const int64_t cols = src.parts[p].shape[1];
  std::vector<float> scale(static_cast<size_t>(src.scales[p].numel()));
  ToFloat(src.scales[p].dtype, src.scales[p].data.data(), scale.size(), scale.data());
  const WeightQuantization& q = src.quantization;
  for (int64_t r = first_row; r < first_row + rows; ++r) {
    float* row = dst + (r - first_row) * cols;
    for (int64_t c = 0; c < cols; ++c) {
      size_t at = 0;
      if (q.scales == WeightQuantization::Scales::kChannel) {
        at = static_cast<size_t>(r);
      } else if (q.scales == WeightQuantization::Scales::kBlock) {
        const int64_t blocks_per_row = (cols + q.block_cols - 1) / q.block_cols;
        at = static_cast<size_t>(r / q.block_rows * blocks_per_row + c / q.block_cols);
      }
      row[c] *= scale[at];
    }
  }
}

}  // namespace

void ApplyFp8Scales(const TensorSource& src, float* dst) {
  if (!src.fp8()) return;
  for (size_t p = 0; p < src.parts.size(); ++p) {
    ScalePartRows(src, p, 0, src.parts[p].shape[0], dst);
    dst += src.parts[p].numel();
  }
}

void SourceRowsToFloat(const TensorSource& src, int64_t first_row, int64_t rows, float* dst) {
  int64_t part_row = 0;  // the engine's row where the part begins
  for (size_t p = 0; p < src.parts.size(); ++p) {
    const TensorView& part = src.parts[p];
    // The part is (out, in) in the engine's layout; a transposed one is stored (in, out).
    int64_t out = part.shape[0], in = part.shape.size() > 1 ? part.shape[1] : 1;
    if (src.transposed) std::swap(out, in);
    // The part's rows [lo, hi) are wanted.
    const int64_t lo = std::max(first_row, part_row) - part_row;
    const int64_t hi = std::min(first_row + rows, part_row + out) - part_row;
    part_row += out;
    if (lo >= hi) continue;
    const size_t elem = DTypeSize(part.dtype);
    if (src.transposed) {
      // Stored row i holds element i of every engine row: its columns [lo, hi).
      std::vector<float> stored(static_cast<size_t>(hi - lo));
      for (int64_t i = 0; i < in; ++i) {
        ToFloat(part.dtype, part.data.data() + static_cast<size_t>(i * out + lo) * elem,
                stored.size(), stored.data());
        for (int64_t o = lo; o < hi; ++o) dst[(o - lo) * in + i] = stored[o - lo];
      }
    } else {
      ToFloat(part.dtype, part.data.data() + static_cast<size_t>(lo * in) * elem,
              static_cast<size_t>((hi - lo) * in), dst);
    }
    if (src.fp8()) ScalePartRows(src, p, lo, hi - lo, dst);
    dst += (hi - lo) * in;
  }
}

absl::StatusOr<StageWeights> LoadStageWeights(Checkpoint& ckpt, int first_layer, int last_layer) {
  ASSIGN_OR_RETURN(StageSources sources, FindStageWeights(ckpt, first_layer, last_layer));
  return ReadStageWeights(sources);
}

StageWeights ReadStageWeights(const StageSources& sources, int64_t piece_elements) {
  // Conversion is memory-bound at a few GB/s per core; a 3B model is ~13 GB of fp32, so both the
  // allocation (first touch of every page) and the conversion are spread over the cores, in
  // pieces of at most `piece_elements` (one piece for a transposed tensor).
  std::vector<std::pair<const TensorSource*, std::vector<float>*>> tensors;
  StageWeights w;
  ForEachTensor(sources, w, [&](const TensorSource& src, std::vector<float>& dst) {
    if (!src.empty()) tensors.emplace_back(&src, &dst);
  });
  ParallelFor(tensors.size(), [&](size_t i) {
    tensors[i].second->resize(static_cast<size_t>(tensors[i].first->numel()));
  });
  struct Piece {
    TensorSource src;  // one part, or one element range of it
    float* dst;
  };
  std::vector<Piece> pieces;
  for (const auto& [src, dst] : tensors) {
    float* out = dst->data();
    for (const TensorView& part : src->parts) {
      const int64_t n = part.numel();
      const int64_t step =
          src->transposed ? std::max<int64_t>(n, 1) : std::max<int64_t>(piece_elements, 1);
      const size_t elem = DTypeSize(part.dtype);
      for (int64_t b = 0; b < n; b += step) {
        const int64_t e = std::min(n, b + step);
        TensorView v = part;
        if (!src->transposed) {
          v.shape = {e - b};
          v.data = part.data.subspan(static_cast<size_t>(b) * elem,
                                     static_cast<size_t>(e - b) * elem);
        }
        TensorSource piece;
        piece.parts.push_back(std::move(v));
        piece.transposed = src->transposed;
        pieces.push_back({std::move(piece), out + b});
      }
      out += n;
    }
  }
  ParallelFor(pieces.size(), [&](size_t i) { SourceToFloat(pieces[i].src, pieces[i].dst); });
  // The pieces carry no scales (a piece does not know its rows): FP8 tensors are scaled whole.
  ParallelFor(tensors.size(), [&](size_t i) {
    ApplyFp8Scales(*tensors[i].first, tensors[i].second->data());
  });
  return w;
}

}  // namespace tandem
