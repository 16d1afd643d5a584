// The fp32 reference forward pass for GPT-2 and Llama over one stage's layer range.
//
// A step's rows are every sequence's tokens concatenated (prefill chunks and decode tokens mixed);
// every projection is one cblas_sgemm over all rows. Attention runs per sequence and head over
// that sequence's KV-cache (worker/cpu/cpu_kv_cache.h): its slot's contiguous rows, or the pages
// of its block table gathered into contiguous rows, so that both layouts compute the same. An FP8
// KV-cache (StageSpec::kv_cache_fp8, paged only) holds E4M3 codes over each layer's scales
// (worker/kv_scales.h): K and V are rounded through them as they are written, and attention reads
// the codes times the scales; everything else stays fp32.
// Architectures differ only in data: which norm, bias or not, learned positions or RoPE (and its
// frequencies), a per-head norm of q and k or not (Qwen3), which MLP activation, the attention's
// scale and sliding window.
//
// A slot's cache is valid up to the last position written; a step may start a sequence at any
// position up to that (0 starts a new sequence in the slot), never past it. Steps are validated
// whole before anything is computed, so a rejected step changes nothing. Step is not reentrant:
// one thread (the worker's step loop) drives a stage.
#include "worker/cpu/cpu_stage.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/rope.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "worker/constrained_sampling.h"
#include "worker/context_fit.h"
#include "worker/cpu/cpu_all_reduce.h"
#include "worker/cpu/cpu_kv_cache.h"
#include "worker/fp8_weights.h"
#include "worker/kv_out.h"
#include "worker/kv_scales.h"
#include "worker/sampling.h"
#include "worker/step_check.h"
#include "worker/tensor_parallel.h"
#include "worker/weights.h"

namespace tandem {
namespace {

// Rows per GEMM call. OpenBLAS's result for a row depends on how many rows the call has (one to
// three rows take another kernel than four and more) and, above eight, on the row's place among
// them; in calls of exactly eight rows every row's result is the same wherever it sits. So a
// sequence's logits depend neither on what else is in its step nor on how its prompt was cut
// into chunks (batch invariance): the last rows of a product go through a zero-padded call.
constexpr int kGemmRows = 8;

// c (rows, n) = alpha · a (rows, k) · op(b) + beta · c, row-major with leading dimensions, in
// calls of kGemmRows rows; op(b) is b (k, n) or, with `trans_b`, bᵀ for b (n, k).
void RowBlockedGemm(bool trans_b, int rows, int n, int k, float alpha, const float* a, int lda,
                    const float* b, int ldb, float beta, float* c, int ldc) {
  const CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
  const int whole = rows - rows % kGemmRows;
  for (int r = 0; r < whole; r += kGemmRows) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, tb, kGemmRows, n, k, alpha,
                a + static_cast<size_t>(r) * lda, lda, b, ldb, beta,
                c + static_cast<size_t>(r) * ldc, ldc);
  }
  const int tail = rows - whole;
  if (tail == 0) return;
  thread_local std::vector<float> at, ct;
  at.assign(static_cast<size_t>(kGemmRows) * k, 0.0f);
  ct.assign(static_cast<size_t>(kGemmRows) * n, 0.0f);
  for (int r = 0; r < tail; ++r) {
    std::copy_n(a + static_cast<size_t>(whole + r) * lda, k, at.data() + static_cast<size_t>(r) * k);
    if (beta != 0.0f) {
      std::copy_n(c + static_cast<size_t>(whole + r) * ldc, n, ct.data() + static_cast<size_t>(r) * n);
    }
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, tb, kGemmRows, n, k, alpha, at.data(), k, b, ldb, beta,
              ct.data(), n);
  for (int r = 0; r < tail; ++r) {
    std::copy_n(ct.data() + static_cast<size_t>(r) * n, n, c + static_cast<size_t>(whole + r) * ldc);
  }
}

// y (rows, out) = x (rows, in) · wᵀ + b, with w row-major (out, in) and b (out) or empty.
// accumulate: y += instead (the residual add folded into the GEMM).
void Linear(const float* x, int rows, int in, const std::vector<float>& w,
            const std::vector<float>& b, int out, float* y, bool accumulate = false) {
  RowBlockedGemm(/*trans_b=*/true, rows, out, in, 1.0f, x, in, w.data(), in,
                 accumulate ? 1.0f : 0.0f, y, out);
  if (b.empty()) return;
  for (int r = 0; r < rows; ++r) {
    float* yr = y + static_cast<size_t>(r) * out;
    for (int o = 0; o < out; ++o) yr[o] += b[o];
  }
}

// GPT-2: LayerNorm with bias. Llama: RMSNorm (b empty). x, y: (rows, n); y may be x.
void Norm(Arch arch, const float* x, int rows, int n, const std::vector<float>& w,
          const std::vector<float>& b, float eps, float* y) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<size_t>(r) * n;
    float* yr = y + static_cast<size_t>(r) * n;
    if (arch == Arch::kGpt2) {
      float mean = 0.0f;
      for (int i = 0; i < n; ++i) mean += xr[i];
      mean /= n;
      float var = 0.0f;
      for (int i = 0; i < n; ++i) var += (xr[i] - mean) * (xr[i] - mean);
      var /= n;
      const float inv = 1.0f / std::sqrt(var + eps);
      for (int i = 0; i < n; ++i) yr[i] = (xr[i] - mean) * inv * w[i] + b[i];
    } else {
      float ms = 0.0f;
      for (int i = 0; i < n; ++i) ms += xr[i] * xr[i];
      ms /= n;
      const float inv = 1.0f / std::sqrt(ms + eps);
      for (int i = 0; i < n; ++i) yr[i] = w[i] * (xr[i] * inv);
    }
  }
}

// Rotates each head_dim-wide head of `v` (heads * head_dim) in place for position `pos`, pairing
// element i with i + head_dim / 2 (transformers' rotate_half).
void Rope(float* v, int heads, int head_dim, int pos, const std::vector<float>& inv_freq) {
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    const float angle = static_cast<float>(pos) * inv_freq[i];
    const float c = std::cos(angle), s = std::sin(angle);
    for (int hd = 0; hd < heads; ++hd) {
      float* x = v + static_cast<size_t>(hd) * head_dim;
      const float a = x[i], b = x[i + half];
      x[i] = a * c - b * s;
      x[i + half] = b * c + a * s;
    }
  }
}

// GELU, tanh approximation (GPT-2's "gelu_new").
float GeluTanh(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
}

float Silu(float x) { return x / (1.0f + std::exp(-x)); }

// Softmax of row[begin, end) in place; the rest of row[0, width) (positions before a sliding
// window, and the causally masked future) set to 0.
void MaskedSoftmax(float* row, int begin, int end, int width) {
  float max = row[begin];
  for (int j = begin + 1; j < end; ++j) max = std::max(max, row[j]);
  float sum = 0.0f;
  for (int j = begin; j < end; ++j) {
    row[j] = std::exp(row[j] - max);
    sum += row[j];
  }
  const float inv = 1.0f / sum;
  for (int j = begin; j < end; ++j) row[j] *= inv;
  std::fill(row, row + begin, 0.0f);
  std::fill(row + end, row + width, 0.0f);
}

class CpuStage final : public Stage {
 public:
  // A tensor-parallel rank (all_reduce non-null) computes with `config` narrowed to its heads and
  // MLP slice (RankConfig) and reports `model`, the whole model's; otherwise they are the same.
  CpuStage(ModelConfig model, ModelConfig config, StageWeights weights, CpuKvCache kv,
           CpuAllReduce* all_reduce, int rank)
      : model_(std::move(model)),
        c_(std::move(config)),
        w_(std::move(weights)),
        max_slots_(kv.layout().max_slots),
        max_seq_len_(kv.layout().max_seq_len),
        page_size_(kv.layout().page_size),
        num_pages_(kv.layout().num_pages),
        kv_(std::move(kv)),
        cached_len_(max_slots_, 0),
        inv_freq_(RopeInverseFrequencies(c_)),
        all_reduce_(all_reduce),
        rank_(rank) {}

  // Where constrained rows find the tokenizer their masks are made from.
  void UseTokenizerOf(const std::filesystem::path& model_dir) {
    std::vector<int32_t> eos;
    if (c_.eos_token_id >= 0) eos.push_back(c_.eos_token_id);
    constrained_ = std::make_unique<ConstrainedSampling>(model_dir, std::move(eos));
  }

  const ModelConfig& config() const override { return model_; }
  int kv_pages() const override { return num_pages_; }

  absl::StatusOr<KvBlock> ExportKv(const KvPlace& place, int positions, int first_layer,
                                   int num_layers) const override {
    RETURN_IF_ERROR(
        CheckKvPlace("KV export", place, positions, page_size_, num_pages_, max_seq_len_));
    const int slot = place.slot;
    RETURN_IF_ERROR(CheckKvExport(slot, positions, first_layer, num_layers, w_.first_layer,
                                  last_layer(), max_slots_,
                                  slot >= 0 && slot < max_slots_ ? cached_len_[slot] : 0));
    KvBlock b =
        SizedKvBlock(kv_.dtype(), first_layer, num_layers, c_.num_kv_heads, c_.head_dim, positions);
    b.scales = ScalesOf(first_layer, num_layers);
    const size_t layer_bytes = LayerBytes(positions);
    for (int l = 0; l < num_layers; ++l) {
      kv_.Gather(slot, place.block_table, first_layer - w_.first_layer + l, positions,
                 b.k.data() + l * layer_bytes, b.v.data() + l * layer_bytes);
    }
    return b;
  }

  absl::Status ImportKv(const KvPlace& place, const KvBlock& block) override {
    RETURN_IF_ERROR(
        CheckKvPlace("KV import", place, block.positions, page_size_, num_pages_, max_seq_len_));
    const int slot = place.slot;
    RETURN_IF_ERROR(CheckKvBlock(block, slot, c_, kv_.dtype(), w_.first_layer, last_layer(),
                                 max_slots_, max_seq_len_, kv_.scales()));
    const size_t layer_bytes = LayerBytes(block.positions);
    for (int l = 0; l < block.num_layers; ++l) {
      kv_.Scatter(slot, place.block_table, block.first_layer - w_.first_layer + l, block.positions,
                  block.k.data() + l * layer_bytes, block.v.data() + l * layer_bytes);
    }
    cached_len_[slot] = block.positions;
    return absl::OkStatus();
  }

  absl::StatusOr<std::shared_ptr<KvOut>> OpenKvOut(const KvPlace& place, int positions) override {
    RETURN_IF_ERROR(
        CheckKvPlace("KV write-out", place, positions, page_size_, num_pages_, max_seq_len_));
    const int slot = place.slot;
    RETURN_IF_ERROR(
        CheckKvOut(slot, positions, w_.first_layer, last_layer(), max_slots_, max_seq_len_));
    KvBlock block = SizedKvBlock(kv_.dtype(), w_.first_layer, static_cast<int>(w_.layers.size()),
                                 c_.num_kv_heads, c_.head_dim, positions);
    block.scales = kv_.scales();
    auto out = std::make_shared<KvOut>(std::move(block), place);
    kv_outs_.Add(out);
    return out;
  }

  absl::StatusOr<StepOutput> Step(const StepDescriptor& step, const Activations& in) override {
    // Write-outs of this step's rows fill as its layers go; any other was opened for nothing.
    const std::vector<std::shared_ptr<KvOut>> outs = kv_outs_.Take(step);
    absl::StatusOr<StepOutput> out = StepRows(step, in, outs);
    PendingKvOuts::End(outs, out.status(), [this](KvOut& o, int first) {
      for (int l = first; l < o.block().num_layers; ++l) WriteOut(o, l);
      return absl::OkStatus();
    });
    return out;
  }

 private:
  // Layer `l` of the stage into `out`'s block, published.
  void WriteOut(KvOut& out, int l) {
    KvBlock& b = out.block_to_write();
    const size_t layer_bytes = LayerBytes(b.positions);
    kv_.Gather(out.slot(), out.place().block_table, l, b.positions, b.k.data() + l * layer_bytes,
               b.v.data() + l * layer_bytes);
    out.Written(l);
  }

  absl::StatusOr<StepOutput> StepRows(const StepDescriptor& step, const Activations& in,
                                      std::span<const std::shared_ptr<KvOut>> outs) {
    RETURN_IF_ERROR(Validate(step, in));
    const int rows = static_cast<int>(step.tokens.size());
    const int hidden = c_.hidden_size;

    // The position of every row: sequence i's tokens sit at position, position + 1, ...
    std::vector<int> pos(rows);
    for (int i = 0, r = 0; i < static_cast<int>(step.seqs.size()); ++i) {
      for (int t = 0; t < step.seqs[i].num_tokens; ++t) pos[r++] = step.seqs[i].position + t;
    }

    // x: the residual stream, (rows, hidden).
    std::vector<float> x(static_cast<size_t>(rows) * hidden);
    if (w_.has_embedding) {
      for (int r = 0; r < rows; ++r) {
        float* xr = x.data() + static_cast<size_t>(r) * hidden;
        const float* tok = w_.tok_embedding.data() + static_cast<size_t>(step.tokens[r]) * hidden;
        std::copy(tok, tok + hidden, xr);
        if (!w_.pos_embedding.empty()) {
          const float* p = w_.pos_embedding.data() + static_cast<size_t>(pos[r]) * hidden;
          for (int i = 0; i < hidden; ++i) xr[i] += p[i];
        }
      }
    } else if (rows > 0) {
      ToFloat(in.dtype, in.data.get(), x.size(), x.data());
    }

    const int q_dim = c_.q_dim(), kv_dim = c_.kv_dim(), qkv_dim = q_dim + 2 * kv_dim;
    const int inter = c_.intermediate_size;
    const bool gated = c_.arch == Arch::kLlama;  // SwiGLU: w_in holds gate and up rows
    const int up_dim = gated ? 2 * inter : inter;
    const size_t n = static_cast<size_t>(rows);
    // Scratch, row-major: h (rows, hidden) normed input of each block; qkv (rows, q | k | v);
    // attn (rows, q_dim); up (rows, up_dim) MLP input projection; act (rows, inter).
    std::vector<float> h(n * hidden), qkv(n * qkv_dim), attn(n * q_dim), up(n * up_dim),
        act(n * inter);

    for (int l = 0; l < static_cast<int>(w_.layers.size()); ++l) {
      const LayerWeights& lw = w_.layers[l];
      // Attention block: x += o_proj(attention(rope(qkv(norm(x))))).
      Norm(c_.arch, x.data(), rows, hidden, lw.attn_norm_w, lw.attn_norm_b, c_.norm_eps, h.data());
      Linear(h.data(), rows, hidden, lw.wqkv, lw.bqkv, qkv_dim, qkv.data());
      if (c_.arch == Arch::kLlama) {
        for (int r = 0; r < rows; ++r) {
          float* q = qkv.data() + static_cast<size_t>(r) * qkv_dim;
          if (c_.qk_norm) {  // Qwen3: each head of q and of k RMSNorm-ed, before the rotation
            Norm(c_.arch, q, c_.num_heads, c_.head_dim, lw.q_norm_w, {}, c_.norm_eps, q);
            Norm(c_.arch, q + q_dim, c_.num_kv_heads, c_.head_dim, lw.k_norm_w, {}, c_.norm_eps,
                 q + q_dim);
          }
          Rope(q, c_.num_heads, c_.head_dim, pos[r], inv_freq_);             // q heads
          Rope(q + q_dim, c_.num_kv_heads, c_.head_dim, pos[r], inv_freq_);  // k heads
        }
      }
      for (int i = 0, r0 = 0; i < static_cast<int>(step.seqs.size()); ++i) {
        const SequenceStep& s = step.seqs[i];
        StoreKv(s, l, qkv.data() + static_cast<size_t>(r0) * qkv_dim, qkv_dim);
        Attend(s, l, w_.first_layer + l, qkv.data() + static_cast<size_t>(r0) * qkv_dim, qkv_dim,
               attn.data() + static_cast<size_t>(r0) * q_dim);
        r0 += s.num_tokens;
      }
      for (const std::shared_ptr<KvOut>& o : outs) WriteOut(*o, l);  // the layer's K, V written
      RowParallel(attn.data(), rows, q_dim, lw.wo, lw.bo, x.data());

      // MLP block: x += down(act(up(norm(x)))).
      Norm(c_.arch, x.data(), rows, hidden, lw.mlp_norm_w, lw.mlp_norm_b, c_.norm_eps, h.data());
      Linear(h.data(), rows, hidden, lw.w_in, lw.b_in, up_dim, up.data());
      for (int r = 0; r < rows; ++r) {
        const float* u = up.data() + static_cast<size_t>(r) * up_dim;
        float* a = act.data() + static_cast<size_t>(r) * inter;
        for (int j = 0; j < inter; ++j) {
          a[j] = gated ? Silu(u[j]) * u[inter + j] : GeluTanh(u[j]);
        }
      }
      RowParallel(act.data(), rows, inter, lw.w_out, lw.b_out, x.data());
    }

    for (const SequenceStep& s : step.seqs) cached_len_[s.slot] = s.position + s.num_tokens;

    StepOutput out;
    if (!w_.has_head) {
      auto buf = std::make_shared<std::vector<float>>(std::move(x));
      out.hidden.rows = rows;
      out.hidden.cols = hidden;
      out.hidden.dtype = DType::kF32;
      out.hidden.where = Where::kHost;
      out.hidden.data = std::shared_ptr<void>(buf, buf->data());
      return out;
    }
    for (int i = 0; i < static_cast<int>(step.seqs.size()); ++i) {
      if (!step.seqs[i].wants_logprobs()) continue;
      out.logprobs.emplace_back();
      out.logprobs.back().seq = i;
    }
    PromptLogprobs(step, x, out);
    RETURN_IF_ERROR(constrained_->Prepare(step));
    Head(step, x, out);
    return out;
  }

  // x (rows, hidden) += in (rows, in_dim) · wᵀ + b. On a tensor-parallel rank, in · wᵀ (+ b on
  // rank 0) is the rank's partial sum, summed over the ranks before it is added.
  void RowParallel(const float* in, int rows, int in_dim, const std::vector<float>& w,
                   const std::vector<float>& b, float* x) {
    const int hidden = c_.hidden_size;
    if (all_reduce_ == nullptr) {
      Linear(in, rows, in_dim, w, b, hidden, x, /*accumulate=*/true);
      return;
    }
    partial_.resize(static_cast<size_t>(rows) * hidden);
    Linear(in, rows, in_dim, w, b, hidden, partial_.data());
    all_reduce_->Sum(rank_, partial_.data(), partial_.size());
    for (size_t i = 0; i < partial_.size(); ++i) x[i] += partial_[i];
  }

  int last_layer() const { return w_.first_layer + static_cast<int>(w_.layers.size()); }

  // Bytes of one layer's K (or V) of `positions` positions in a KV block of this stage.
  size_t LayerBytes(int positions) const {
    return static_cast<size_t>(positions) * c_.kv_dim() * kv_.layout().element_bytes();
  }

  // The scales of the model layers [first_layer, first_layer + num_layers) of this stage; none
  // where the KV-cache is not FP8.
  std::vector<KvScales> ScalesOf(int first_layer, int num_layers) const {
    if (kv_.scales().empty()) return {};
    const auto from = kv_.scales().begin() + (first_layer - w_.first_layer);
    return {from, from + num_layers};
  }

  // Writes the sequence's new K and V rows (from its num_tokens rows of qkv) at its positions.
  void StoreKv(const SequenceStep& s, int layer, const float* qkv, int qkv_dim) {
    const int q_dim = c_.q_dim(), kv_dim = c_.kv_dim();
    for (int t = 0; t < s.num_tokens; ++t) {
      const float* row = qkv + static_cast<size_t>(t) * qkv_dim;
      kv_.Write(s.slot, s.block_table, layer, s.position + t, row + q_dim, row + q_dim + kv_dim);
    }
  }

  // Causal attention of the sequence's num_tokens queries over its cached positions
  // [0, position + num_tokens), narrowed to the model layer's sliding window where it has one.
  // `layer` indexes this stage's cache, `model_layer` the model. q: (num_tokens, qkv_dim) rows;
  // out: (num_tokens, q_dim) rows.
  void Attend(const SequenceStep& s, int layer, int model_layer, const float* q, int qkv_dim,
              float* out) {
    const int n = s.num_tokens, ctx = s.position + n, hd = c_.head_dim;
    const int kv_dim = c_.kv_dim(), q_dim = c_.q_dim();
    const int group = c_.num_heads / c_.num_kv_heads;  // query heads per KV head
    const auto [k, v] = kv_.Rows(s.slot, s.block_table, layer, ctx, k_rows_, v_rows_);
    const float scale = c_.attention_scale(model_layer);
    const int window = c_.attention_window(model_layer);
    std::vector<float> scores(static_cast<size_t>(n) * ctx);  // (n, ctx)
    for (int head = 0; head < c_.num_heads; ++head) {
      const int kv_head = head / group;
      // scores = scale · q_head (n, hd) · K_kv_head (ctx, hd)ᵀ
      RowBlockedGemm(/*trans_b=*/true, n, ctx, hd, scale, q + head * hd, qkv_dim,
                     k + kv_head * hd, kv_dim, 0.0f, scores.data(), ctx);
      // Query t sits at position + t and sees positions [0, position + t], or with a window the
      // last `window` of them.
      for (int t = 0; t < n; ++t) {
        const int end = s.position + t + 1;
        const int begin = window > 0 ? std::max(0, end - window) : 0;
        MaskedSoftmax(scores.data() + static_cast<size_t>(t) * ctx, begin, end, ctx);
      }
      // out_head (n, hd) = P (n, ctx) · V_kv_head (ctx, hd)
      RowBlockedGemm(/*trans_b=*/false, n, hd, ctx, 1.0f, scores.data(), ctx, v + kv_head * hd,
                     kv_dim, 0.0f, out + head * hd, q_dim);
    }
  }

  // Final norm, LM head and sampling for each sampled sequence's last row.
  void Head(const StepDescriptor& step, const std::vector<float>& x, StepOutput& out) {
    const int hidden = c_.hidden_size, vocab = c_.vocab_size;
    std::vector<float> last;  // (sampled, hidden)
    for (int i = 0, r0 = 0; i < static_cast<int>(step.seqs.size()); ++i) {
      const SequenceStep& s = step.seqs[i];
      r0 += s.num_tokens;
      if (!s.sample) continue;
      const float* row = x.data() + static_cast<size_t>(r0 - 1) * hidden;
      last.insert(last.end(), row, row + hidden);
    }
    const int sampled = static_cast<int>(last.size() / hidden);
    if (sampled == 0) return;
    std::vector<float> normed(last.size());
    Norm(c_.arch, last.data(), sampled, hidden, w_.final_norm_w, w_.final_norm_b, c_.norm_eps,
         normed.data());
    std::vector<float> logits(static_cast<size_t>(sampled) * vocab);  // (sampled, vocab)
    Linear(normed.data(), sampled, hidden, w_.lm_head, {}, vocab, logits.data());
    int j = 0;
    std::vector<float> penalised;
    for (int i = 0; i < static_cast<int>(step.seqs.size()); ++i) {
      const SequenceStep& s = step.seqs[i];
      if (!s.sample) continue;
      std::span<const float> row(logits.data() + static_cast<size_t>(j++) * vocab, vocab);
      int32_t token;
      if (s.sampling.has_penalties() || s.constraint != nullptr) {
        penalised.assign(row.begin(), row.end());
        ApplyPenalties(penalised, s.sampling, s.seen);
        constrained_->Mask(s, penalised);
        token = SampleToken(penalised, s.sampling, s.sample_index);
        constrained_->Advance(s, token);
      } else {
        token = SampleToken(row, s.sampling, s.sample_index);
      }
      out.tokens.push_back(token);
      if (s.logprobs >= 0) {
        SequenceLogprobs& l = LogprobsOf(out, i);
        l.has_sampled = true;
        l.sampled = ComputeLogprob(row, token, s.logprobs);
      }
    }
    if (step.return_logits) out.logits = std::move(logits);
  }

  // The entry of sequence `i` in out.logprobs (made for each sequence that asks, in order).
  static SequenceLogprobs& LogprobsOf(StepOutput& out, int i) {
    return *std::find_if(out.logprobs.begin(), out.logprobs.end(),
                         [i](const SequenceLogprobs& l) { return l.seq == i; });
  }

  // Prompt logprobs: every row of a sequence that asks is scored against the token after it
  // (the next row's, or next_prompt_token after the last); the row that samples is not.
  void PromptLogprobs(const StepDescriptor& step, const std::vector<float>& x, StepOutput& out) {
    const int hidden = c_.hidden_size, vocab = c_.vocab_size;
    for (int i = 0, r0 = 0; i < static_cast<int>(step.seqs.size()); ++i) {
      const SequenceStep& s = step.seqs[i];
      const int first = r0;
      r0 += s.num_tokens;
      if (s.prompt_logprobs < 0) continue;
      const int rows = s.num_tokens - (s.sample || s.next_prompt_token < 0 ? 1 : 0);
      SequenceLogprobs& l = LogprobsOf(out, i);
      if (rows <= 0) continue;
      const size_t n = static_cast<size_t>(rows) * hidden;
      std::vector<float> normed(n);
      Norm(c_.arch, x.data() + static_cast<size_t>(first) * hidden, rows, hidden,
           w_.final_norm_w, w_.final_norm_b, c_.norm_eps, normed.data());
      std::vector<float> logits(static_cast<size_t>(rows) * vocab);  // (rows, vocab)
      Linear(normed.data(), rows, hidden, w_.lm_head, {}, vocab, logits.data());
      for (int t = 0; t < rows; ++t) {
        const int32_t next = t + 1 < s.num_tokens ? step.tokens[first + t + 1]
                                                  : s.next_prompt_token;
        std::span<const float> row(logits.data() + static_cast<size_t>(t) * vocab, vocab);
        l.prompt.push_back(ComputeLogprob(row, next, s.prompt_logprobs));
      }
    }
  }

  // Everything is checked before anything is written, so a rejected step leaves no trace.
  absl::Status Validate(const StepDescriptor& step, const Activations& in) const {
    const StepLimits limits{max_slots_, max_seq_len_, c_.vocab_size, c_.hidden_size,
                            w_.has_embedding};
    // On pages a sequence may start past what its slot computed: its first pages can be another
    // sequence's (a cached prefix), which the coordinator's page owner vouches for.
    RETURN_IF_ERROR(ValidateStep(step, in, limits, page_size_ > 0 ? whole_context_ : cached_len_));
    RETURN_IF_ERROR(ValidateTables(step));
    if (!w_.has_embedding && in.rows > 0 && in.where != Where::kHost) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", step.id,
          ": input activations are in device memory; the CPU backend reads host memory"));
    }
    return absl::OkStatus();
  }

  // Each row's block table: on pages, enough pages in range for position + num_tokens and no
  // longer than the context; on contiguous slots, none.
  absl::Status ValidateTables(const StepDescriptor& step) const {
    for (size_t i = 0; i < step.seqs.size(); ++i) {
      const SequenceStep& s = step.seqs[i];
      if (page_size_ == 0 && !s.block_table.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "step ", step.id, ": sequence ", i, " (slot ", s.slot, ") names ", s.block_table.size(),
            " pages, but this stage's KV-cache is contiguous slots"));
      }
      if (page_size_ == 0) continue;
      const absl::Status st =
          CheckBlockTable(s.block_table, static_cast<int64_t>(s.position) + s.num_tokens,
                          page_size_, num_pages_, max_seq_len_);
      if (!st.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("step ", step.id, ": sequence ", i,
                                                       " (slot ", s.slot, "): ", st.message()));
      }
    }
    return absl::OkStatus();
  }

  const ModelConfig model_;  // the whole model (config())
  const ModelConfig c_;      // what this rank computes: the model, or a rank's part of it
  const StageWeights w_;
  std::unique_ptr<ConstrainedSampling> constrained_;
  const int max_slots_;
  const int max_seq_len_;
  const int page_size_;  // 0: contiguous slots
  const int num_pages_;  // with page_size_ > 0
  CpuKvCache kv_;
  std::vector<int> cached_len_;  // per slot: positions [0, len) hold K/V
  const std::vector<int> whole_context_ = std::vector<int>(max_slots_, max_seq_len_);
  // Scratch of Attend on pages: a sequence's K and V rows of one layer, gathered.
  std::vector<float> k_rows_, v_rows_;
  std::vector<float> inv_freq_;       // (head_dim / 2) RoPE frequencies
  PendingKvOuts kv_outs_;             // opened for the next step (OpenKvOut)
  CpuAllReduce* const all_reduce_;    // tensor-parallel ranks' sums; null for a whole stage
  const int rank_;                    // this stage's rank among them
  std::vector<float> partial_;        // (rows, hidden) a rank's row-parallel output
};

}  // namespace

absl::Status SetCpuThreads(int threads) {
  if (threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(threads, " threads (expected at least 1)"));
  }
  openblas_set_num_threads(threads);
  return absl::OkStatus();
}

int CpuThreads() { return openblas_get_num_threads(); }

namespace {

// Rank `rank` of the stage, or the whole stage when all_reduce is null. Each rank reads the
// checkpoint and keeps its shard.
// A paged pool sized by memory: kv_memory_fraction of the host memory available now (the
// stage's weights read), shared by the ranks of a tensor-parallel stage.
int64_t KvBudgetBytes(const StageSpec& spec, int ranks) {
  if (spec.kv_page_size == 0 || spec.kv_pages > 0) return 0;
  const double fraction = std::clamp(spec.kv_memory_fraction, 0.0, 1.0);
  return std::max<int64_t>(
      1, static_cast<int64_t>(static_cast<double>(HostAvailableBytes()) * fraction / ranks));
}

absl::StatusOr<std::unique_ptr<Stage>> MakeCpuStageRank(const StageSpec& spec,
                                                        CpuAllReduce* all_reduce, int rank) {
  ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(spec.model_dir));
  const ModelConfig& c = ckpt->config();
  const int ranks = all_reduce == nullptr ? 1 : all_reduce->ranks();
  RETURN_IF_ERROR(CheckTensorParallel(c, ranks));
  const ModelConfig rank_config = RankConfig(c, ranks);
  const int last = spec.last_layer == -1 ? c.num_layers : spec.last_layer;
  if (spec.max_slots < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_slots must be >= 1, got ", spec.max_slots));
  }
  const int max_seq_len = spec.max_seq_len == 0 ? c.max_positions : spec.max_seq_len;
  if (max_seq_len < 1 || max_seq_len > c.max_positions) {
    return absl::InvalidArgumentError(absl::StrCat("max_seq_len must be in [1, ", c.max_positions,
                                                   "] (the model's max positions) or 0, got ",
                                                   spec.max_seq_len));
  }
  ASSIGN_OR_RETURN(StageSources sources, FindStageWeights(*ckpt, spec.first_layer, last));
  StageWeights weights = ReadStageWeights(sources);
  if (spec.quantize_fp8) RETURN_IF_ERROR(RoundLinearWeightsToFp8(sources, weights));
  if (ranks > 1) weights = ShardStage(c, weights, rank, ranks);

  if (spec.kv_page_size < 0 || spec.kv_pages < 0) {
    return absl::InvalidArgumentError(absl::StrCat("kv_page_size and kv_pages must be >= 0, got ",
                                                   spec.kv_page_size, " and ", spec.kv_pages));
  }
  std::vector<KvScales> kv_scales;  // an FP8 KV-cache's, every rank the same
  if (spec.kv_cache_fp8) {
    if (spec.kv_page_size == 0) {
      return absl::InvalidArgumentError(
          "kv_cache_dtype fp8_e4m3 needs the paged KV-cache (kv_page_size > 0); this stage was "
          "given kv_page_size 0 (contiguous slots)");
    }
    ASSIGN_OR_RETURN(kv_scales, LoadKvScales(*ckpt, spec.first_layer, last));
  }
  ASSIGN_OR_RETURN(CpuKvCache kv,
                   CpuKvCache::Make({.layers = static_cast<int>(weights.layers.size()),
                                     .kv_dim = rank_config.kv_dim(),
                                     .max_slots = spec.max_slots,
                                     .max_seq_len = max_seq_len,
                                     .page_size = spec.kv_page_size,
                                     .num_pages = spec.kv_pages,
                                     .budget_bytes = KvBudgetBytes(spec, ranks),
                                     .fp8 = spec.kv_cache_fp8},
                                    std::move(kv_scales)));
  auto stage = std::make_unique<CpuStage>(c, rank_config, std::move(weights), std::move(kv),
                                          all_reduce, rank);
  stage->UseTokenizerOf(spec.model_dir);
  return stage;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Stage>> MakeCpuStage(const StageSpec& spec) {
  return MakeCpuStageRank(spec, nullptr, 0);
}

absl::StatusOr<std::vector<std::unique_ptr<Stage>>> MakeCpuStageRanks(const StageSpec& spec,
                                                                      CpuAllReduce& all_reduce) {
  std::vector<std::unique_ptr<Stage>> stages;
  StageSpec rank_spec = spec;
  for (int rank = 0; rank < all_reduce.ranks(); ++rank) {
    ASSIGN_OR_RETURN(std::unique_ptr<Stage> stage, MakeCpuStageRank(rank_spec, &all_reduce, rank));
    // Every rank holds the same pages (one block table serves them all): as many as the first
    // sized from its share of the memory.
    rank_spec.kv_pages = stage->kv_pages();
    stages.push_back(std::move(stage));
  }
  return stages;
}

}  // namespace tandem
