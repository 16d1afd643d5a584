// The FP8 KV-cache's scales from a checkpoint (kv_scales.h).
#include "worker/kv_scales.h"

#include <cmath>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "worker/weights.h"

namespace tandem {
namespace {

// The name `name` (prefixed) as the checkpoint spells it: with its "model." / "transformer."
// prefix or without; nullopt where it has neither.
std::optional<std::string> Spelled(const Checkpoint& ckpt, const std::string& name) {
  if (ckpt.contains(name)) return name;
  const std::string bare = name.substr(name.find('.') + 1);
  if (ckpt.contains(bare)) return bare;
  return std::nullopt;
}

// The value of the scale tensor `name`: a finite fp32 (or 16-bit) scalar > 0.
absl::StatusOr<float> ReadKvScale(Checkpoint& ckpt, const std::string& name) {
  ASSIGN_OR_RETURN(TensorView view, ckpt.tensor(name));
  auto bad = [&](auto&&... why) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' in ", ckpt.dir().string(),
                                                   ": ", why...,
                                                   " (a KV-cache scale is one finite number > 0)"));
  };
  if (!(view.shape.empty() || view.shape == std::vector<int64_t>{1})) {
    return bad("shape [", absl::StrJoin(view.shape, ", "), "], expected [] or [1]");
  }
  if (view.dtype != DType::kF32 && view.dtype != DType::kF16 && view.dtype != DType::kBF16) {
    return bad("dtype ", std::string(DTypeName(view.dtype)), ", expected F32, F16 or BF16");
  }
  float value = 0.0f;
  ToFloat(view.dtype, view.data.data(), 1, &value);
  if (!std::isfinite(value) || value <= 0.0f) return bad("value ", value);
  return value;
}

// The squared RMS of the outputs of the rows [row0, row0 + rows) of `w` (rows of `in` values)
// with bias `bias` (empty: none), for inputs whose element i has mean square x2[i].
double OutputMeanSquare(const std::vector<float>& w, int64_t row0, int64_t rows, int64_t in,
                        const std::vector<double>& x2, const std::vector<float>& bias) {
  double sum = 0;
  for (int64_t j = row0; j < row0 + rows; ++j) {
    const float* r = w.data() + j * in;
    double m = 0;
    for (int64_t i = 0; i < in; ++i) m += double(r[i]) * r[i] * x2[i];
    if (!bias.empty()) m += double(bias[j]) * bias[j];
    sum += m;
  }
  return sum / double(rows);
}

std::vector<float> ToFloats(const TensorSource& src) {
  if (src.empty()) return {};
  std::vector<float> v(static_cast<size_t>(src.numel()));
  SourceToFloat(src, v.data());
  return v;
}

// Rows [first_row, first_row + rows) of `src`, of `width` values each, as fp32; empty for an empty
// source.
std::vector<float> RowsToFloats(const TensorSource& src, int64_t first_row, int64_t rows,
                                int64_t width) {
  if (src.empty()) return {};
  std::vector<float> v(static_cast<size_t>(rows * width));
  SourceRowsToFloat(src, first_row, rows, v.data());
  return v;
}

}  // namespace

absl::StatusOr<std::vector<KvScales>> EstimateKvScales(Checkpoint& ckpt, int first_layer,
                                                       int last_layer) {
  const ModelConfig& c = ckpt.config();
  ASSIGN_OR_RETURN(const StageSources sources, FindStageWeights(ckpt, first_layer, last_layer));
  const int64_t in = c.hidden_size, q_dim = c.q_dim(), kv_dim = c.kv_dim();
  std::vector<KvScales> scales;
  for (const auto& layer : sources.layers) {
    // The normed input's mean squares: the norm's output has unit mean square per element, times
    // the norm's weight (plus its bias, GPT-2's LayerNorm).
    const std::vector<float> g = ToFloats(layer.attn_norm_w), b = ToFloats(layer.attn_norm_b);
    std::vector<double> x2(in);
    for (int64_t i = 0; i < in; ++i) {
      x2[i] = double(g[i]) * g[i] + (b.empty() ? 0.0 : double(b[i]) * b[i]);
    }
    // Only the K and V rows of the fused QKV weight and bias, [q_dim, q_dim + 2 * kv_dim): K's
    // rows then V's.
    const std::vector<float> w = RowsToFloats(layer.wqkv, q_dim, 2 * kv_dim, in);
    const std::vector<float> bias = RowsToFloats(layer.bqkv, q_dim, 2 * kv_dim, 1);
    double k2 = OutputMeanSquare(w, 0, kv_dim, in, x2, bias);
    const double v2 = OutputMeanSquare(w, kv_dim, kv_dim, in, x2, bias);
    if (!layer.k_norm_w.empty()) {
      // Qwen3: each head of k is RMS-normed before the rotation: its weight's mean square.
      const std::vector<float> kn = ToFloats(layer.k_norm_w);
      k2 = 0;
      for (float x : kn) k2 += double(x) * x;
      k2 /= double(kn.size());
    }
    auto scale = [](double mean_square) {
      const double s = std::sqrt(mean_square) / kKvRmsInCodes;
      return s > 0 && std::isfinite(s) ? static_cast<float>(s) : 1.0f;
    };
    scales.push_back({scale(k2), scale(v2)});
  }
  return scales;
}

absl::StatusOr<std::vector<KvScales>> LoadKvScales(Checkpoint& ckpt, int first_layer,
                                                   int last_layer) {
  const ModelConfig& c = ckpt.config();
  if (first_layer < 0 || last_layer > c.num_layers || first_layer >= last_layer) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV-cache scales of layers [", first_layer, ", ", last_layer, ") of ", ckpt.dir().string(),
        ": not a non-empty range within the model's ", c.num_layers, " layers"));
  }
  // Every layer of the model, so that all the stages of a pipeline agree on whether there are
  // scales: all of them or none.
  std::optional<std::string> present, missing;
  for (int i = 0; i < c.num_layers && !(present && missing); ++i) {
    for (bool v : {false, true}) {
      const std::string name = KvScaleTensorName(c.arch, i, v);
      std::optional<std::string>& seen = Spelled(ckpt, name) ? present : missing;
      if (!seen) seen = name;
    }
  }
  if (!present) return EstimateKvScales(ckpt, first_layer, last_layer);
  std::vector<KvScales> scales(last_layer - first_layer);
  if (missing) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint ", ckpt.dir().string(), " has the KV-cache scale '", *present, "' but not '",
        *missing, "': a checkpoint with KV-cache scales has k_scale and v_scale for every layer"));
  }
  for (int i = first_layer; i < last_layer; ++i) {
    KvScales& s = scales[i - first_layer];
    ASSIGN_OR_RETURN(s.k, ReadKvScale(ckpt, *Spelled(ckpt, KvScaleTensorName(c.arch, i, false))));
    ASSIGN_OR_RETURN(s.v, ReadKvScale(ckpt, *Spelled(ckpt, KvScaleTensorName(c.arch, i, true))));
  }
  return scales;
}

}  // namespace tandem
