// The CUDA stage's forward pass, queued on its stream top to bottom like the math: embed, then
// per layer norm, QKV with rotary embedding and cache write, attention, out-projection and
// residual, norm, MLP and residual; then the final norm, the LM head and sampling.
#include <algorithm>

#include "common/status_macros.h"
#include "worker/cuda/cuda_stage_impl.h"
#include "worker/cuda/head_norm.h"
#include "worker/cuda/kv_pages.h"
#include "worker/cuda/prefill_attention.h"

namespace tandem {

absl::Status CudaStage::Matmul(const void* x, const void* w, void* y, int rows, int out, int in,
                               float beta, bool y_f32, const float* w_scales) {
  if (w_scales != nullptr && fp8_gemm_ != nullptr && !y_f32) {
    return fp8_gemm_->Run(opt_.dtype, x, w, w_scales, y, rows, out, in, beta, fp8_x_codes_.get(),
                          fp8_x_scales_.as<float>());
  }
  if (w_scales != nullptr) {
    // FP8 weights where the FP8 GEMM is not used (batch-invariant, or no cuBLASLt support):
    // dequantized to dtype in a scratch buffer, then the 16-bit GEMM.
    RETURN_IF_ERROR(cuda::LaunchDequantizeFp8Rows(opt_.dtype, w, w_scales, fp8_scratch_.get(), out,
                                                  in, stream_.get()));
    w = fp8_scratch_.get();
  }
  if (fixed_gemm_ != nullptr)
    return fixed_gemm_->Run(opt_.dtype, x, w, y, rows, out, in, beta, y_f32);
  return cuda::Gemm(cublas_.get(), opt_.dtype, x, w, y, rows, out, in, beta, y_f32);
}

absl::Status CudaStage::Gemv(cuda::GemvEpilogue e, const void* x, const void* w,
                             const float* w_scales, const void* bias, void* y, int rows, int out,
                             int in) {
  if (w_scales != nullptr) {
    return cuda::GemvFp8(opt_.dtype, e, x, w, w_scales, bias, y, rows, out, in, stream_.get());
  }
  return cuda::Gemv(opt_.dtype, e, x, w, bias, y, rows, out, in, stream_.get());
}

int CudaStage::SplitsFor(int rows) const {
  // Batch-invariant: the keys of a row are never split, whatever the number of rows.
  if (opt_.batch_invariant) return 1;
  return cuda::AttentionSplits(rows, c_.num_kv_heads, seq_capacity_, sm_count_);
}

absl::Status CudaStage::Forward(int rows, int samples) {
  // Decode-sized passes: every projection through the GEMV kernels, with biases, residual adds
  // and the MLP activation fused into them.
  const bool gemv = GemvFits(rows);
  if (has_embedding_) {
    // Decode rows fed by the step before read its tokens where its sampling left them.
    RETURN_IF_ERROR(cuda::LaunchEmbedding(
        opt_.dtype, DevIn<int32_t>(layout_.tokens), DevIn<int32_t>(layout_.positions),
        tok_embedding_, pos_embedding_, x_.get(), rows, c_.hidden_size, stream_.get(),
        /*pdl=*/false, has_head_ ? tokens_out_.as<int32_t>() : nullptr));
  }
  PassRows p{x_.get(), q_.get(), rows, DevIn<int32_t>(layout_.positions),
             DevIn<int32_t>(layout_.slots)};
  for (int l = 0; l < num_layers_; ++l) {
    if (l <= 1 || l == num_layers_ - 1) {
      constexpr DecodeObserver::Point kLayerPoints[] = {DecodeObserver::Point::kLayer0,
                                                        DecodeObserver::Point::kLayer1,
                                                        DecodeObserver::Point::kLastLayer};
      RETURN_IF_ERROR(Mark(kLayerPoints[std::min(l, 2)]));
    }
    RETURN_IF_ERROR(QkvIntoCache(l, rows, gemv, p.pending_bias));
    for (const std::shared_ptr<KvOut>& out : forward_outs_) RETURN_IF_ERROR(WriteOut(*out, l));
    if (l == num_layers_ - 1 && LastLayerSampledOnly(rows, samples, gemv)) {
      if (samples == 0) return absl::OkStatus();  // the cache is written; no row is read
      RETURN_IF_ERROR(KeepSampledRows(samples, p));
    }
    // Decode-sized passes (and a last layer of few sampled rows) take the GEMV kernels from here.
    RETURN_IF_ERROR(AttentionAndMlp(l, p.sampled_only ? GemvFits(p.n) : gemv, p));
  }
  RETURN_IF_ERROR(Mark(DecodeObserver::Point::kHead));
  if (score_rows_) {
    // Prompt logprobs: every row's final norm into xn_ (free past the last layer), for the LM
    // head over the scored rows once the pass is queued (ScorePromptRows).
    RETURN_IF_ERROR(cuda::LaunchNorm(opt_.dtype, c_.arch == Arch::kLlama, p.x, p.pending_bias,
                                     final_norm_w_, final_norm_b_, nullptr, xn_.get(), rows,
                                     c_.hidden_size, c_.norm_eps, stream_.get()));
    p.pending_bias = nullptr;
  }
  if (has_head_) return Head(samples, p);
  if (p.pending_bias != nullptr) {
    RETURN_IF_ERROR(cuda::LaunchAddBias(opt_.dtype, x_.get(), p.pending_bias, rows, c_.hidden_size,
                                        stream_.get()));
  }
  return absl::OkStatus();
}

// Layer l's attention norm (adding `pending_bias` first) and QKV projection, then q with rotary
// embedding into q_ and the keys and values into the cache, for every row of the pass (Qwen3: with
// the per-head norm of q and k before the rotation).
absl::Status CudaStage::QkvIntoCache(int l, int rows, bool gemv, const void* pending_bias) {
  using namespace cuda;
  const cudaStream_t s = stream_.get();
  const DType t = opt_.dtype;
  const int hidden = c_.hidden_size;
  const bool llama = c_.arch == Arch::kLlama;
  const DeviceLayer& L = layers_[l];
  const int32_t* positions = DevIn<int32_t>(layout_.positions);
  const int32_t* slots = DevIn<int32_t>(layout_.slots);
  const float* inv_freq = llama ? inv_freq_.as<float>() : nullptr;  // null: no rotation
  RETURN_IF_ERROR(LaunchNorm(t, llama, x_.get(), pending_bias, L.attn_norm_w, L.attn_norm_b,
                             nullptr, xn_.get(), rows, hidden, c_.norm_eps, s, NormPdl()));
  const int qkv_cols = c_.q_dim() + 2 * c_.kv_dim();
  if (c_.qk_norm) {
    // Qwen3: the heads of q and k are normed between the projection (with its bias) and the
    // rotation, so the projection goes to qkv_ and the split/rotate follows without a bias.
    if (gemv) {
      RETURN_IF_ERROR(Gemv(GemvEpilogue::kStore, xn_.get(), L.wqkv, L.wqkv_scales, L.bqkv,
                           qkv_.get(), rows, qkv_cols, hidden));
    } else {
      RETURN_IF_ERROR(Matmul(xn_.get(), L.wqkv, qkv_.get(), rows, qkv_cols, hidden, 0.0f, false,
                             L.wqkv_scales));
    }
    RETURN_IF_ERROR(LaunchHeadNorm(t, qkv_.get(), gemv ? nullptr : L.bqkv, L.q_norm_w, L.k_norm_w,
                                   rows, c_.num_heads, c_.num_kv_heads, c_.head_dim, c_.norm_eps,
                                   s));
    if (paged()) {
      return LaunchQkvRopeCachePaged(t, qkv_.get(), nullptr, q_.get(), Pages(l), positions, slots,
                                     rows, c_.num_heads, c_.num_kv_heads, c_.head_dim, inv_freq, s);
    }
    return LaunchQkvRopeCache(t, qkv_.get(), nullptr, q_.get(), KCache(l), VCache(l), positions,
                              slots, rows, c_.num_heads, c_.num_kv_heads, c_.head_dim,
                              seq_capacity_, inv_freq, s);
  }
  // GEMV-sized passes: the QKV projection writes q and the KV-cache itself, rotary embedding
  // included; otherwise a separate split/rotate kernel follows the GEMM.
  if (gemv) {
    QkvCacheArgs cache;
    cache.q_out = q_.get();
    cache.k_cache = KCache(l);
    cache.v_cache = VCache(l);
    cache.positions = positions;
    cache.slots = slots;
    cache.num_heads = c_.num_heads;
    cache.num_kv_heads = c_.num_kv_heads;
    cache.head_dim = c_.head_dim;
    cache.seq_capacity = seq_capacity_;
    cache.inv_freq = inv_freq;
    if (paged()) {
      return GemvQkvCachePaged(t, xn_.get(), L.wqkv, L.wqkv_scales, L.bqkv, cache, Pages(l), rows,
                               hidden, s);
    }
    if (L.wqkv_scales != nullptr) {
      return GemvQkvCacheFp8(t, xn_.get(), L.wqkv, L.wqkv_scales, L.bqkv, cache, rows, hidden, s);
    }
    return GemvQkvCache(t, xn_.get(), L.wqkv, L.bqkv, cache, rows, hidden, s);
  }
  RETURN_IF_ERROR(
      Matmul(xn_.get(), L.wqkv, qkv_.get(), rows, qkv_cols, hidden, 0.0f, false, L.wqkv_scales));
  if (paged()) {
    return LaunchQkvRopeCachePaged(t, qkv_.get(), L.bqkv, q_.get(), Pages(l), positions, slots,
                                   rows, c_.num_heads, c_.num_kv_heads, c_.head_dim, inv_freq, s);
  }
  return LaunchQkvRopeCache(t, qkv_.get(), L.bqkv, q_.get(), KCache(l), VCache(l), positions, slots,
                            rows, c_.num_heads, c_.num_kv_heads, c_.head_dim, seq_capacity_,
                            inv_freq, s);
}

// The last layer of a pass goes on for the sampled rows only: their x and q gathered into buffers
// of their own, with their positions and slots.
absl::Status CudaStage::KeepSampledRows(int samples, PassRows& p) {
  const int32_t* gather = DevIn<int32_t>(layout_.gather);
  RETURN_IF_ERROR(cuda::LaunchGatherRows(x_.get(), gather, sampled_x_.get(), samples,
                                         RowBytes(c_.hidden_size), stream_.get()));
  RETURN_IF_ERROR(cuda::LaunchGatherRows(q_.get(), gather, sampled_q_.get(), samples,
                                         RowBytes(c_.q_dim()), stream_.get()));
  p.x = sampled_x_.get();
  p.q = sampled_q_.get();
  p.n = samples;
  p.positions = DevIn<int32_t>(layout_.sample_positions);
  p.slots = DevIn<int32_t>(layout_.sample_slots);
  p.sampled_only = true;
  return absl::OkStatus();
}

// Layer l past its cache write, for the pass's rows `p`: attention, out-projection added into x,
// MLP norm, up, activation, down added into x (through the GEMV kernels with `gemv`).
absl::Status CudaStage::AttentionAndMlp(int l, bool gemv, PassRows& p) {
  using namespace cuda;
  const cudaStream_t s = stream_.get();
  const DType t = opt_.dtype;
  const int hidden = c_.hidden_size, inter = c_.intermediate_size;
  const bool llama = c_.arch == Arch::kLlama;
  const DeviceLayer& L = layers_[l];
  const int n = p.n;
  const AttentionParams attention{c_.attention_scale(first_layer_ + l),
                                  c_.attention_window(first_layer_ + l)};
  if (paged() && prefill_attention_ && !p.sampled_only) {
    RETURN_IF_ERROR(LaunchPrefillAttentionPaged(t, p.q, Pages(l), p.positions, p.slots, attn_.get(),
                                                n, c_.num_heads, c_.num_kv_heads, c_.head_dim,
                                                attention, s));
  } else if (paged()) {
    RETURN_IF_ERROR(LaunchAttentionPaged(
        t, p.q, Pages(l), p.positions, p.slots, partials_.as<float>(), attn_.get(), n, c_.num_heads,
        c_.num_kv_heads, c_.head_dim, SplitsFor(n), attention, s, attn_counters_.as<uint32_t>()));
  } else if (prefill_attention_ && !p.sampled_only) {
    RETURN_IF_ERROR(LaunchPrefillAttention(t, p.q, KCache(l), VCache(l), p.positions, p.slots,
                                           attn_.get(), n, c_.num_heads, c_.num_kv_heads,
                                           c_.head_dim, seq_capacity_, attention, s));
  } else {
    RETURN_IF_ERROR(LaunchAttention(t, p.q, KCache(l), VCache(l), p.positions, p.slots,
                                    partials_.as<float>(), attn_.get(), n, c_.num_heads,
                                    c_.num_kv_heads, c_.head_dim, seq_capacity_, SplitsFor(n),
                                    attention, s, attn_counters_.as<uint32_t>()));
  }
  // Tensor-parallel ranks but rank 0 store their row-parallel partial sums (AfterRowParallel).
  const GemvEpilogue into_x = rank_.rank == 0 ? GemvEpilogue::kResidual : GemvEpilogue::kStore;
  const float x_beta = rank_.rank == 0 ? 1.0f : 0.0f;
  if (gemv) {
    RETURN_IF_ERROR(Gemv(into_x, attn_.get(), L.wo, L.wo_scales, L.bo, p.x, n, hidden, c_.q_dim()));
  } else {
    RETURN_IF_ERROR(
        Matmul(attn_.get(), L.wo, p.x, n, hidden, c_.q_dim(), x_beta, false, L.wo_scales));
  }
  RETURN_IF_ERROR(AfterRowParallel(p.x, n));
  // MLP block: norm (adding the out-proj bias first) -> up -> activation -> down added into x.
  RETURN_IF_ERROR(LaunchNorm(t, llama, p.x, gemv ? nullptr : L.bo, L.mlp_norm_w, L.mlp_norm_b,
                             nullptr, xn_.get(), n, hidden, c_.norm_eps, s, NormPdl()));
  if (gemv) {
    const GemvEpilogue in_epilogue = llama ? GemvEpilogue::kSwiGlu : GemvEpilogue::kGelu;
    void* act = llama ? mlp_act_.get() : mlp_in_.get();
    const void* in_bias = llama ? nullptr : L.b_in;
    RETURN_IF_ERROR(
        Gemv(in_epilogue, xn_.get(), L.w_in, L.w_in_scales, in_bias, act, n, inter, hidden));
    RETURN_IF_ERROR(Gemv(into_x, act, L.w_out, L.w_out_scales, L.b_out, p.x, n, hidden, inter));
    RETURN_IF_ERROR(AfterRowParallel(p.x, n));
    p.pending_bias = nullptr;
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(Matmul(xn_.get(), L.w_in, mlp_in_.get(), n, llama ? 2 * inter : inter, hidden,
                         0.0f, false, L.w_in_scales));
  const void* act = mlp_in_.get();
  if (llama) {
    RETURN_IF_ERROR(LaunchSwiGlu(t, mlp_in_.get(), mlp_act_.get(), n, inter, s));
    act = mlp_act_.get();
  } else {
    RETURN_IF_ERROR(LaunchGeluBias(t, mlp_in_.get(), L.b_in, n, inter, s));
  }
  RETURN_IF_ERROR(Matmul(act, L.w_out, p.x, n, hidden, inter, x_beta, false, L.w_out_scales));
  RETURN_IF_ERROR(AfterRowParallel(p.x, n));
  p.pending_bias = L.b_out;
  return absl::OkStatus();
}

// Final norm of the sampled rows only (gathered already where the last layer was pruned), LM head
// into fp32 logits, sampling.
absl::Status CudaStage::Head(int samples, const PassRows& p) {
  using namespace cuda;
  if (samples == 0) return absl::OkStatus();
  const cudaStream_t s = stream_.get();
  const DType t = opt_.dtype;
  const int hidden = c_.hidden_size;
  const int32_t* gather = p.sampled_only ? nullptr : DevIn<int32_t>(layout_.gather);
  const bool head_gemv = samples <= GemvMaxRows() && GemvSupported(samples, hidden);
  RETURN_IF_ERROR(LaunchNorm(t, c_.arch == Arch::kLlama, p.x, p.pending_bias, final_norm_w_,
                             final_norm_b_, gather, head_in_.get(), samples, hidden, c_.norm_eps,
                             s, NormPdl()));
  RETURN_IF_ERROR(HeadLogits(head_in_.get(), samples, head_gemv, logits_.as<float>()));
  SamplingArrays arrays{DevIn<float>(layout_.temperature), DevIn<int32_t>(layout_.top_k),
                        DevIn<float>(layout_.top_p), DevIn<uint64_t>(layout_.seed),
                        DevIn<uint64_t>(layout_.sample_index)};
  return LaunchSample(logits_.as<float>(), probs_.as<float>(), arrays, tokens_out_.as<int32_t>(),
                      samples, c_.vocab_size, s);
}

absl::Status CudaStage::HeadLogits(const void* normed, int rows, bool gemv, float* logits) {
  const int hidden = c_.hidden_size, vocab = c_.vocab_size;
  const int cols = rank_.head_rows > 0 ? rank_.head_rows : vocab;
  const size_t count = static_cast<size_t>(rows) * cols;
  float* out = rank_.head_rows > 0 ? head_parts_.as<float>() + rank_.rank * count : logits;
  if (gemv) {
    RETURN_IF_ERROR(Gemv(cuda::GemvEpilogue::kF32, normed, lm_head_, nullptr, nullptr, out, rows,
                         cols, hidden));
  } else {
    RETURN_IF_ERROR(Matmul(normed, lm_head_, out, rows, cols, hidden, 0.0f, true));
  }
  if (rank_.head_rows == 0) return absl::OkStatus();
  RETURN_IF_ERROR(rank_.gather_head(head_parts_.as<float>(), count, stream_.get()));
  // Rank q's (rows, cols) block into columns [q * cols, ...) of every row.
  for (int q = 0; q < rank_.ranks; ++q) {
    const int width = std::min(cols, vocab - q * cols);
    if (width <= 0) break;
    CUDA_CHECK(cudaMemcpy2DAsync(logits + static_cast<size_t>(q) * cols, vocab * sizeof(float),
                                 head_parts_.as<float>() + q * count, cols * sizeof(float),
                                 width * sizeof(float), rows, cudaMemcpyDeviceToDevice,
                                 stream_.get()));
  }
  return absl::OkStatus();
}

}  // namespace tandem
