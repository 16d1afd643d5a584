// What the CPU stage's tests share: tiny checkpoints of every preset, stages and pipelines over
// them, steps, and a naive forward pass in double straight from the checkpoint's Hugging Face
// tensors, the reference the stage's logits are held to.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tools/model_generator.h"
#include "worker/cpu/cpu_stage.h"

namespace tandem::cpu_test {

// ---------------------------------------------------------------------------------------------
// Checkpoints and pipelines

inline std::filesystem::path ModelsRoot() {
  return std::filesystem::path(TANDEM_TEST_TMPDIR) /
         ("cpu_stage_test_models_" + std::to_string(getpid()));
}

// Writes the preset's random checkpoint (seeded) on first use in this process.
// A preset's checkpoint, or one of two variants: tiny-qwen2-window (the window of 24 on layers 2
// and 3 only, Qwen2's max_window_layers) and tiny-gpt2-scaled (scores not divided by
// sqrt(head_dim) but by the layer index + 1).
inline std::filesystem::path ModelDir(const std::string& name) {
  const std::filesystem::path dir = ModelsRoot() / name;
  if (!std::filesystem::exists(dir / "config.json")) {
    const bool qwen_window = name == "tiny-qwen2-window", gpt2_scaled = name == "tiny-gpt2-scaled";
    auto config = PresetConfig(qwen_window ? "tiny-qwen2" : gpt2_scaled ? "tiny-gpt2" : name);
    EXPECT_TRUE(config.ok()) << config.status();
    if (qwen_window) {
      ModelOverrides o;
      o.sliding_window = 24;
      o.max_window_layers = 2;
      config = ApplyOverrides(*config, o);
      EXPECT_TRUE(config.ok()) << config.status();
    }
    if (gpt2_scaled) {
      config->scale_attn_weights = false;
      config->scale_attn_by_inverse_layer_idx = true;
    }
    GeneratorOptions options;
    options.seed = 20240611;
    absl::Status st = WriteRandomCheckpoint(*config, options, dir);
    EXPECT_TRUE(st.ok()) << st;
  }
  return dir;
}

inline std::unique_ptr<Stage> MakeStage(const std::filesystem::path& dir, int first, int last,
                                        int max_slots = 4, int max_seq_len = 0) {
  StageSpec spec;
  spec.model_dir = dir;
  spec.first_layer = first;
  spec.last_layer = last;
  spec.max_slots = max_slots;
  spec.max_seq_len = max_seq_len;
  auto stage = MakeCpuStage(spec);
  EXPECT_TRUE(stage.ok()) << stage.status();
  return stage.ok() ? std::move(stage).value() : nullptr;
}

using Pipeline = std::vector<std::unique_ptr<Stage>>;

// Stages over consecutive layer ranges split at `cuts` (e.g. {2} -> [0, 2), [2, L)).
inline Pipeline MakePipeline(const std::filesystem::path& dir, const std::vector<int>& cuts,
                             int max_slots = 4) {
  auto config = LoadModelConfig(dir);
  EXPECT_TRUE(config.ok());
  std::vector<int> bounds = {0};
  bounds.insert(bounds.end(), cuts.begin(), cuts.end());
  bounds.push_back(config->num_layers);
  Pipeline p;
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    p.push_back(MakeStage(dir, bounds[i], bounds[i + 1], max_slots));
  }
  return p;
}

// Runs `step` through every stage, handing each stage's hidden states to the next.
inline StepOutput RunPipeline(Pipeline& p, const StepDescriptor& step) {
  Activations in;
  StepOutput out;
  for (auto& stage : p) {
    auto r = stage->Step(step, in);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    out = std::move(r).value();
    in = out.hidden;
  }
  return out;
}

struct Seq {
  Seq(int32_t slot, int32_t position, std::vector<int32_t> tokens)
      : slot(slot), position(position), tokens(std::move(tokens)) {}
  int32_t slot = 0;
  int32_t position = 0;
  std::vector<int32_t> tokens;
  bool sample = true;
  SamplingParams sampling;
  uint64_t sample_index = 0;
};

inline StepDescriptor MakeStep(const std::vector<Seq>& seqs, bool return_logits = true) {
  static uint64_t next_id = 1;
  StepDescriptor step;
  step.id = next_id++;
  step.return_logits = return_logits;
  for (const Seq& s : seqs) {
    SequenceStep ss;
    ss.slot = s.slot;
    ss.position = s.position;
    ss.num_tokens = static_cast<int32_t>(s.tokens.size());
    ss.sample = s.sample;
    ss.sampling = s.sampling;
    ss.sample_index = s.sample_index;
    step.seqs.push_back(ss);
    step.tokens.insert(step.tokens.end(), s.tokens.begin(), s.tokens.end());
  }
  return step;
}

inline std::vector<int32_t> Prompt(int length, int salt, int vocab) {
  std::vector<int32_t> t;
  for (int i = 0; i < length; ++i) t.push_back((37 * i + 101 * salt + 7) % vocab);
  return t;
}

// Row `row` of a [rows, vocab] logits block.
inline std::vector<float> Row(const std::vector<float>& logits, int row, int vocab) {
  return {logits.begin() + static_cast<size_t>(row) * vocab,
          logits.begin() + static_cast<size_t>(row + 1) * vocab};
}

// max |a - b| / max |b|.
inline double RelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return scale > 0.0 ? diff / scale : diff;
}

// ---------------------------------------------------------------------------------------------
// A naive forward pass, in double, straight from the checkpoint's Hugging Face tensors: no cache,
// no BLAS, every position recomputed, weights in their stored layouts.

using Vec = std::vector<double>;

class NaiveModel {
 public:
  // What a KV-cache does to the K and V of one position of layer `layer` (after the rotation)
  // before attention reads them: nothing by default; an FP8 cache rounds them through its codes.
  using KvRounding = std::function<void(int layer, Vec& k, Vec& v)>;

  explicit NaiveModel(const std::filesystem::path& dir, KvRounding round_kv = {})
      : round_kv_(std::move(round_kv)) {
    auto ckpt = Checkpoint::Open(dir);
    EXPECT_TRUE(ckpt.ok()) << ckpt.status();
    ckpt_ = std::move(ckpt).value();
    c_ = ckpt_->config();
  }

  // Logits after every token of `tokens`: [tokens.size()][vocab].
  std::vector<Vec> Logits(const std::vector<int32_t>& tokens) {
    const bool gpt2 = c_.arch == Arch::kGpt2;
    const int n = static_cast<int>(tokens.size()), hid = c_.hidden_size;
    const Vec emb = T(gpt2 ? "wte.weight" : "embed_tokens.weight");
    std::vector<Vec> x(n, Vec(hid));
    for (int t = 0; t < n; ++t) {
      for (int i = 0; i < hid; ++i) x[t][i] = emb[tokens[t] * hid + i];
      if (gpt2) {
        const Vec wpe = T("wpe.weight");
        for (int i = 0; i < hid; ++i) x[t][i] += wpe[t * hid + i];
      }
    }
    for (int l = 0; l < c_.num_layers; ++l) gpt2 ? Gpt2Layer(l, x) : LlamaLayer(l, x);
    std::vector<Vec> logits;
    const Vec head = (c_.tie_word_embeddings) ? emb : T("lm_head.weight");
    for (int t = 0; t < n; ++t) {
      const Vec h = gpt2 ? LayerNorm(x[t], T("ln_f.weight"), T("ln_f.bias"))
                         : RmsNorm(x[t], T("norm.weight"));
      logits.push_back(MulOutIn(h, head, c_.vocab_size));
    }
    return logits;
  }

 private:
  // A tensor by its unprefixed name, as transformers or the original GPT-2 release spell it.
  Vec T(const std::string& name) {
    const std::string prefixed = (c_.arch == Arch::kGpt2 ? "transformer." : "model.") + name;
    auto view = ckpt_->tensor(ckpt_->contains(prefixed) ? prefixed : name);
    EXPECT_TRUE(view.ok()) << view.status();
    std::vector<float> f(view->numel());
    ToFloat(view->dtype, view->data.data(), f.size(), f.data());
    return Vec(f.begin(), f.end());
  }

  // x · W with W stored (in, out) (Conv1D).
  static Vec MulInOut(const Vec& x, const Vec& w, int out) {
    Vec y(out, 0.0);
    for (size_t i = 0; i < x.size(); ++i) {
      for (int o = 0; o < out; ++o) y[o] += x[i] * w[i * out + o];
    }
    return y;
  }
  // x · Wᵀ with W stored (out, in) (Linear).
  static Vec MulOutIn(const Vec& x, const Vec& w, int out) {
    Vec y(out, 0.0);
    for (int o = 0; o < out; ++o) {
      for (size_t i = 0; i < x.size(); ++i) y[o] += x[i] * w[o * x.size() + i];
    }
    return y;
  }
  static Vec Add(Vec a, const Vec& b) {
    for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
    return a;
  }
  Vec LayerNorm(const Vec& x, const Vec& w, const Vec& b) const {
    double mean = 0.0, var = 0.0;
    for (double v : x) mean += v / x.size();
    for (double v : x) var += (v - mean) * (v - mean) / x.size();
    Vec y(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      y[i] = (x[i] - mean) / std::sqrt(var + c_.norm_eps) * w[i] + b[i];
    }
    return y;
  }
  Vec RmsNorm(const Vec& x, const Vec& w) const {
    double ms = 0.0;
    for (double v : x) ms += v * v / x.size();
    Vec y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] / std::sqrt(ms + c_.norm_eps) * w[i];
    return y;
  }

  // Causal softmax attention of layer l for every position; q[t] has num_heads heads, k/v
  // num_kv_heads. The config's knobs written out from transformers' definitions: GPT-2 divides
  // the scores by sqrt(head_dim) when scale_attn_weights and by l + 1 when
  // scale_attn_by_inverse_layer_idx; a sliding window W lets query t see key j iff t - W < j.
  std::vector<Vec> Attention(int l, const std::vector<Vec>& q, const std::vector<Vec>& k,
                             const std::vector<Vec>& v) const {
    const int n = static_cast<int>(q.size()), d = c_.head_dim;
    const int rep = c_.num_heads / c_.num_kv_heads;
    double divisor = c_.scale_attn_weights ? std::sqrt(static_cast<double>(d)) : 1.0;
    if (c_.scale_attn_by_inverse_layer_idx) divisor *= l + 1;
    int window = 0;
    if (c_.model_type == "mistral") window = c_.sliding_window;
    if (c_.model_type == "qwen2" && !c_.windowed_layers.empty() && c_.windowed_layers[l]) {
      window = c_.sliding_window;
    }
    std::vector<Vec> out(n, Vec(c_.q_dim(), 0.0));
    for (int t = 0; t < n; ++t) {
      for (int h = 0; h < c_.num_heads; ++h) {
        const int kh = h / rep;
        Vec s(t + 1, 0.0);
        const int first = window > 0 ? std::max(0, t - window + 1) : 0;
        double max = -1e300;
        for (int j = first; j <= t; ++j) {
          double dot = 0.0;
          for (int i = 0; i < d; ++i) dot += q[t][h * d + i] * k[j][kh * d + i];
          s[j] = dot / divisor;
          max = std::max(max, s[j]);
        }
        double sum = 0.0;
        for (int j = first; j <= t; ++j) sum += (s[j] = std::exp(s[j] - max));
        for (int j = first; j <= t; ++j) {
          for (int i = 0; i < d; ++i) out[t][h * d + i] += s[j] / sum * v[j][kh * d + i];
        }
      }
    }
    return out;
  }

  void Gpt2Layer(int l, std::vector<Vec>& x) {
    const std::string p = "h." + std::to_string(l) + ".";
    const int hid = c_.hidden_size;
    std::vector<Vec> q, k, v;
    for (const Vec& xt : x) {
      const Vec qkv = Add(MulInOut(LayerNorm(xt, T(p + "ln_1.weight"), T(p + "ln_1.bias")),
                                   T(p + "attn.c_attn.weight"), 3 * hid),
                          T(p + "attn.c_attn.bias"));
      q.emplace_back(qkv.begin(), qkv.begin() + hid);
      k.emplace_back(qkv.begin() + hid, qkv.begin() + 2 * hid);
      v.emplace_back(qkv.begin() + 2 * hid, qkv.end());
    }
    RoundKv(l, k, v);
    const std::vector<Vec> a = Attention(l, q, k, v);
    for (size_t t = 0; t < x.size(); ++t) {
      x[t] = Add(x[t],
                 Add(MulInOut(a[t], T(p + "attn.c_proj.weight"), hid), T(p + "attn.c_proj.bias")));
      Vec u = Add(MulInOut(LayerNorm(x[t], T(p + "ln_2.weight"), T(p + "ln_2.bias")),
                           T(p + "mlp.c_fc.weight"), c_.intermediate_size),
                  T(p + "mlp.c_fc.bias"));
      for (double& e : u) {
        e = 0.5 * e * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (e + 0.044715 * e * e * e)));
      }
      x[t] = Add(x[t], Add(MulInOut(u, T(p + "mlp.c_proj.weight"), hid), T(p + "mlp.c_proj.bias")));
    }
  }

  // Frequency f of the rotation in double: theta^(-2f/d), and with Llama 3.1's scaling as Meta's
  // apply_scaling writes it (wavelength 2 pi / freq below original / high_freq_factor: kept;
  // above original / low_freq_factor: divided by factor; between: (1 - s) freq / factor +
  // s freq with s = (original / wavelength - low) / (high - low)); linear: divided by factor.
  double Frequency(int f) const {
    const double freq = std::pow(static_cast<double>(c_.rope_theta), -2.0 * f / c_.head_dim);
    const RopeScaling& rs = c_.rope_scaling;
    if (rs.type == RopeScaling::Type::kLinear) return freq / rs.factor;
    if (rs.type != RopeScaling::Type::kLlama3) return freq;
    const double wavelen = 2 * M_PI / freq, old = rs.original_max_positions;
    if (wavelen < old / rs.high_freq_factor) return freq;
    if (wavelen > old / rs.low_freq_factor) return freq / rs.factor;
    const double smooth =
        (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
    return (1 - smooth) * freq / rs.factor + smooth * freq;
  }

  // Rotary embedding as transformers writes it: x·cos + rotate_half(x)·sin, per head, with
  // rotate_half(x) = [-x2, x1] and the frequencies repeated over both halves.
  Vec Rope(const Vec& x, int heads, int pos) const {
    const int d = c_.head_dim, half = d / 2;
    Vec y(x.size());
    for (int h = 0; h < heads; ++h) {
      const double* xh = x.data() + h * d;
      for (int i = 0; i < d; ++i) {
        const int f = i % half;
        const double angle = pos * Frequency(f);
        const double rotated = i < half ? -xh[i + half] : xh[i - half];
        y[h * d + i] = xh[i] * std::cos(angle) + rotated * std::sin(angle);
      }
    }
    return y;
  }

  // Qwen3's q_norm / k_norm: RMSNorm of each head_dim-wide head of x with the same weights.
  Vec HeadNorm(const Vec& x, const Vec& w) const {
    Vec y;
    for (size_t h = 0; h < x.size(); h += c_.head_dim) {
      const Vec head = RmsNorm(Vec(x.begin() + h, x.begin() + h + c_.head_dim), w);
      y.insert(y.end(), head.begin(), head.end());
    }
    return y;
  }

  void LlamaLayer(int l, std::vector<Vec>& x) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const int hid = c_.hidden_size, inter = c_.intermediate_size;
    std::vector<Vec> q, k, v;
    // Biases where the checkpoint has them (Qwen2: q, k, v; Llama attention_bias: all four).
    auto proj = [&](const std::string& name, const Vec& in, int out) {
      Vec y = MulOutIn(in, T(p + "self_attn." + name + ".weight"), out);
      const std::string bias = "model." + p + "self_attn." + name + ".bias";
      return ckpt_->contains(bias) ? Add(y, T(p + "self_attn." + name + ".bias")) : y;
    };
    // Qwen3 norms each head of q and k between the projection and the rotation.
    auto head_norm = [&](const std::string& name, const Vec& y) {
      return c_.qk_norm ? HeadNorm(y, T(p + "self_attn." + name + ".weight")) : y;
    };
    for (size_t t = 0; t < x.size(); ++t) {
      const Vec h = RmsNorm(x[t], T(p + "input_layernorm.weight"));
      q.push_back(Rope(head_norm("q_norm", proj("q_proj", h, c_.q_dim())), c_.num_heads,
                       static_cast<int>(t)));
      k.push_back(Rope(head_norm("k_norm", proj("k_proj", h, c_.kv_dim())), c_.num_kv_heads,
                       static_cast<int>(t)));
      v.push_back(proj("v_proj", h, c_.kv_dim()));
    }
    RoundKv(l, k, v);
    const std::vector<Vec> a = Attention(l, q, k, v);
    for (size_t t = 0; t < x.size(); ++t) {
      x[t] = Add(x[t], proj("o_proj", a[t], hid));
      const Vec h = RmsNorm(x[t], T(p + "post_attention_layernorm.weight"));
      const Vec gate = MulOutIn(h, T(p + "mlp.gate_proj.weight"), inter);
      Vec up = MulOutIn(h, T(p + "mlp.up_proj.weight"), inter);
      for (int i = 0; i < inter; ++i) up[i] *= gate[i] / (1.0 + std::exp(-gate[i]));
      x[t] = Add(x[t], MulOutIn(up, T(p + "mlp.down_proj.weight"), hid));
    }
  }

  void RoundKv(int l, std::vector<Vec>& k, std::vector<Vec>& v) const {
    if (!round_kv_) return;
    for (size_t t = 0; t < k.size(); ++t) round_kv_(l, k[t], v[t]);
  }

  std::unique_ptr<Checkpoint> ckpt_;
  ModelConfig c_;
  KvRounding round_kv_;
};

// max |a - b| / max |b| against double logits.
inline double RelDiff(const std::vector<float>& a, const Vec& b) {
  return RelDiff(a, std::vector<float>(b.begin(), b.end()));
}

}  // namespace tandem::cpu_test
