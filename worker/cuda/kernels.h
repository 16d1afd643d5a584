// Launchers of the backend's kernels, one .cu per family. Activations, weights and the KV-cache are
// `dtype` (kF16 or kBF16) unless a parameter says fp32; every launcher enqueues on `stream`, checks
// the launch and returns its error. Row-major throughout; shapes in the comments.
//
// `pdl`: launch as a programmatic dependent launch (on a stream other than the legacy default),
// so that the kernel starts while the previous kernel of the stream finishes; every kernel waits
// for its predecessor before touching activations (device_util.cuh), so any mix is correct. The
// first kernel after a copy is launched without it.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace tandem::cuda {

// Per-row metadata of a forward pass, in device memory.
struct RowInfo {
  const int32_t* tokens;     // (rows) token ids, first stage only
  const int32_t* positions;  // (rows) absolute position of each row
  const int32_t* slots;      // (rows) KV-cache slot of each row
};

// embedding.cu: out[r] = tok_emb[tokens[r]] (+ pos_emb[positions[r]] when pos_emb != nullptr).
// tok_emb (vocab, hidden), pos_emb (max_positions, hidden), out (rows, hidden). A negative token
// -1 - j stands for previous[j], the token row j of the step before sampled (previous: that
// step's sampled tokens, still in device memory); without `previous` tokens are all >= 0.
absl::Status LaunchEmbedding(DType dtype, const int32_t* tokens, const int32_t* positions,
                             const void* tok_emb, const void* pos_emb, void* out, int rows,
                             int hidden, cudaStream_t stream, bool pdl = false,
                             const int32_t* previous = nullptr);

// norm.cu: for each output row i, with r = gather ? gather[i] : i:
//   x[r] += bias (when bias != nullptr; written back to x)
//   out[i] = LayerNorm(x[r]) * w + b (rms == false) or RMSNorm(x[r]) * w (rms == true).
// x (.., cols), out (rows, cols), w, b, bias (cols).
absl::Status LaunchNorm(DType dtype, bool rms, void* x, const void* bias, const void* w,
                        const void* b, const int32_t* gather, void* out, int rows, int cols,
                        float eps, cudaStream_t stream, bool pdl = false);

// residual.cu: x[r] += bias for every row. x (rows, cols), bias (cols).
absl::Status LaunchAddBias(DType dtype, void* x, const void* bias, int rows, int cols,
                           cudaStream_t stream);

// residual.cu: dst row i = src row gather[i], for i < rows; rows of row_bytes bytes.
absl::Status LaunchGatherRows(const void* src, const int32_t* gather, void* dst, int rows,
                              size_t row_bytes, cudaStream_t stream);

// rope.cu: splits qkv (rows, q_dim + 2 kv_dim) into q_out (rows, q_dim) and the layer's cache,
// adding bias (q_dim + 2 kv_dim) when given and rotating q and k (rotate-half form, as Hugging Face
// Llama) when inv_freq is given: inv_freq (head_dim / 2) fp32, the rotary inverse frequencies
// computed on the host from the config (RopeInverseFrequencies, scaling included); the pair
// (i, i + head_dim / 2) at position p turns by p * inv_freq[i]. Cache layout:
// (slots, kv_heads, seq_capacity, head_dim).
absl::Status LaunchQkvRopeCache(DType dtype, const void* qkv, const void* bias, void* q_out,
                                void* k_cache, void* v_cache, const int32_t* positions,
                                const int32_t* slots, int rows, int num_heads, int num_kv_heads,
                                int head_dim, int seq_capacity, const float* inv_freq,
                                cudaStream_t stream, bool pdl = false);

// What a query sees and how its scores are scaled, per layer (ModelConfig::attention_scale and
// attention_window).
struct AttentionParams {
  float scale = 0.0f;  // scores = (q · k) * scale; usually 1 / sqrt(head_dim)
  // > 0: sliding window, a query at position p sees the keys at [max(0, p - window + 1), p]
  // only (its own and the window - 1 before it, as Hugging Face Mistral); 0: all of [0, p].
  int window = 0;
};

// attention.cu: causal attention of each row's query over keys [0, positions[r]] of its slot
// (the last params.window of them when a window is set), scores scaled by params.scale.
// q (rows, num_heads * head_dim), out (rows, num_heads * head_dim). The keys are split over
// `splits` blocks per (row, kv head); partials (rows * splits * num_heads * (head_dim + 2) floats)
// are combined by the last block of each (row, kv head), counted in `counters` (rows *
// num_kv_heads zeros, left zero after the call); with one split the block writes `out` directly.
absl::Status LaunchAttention(DType dtype, const void* q, const void* k_cache, const void* v_cache,
                             const int32_t* positions, const int32_t* slots, float* partials,
                             void* out, int rows, int num_heads, int num_kv_heads, int head_dim,
                             int seq_capacity, int splits, const AttentionParams& params,
                             cudaStream_t stream, uint32_t* counters, bool pdl = false);
// Shapes the register decode-attention kernel (one lane group a key, the query and accumulators in
// registers) is built for: head_dim a multiple of 4 up to 128, at most 8 query heads per kv head.
// LaunchAttention and LaunchAttentionPaged run it for these; the FP8 KV-cache is read by it alone.
bool AttentionLanesKernelTakes(int head_dim, int group);
// Key splits of LaunchAttention (and LaunchAttentionPaged) for `rows` rows of `num_kv_heads` kv
// heads over contexts of up to `max_context` positions on a GPU of `sm_count` SMs: enough blocks
// to fill the GPU twice, at most kMaxAttentionSplits, and no more than the 64-key tiles of the
// longest context; at least 1. So rows * splits <= rows + 2 * sm_count / num_kv_heads, which
// sizes the partials.
constexpr int kMaxAttentionSplits = 16;
int AttentionSplits(int rows, int num_kv_heads, int max_context, int sm_count);
// Floats of partials that LaunchAttention needs.
size_t AttentionPartialFloats(int rows, int num_heads, int head_dim, int splits);
// Largest num_heads / num_kv_heads * head_dim the attention kernel handles.
constexpr int kMaxAttentionGroupWidth = 1024;
// Seq capacity of the KV-cache is a multiple of this (aligned 16-byte tile loads).
constexpr int kKvSeqAlign = 64;

// kv_block.cu: K and V of slot `slot`, positions [0, positions), between one layer's cache
// (slots, kv_heads, seq_capacity, head_dim) and a layer of a KV block (positions,
// kv_heads * head_dim): into k_block and v_block when to_block, from them otherwise. 16-bit
// elements (f16 or bf16: the bits are copied), head_dim even, every pointer 4-byte aligned.
absl::Status LaunchKvBlockCopy(void* k_cache, void* v_cache, int slot, void* k_block,
                               void* v_block, int positions, int num_kv_heads, int head_dim,
                               int seq_capacity, bool to_block, cudaStream_t stream);

// activation.cu: h (rows, cols) = gelu_tanh(h + b) in place (b may be null).
absl::Status LaunchGeluBias(DType dtype, void* h, const void* b, int rows, int cols,
                            cudaStream_t stream);
// gate_up (rows, 2 * cols): gate columns then up columns; out (rows, cols) = silu(gate) * up.
absl::Status LaunchSwiGlu(DType dtype, const void* gate_up, void* out, int rows, int cols,
                          cudaStream_t stream);

// matmul.cu: y (rows, out) = x (rows, in) · wᵀ, w (out, in); y = alpha * x·wᵀ + beta * y.
// y is `dtype`, or fp32 when y_f32.
absl::Status Gemm(cublasHandle_t handle, DType dtype, const void* x, const void* w, void* y,
                  int rows, int out, int in, float beta, bool y_f32);

// The same product through cuBLASLt with one algorithm pinned per shape (dtype, out, in, output
// type), chosen once by Prepare without split-K (and at most 1 KiB of workspace) and checked valid
// for row counts from 1 to 2048: each output is then summed by one thread block in one order
// whatever the number of rows, so a row's result does not depend on which other rows share the
// product (what cublasGemmEx, which picks kernels by size, does not promise). For the
// batch-invariant mode.
class FixedAlgoGemm {
 public:
  static absl::StatusOr<std::unique_ptr<FixedAlgoGemm>> Create(cudaStream_t stream);
  ~FixedAlgoGemm();
  FixedAlgoGemm(const FixedAlgoGemm&) = delete;
  FixedAlgoGemm& operator=(const FixedAlgoGemm&) = delete;

  // Chooses and pins the algorithm of a shape (idempotent). FAILED_PRECONDITION when cuBLASLt has
  // none that qualifies.
  absl::Status Prepare(DType dtype, int out, int in, bool y_f32);
  // y (rows, out) = x · wᵀ + beta * y on the stream given to Create, with the shape's pinned
  // algorithm; FAILED_PRECONDITION for a shape not prepared.
  absl::Status Run(DType dtype, const void* x, const void* w, void* y, int rows, int out, int in,
                   float beta, bool y_f32);

 private:
  FixedAlgoGemm() = default;
  struct Plan;
  using Key = std::tuple<int, int, int, bool>;
  cublasLtHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* workspace_ = nullptr;  // 1 KiB: the counters some algorithms use, no reduction buffer
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

// gemv.cu: y (rows, out) = x (rows, in) · wᵀ for decode-sized row counts, w (out, in), with the
// epilogue fused; bias (out) may be null. Takes rows in {1, 2, 4, 8} and in % 8 == 0 (see
// GemvSupported); x and w 16-byte aligned.
enum class GemvEpilogue {
  kStore,     // y = x·wᵀ + bias, rounded once to dtype
  kResidual,  // y += round(x·wᵀ + bias): the projection added into the residual stream
  kGelu,      // y = gelu_tanh(round(x·wᵀ + bias))
  kSwiGlu,    // w is (2 * out, in), gate rows then up rows: y = silu(gate) * up; no bias
  kF32,       // y (fp32) = x·wᵀ + bias, unrounded (logits)
  kQkvCache,  // GemvQkvCache only: the fused QKV projection into q and the KV-cache
};
// How a GEMV spreads over the GPU. rows_per_warp: weight rows one warp computes (1 or 2; always 2
// at 4 and 8 input rows, for SwiGLU and for kQkvCache). k_split: warps that divide one group of
// rows' K between them (1, 2 or 4), adding their sums in warp order. 0: GemvTuningFor's choice.
// fp8_lane_codes: FP8 weights' codes per lane and step, 8 (8-byte loads) or 16 (16-byte loads,
// input width a multiple of 16); 0: 16 where the width allows. Results depend on k_split and
// fp8_lane_codes (the order of the sum), not on anything else in the tuning.
struct GemvTuning {
  int rows_per_warp = 0;
  int k_split = 0;
  int fp8_lane_codes = 0;
};
// The choice for a shape: a K split for outputs too narrow to give every multiprocessor enough
// warps (the residual projections of a decode step).
// fp8: the weights are E4M3 codes (GemvFp8).
GemvTuning GemvTuningFor(int rows, int out, int in, int sm_count, bool fp8 = false);
// Launched as a programmatic dependent launch on a stream of our own.
bool GemvSupported(int rows, int in);
absl::Status Gemv(DType dtype, GemvEpilogue epilogue, const void* x, const void* w,
                  const void* bias, void* y, int rows, int out, int in, cudaStream_t stream,
                  GemvTuning tuning = {});

// Where GemvQkvCache puts the fused QKV projection: as LaunchQkvRopeCache, q rows into q_out
// (rows, num_heads * head_dim) and k and v into the layer's cache at each row's slot and position,
// q and k rotated when inv_freq is given.
struct QkvCacheArgs {
  void* q_out = nullptr;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  const int32_t* positions = nullptr;
  const int32_t* slots = nullptr;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // even
  int seq_capacity = 0;
  const float* inv_freq = nullptr;  // (head_dim / 2) rotary inverse frequencies; null: no rotation
};
// Gemv with the QKV split, rotary embedding and cache write as its epilogue: the same bits as
// Gemv(kStore) with w (q_dim + 2 kv_dim, in) and bias, then LaunchQkvRopeCache without a bias, in
// one kernel. Each warp computes a rotary pair of rows (i, i + head_dim / 2) of one head.
absl::Status GemvQkvCache(DType dtype, const void* x, const void* w, const void* bias,
                          const QkvCacheArgs& cache, int rows, int in, cudaStream_t stream,
                          GemvTuning tuning = {});

// gemv.cu, FP8 weights: as Gemv and GemvQkvCache with w (out, in) E4M3 codes (8-byte aligned)
// and w_scales (out) fp32, the product taking w[i][k] * w_scales[i]; x, bias and y are `dtype`.
// For kSwiGlu, w and w_scales are (2 * out) rows, gate then up.
absl::Status GemvFp8(DType dtype, GemvEpilogue epilogue, const void* x, const void* w,
                     const float* w_scales, const void* bias, void* y, int rows, int out, int in,
                     cudaStream_t stream, GemvTuning tuning = {});
absl::Status GemvQkvCacheFp8(DType dtype, const void* x, const void* w, const float* w_scales,
                             const void* bias, const QkvCacheArgs& cache, int rows, int in,
                             cudaStream_t stream, GemvTuning tuning = {});

// fp8_dequant.cu: out (rows, cols) `dtype` = E4M3(codes) * row_scales[row], codes (rows, cols),
// row_scales (rows) fp32: FP8 weights for the GEMM of prompts and large batches (dequantized
// into a scratch buffer, then the fp16/bf16 GEMM). 16-bit writes of 8 elements per thread: cols
// a multiple of 8, codes 8-byte and out 16-byte aligned.
absl::Status LaunchDequantizeFp8Rows(DType dtype, const void* codes, const float* row_scales,
                                     void* out, int64_t rows, int64_t cols, cudaStream_t stream);

// sampling.cu: one token per row of logits (rows, vocab) fp32 by the rule of worker/sampling.h.
// probs: scratch of rows * vocab floats. Parameters per row.
struct SamplingArrays {
  const float* temperature;
  const int32_t* top_k;
  const float* top_p;
  const uint64_t* seed;
  const uint64_t* sample_index;
};
absl::Status LaunchSample(const float* logits, float* probs, SamplingArrays params,
                          int32_t* tokens_out, int rows, int vocab, cudaStream_t stream,
                          bool pdl = false);

}  // namespace tandem::cuda
