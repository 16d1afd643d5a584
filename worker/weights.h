// One stage's weights in the engine's layout, read from a checkpoint: every matrix row-major
// (out, in), so that y = x · Wᵀ, whatever the architecture stored (GPT-2's Conv1D is transposed
// here). FindStageWeights says where each tensor lies in the memory-mapped checkpoint, in its
// stored dtype; LoadStageWeights reads them as fp32 on the host (the CPU backend); the CUDA backend
// copies the stored bytes to the device and converts there (worker/cuda/weight_upload.h).
// Architectures differ only in which fields are empty.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/safetensors.h"

namespace tandem {

// `Tensor` is what holds one tensor: fp32 values on the host (LayerWeights), where it lies in the
// checkpoint (TensorSource), or a device pointer.
template <typename Tensor>
struct LayerWeightsOf {
  Tensor attn_norm_w;  // (hidden)
  Tensor attn_norm_b;  // (hidden); GPT-2 only, empty for Llama
  Tensor wqkv;         // (q_dim + 2 * kv_dim, hidden): q rows, then k, then v
  Tensor bqkv;         // (q_dim + 2 * kv_dim); GPT-2, Qwen2, Llama attention_bias
  Tensor q_norm_w;     // (head_dim); Qwen3 only: per-head RMSNorm of q, before RoPE
  Tensor k_norm_w;     // (head_dim); Qwen3 only: per-head RMSNorm of k, before RoPE
  Tensor wo;           // (hidden, q_dim)
  Tensor bo;           // (hidden); GPT-2, Llama attention_bias
  Tensor mlp_norm_w;   // (hidden)
  Tensor mlp_norm_b;   // (hidden); GPT-2 only
  // GPT-2: (intermediate, hidden) c_fc. Llama: (2 * intermediate, hidden), gate rows then up rows.
  Tensor w_in;
  Tensor b_in;         // (intermediate); GPT-2 only
  Tensor w_out;        // (hidden, intermediate)
  Tensor b_out;        // (hidden); GPT-2 only
};

template <typename Tensor>
struct StageWeightsOf {
  int first_layer = 0;                // inclusive
  int last_layer = 0;                 // exclusive
  bool has_embedding = false;         // first_layer == 0
  bool has_head = false;              // last_layer == num_layers
  Tensor tok_embedding;               // (vocab, hidden) when has_embedding
  Tensor pos_embedding;               // (max_positions, hidden); GPT-2 and has_embedding
  std::vector<LayerWeightsOf<Tensor>> layers;  // last_layer - first_layer of them
  Tensor final_norm_w;                // (hidden) when has_head
  Tensor final_norm_b;                // (hidden); GPT-2 and has_head
  Tensor lm_head;                     // (vocab, hidden) when has_head (the embedding when tied)
};

// Calls fn(from, to) for every tensor field of `from` and the same field of `to`, in one fixed
// order (embeddings, each layer's fields in declaration order, final norm, head). `to` gets as
// many layers as `from` has and the same range and flags.
template <typename A, typename B, typename Fn>
void ForEachTensor(A& from, StageWeightsOf<B>& to, Fn&& fn) {
  to.first_layer = from.first_layer;
  to.last_layer = from.last_layer;
  to.has_embedding = from.has_embedding;
  to.has_head = from.has_head;
  fn(from.tok_embedding, to.tok_embedding);
  fn(from.pos_embedding, to.pos_embedding);
  to.layers.resize(from.layers.size());
  for (size_t i = 0; i < from.layers.size(); ++i) {
    auto& f = from.layers[i];
    LayerWeightsOf<B>& t = to.layers[i];
    fn(f.attn_norm_w, t.attn_norm_w);
    fn(f.attn_norm_b, t.attn_norm_b);
    fn(f.wqkv, t.wqkv);
    fn(f.bqkv, t.bqkv);
    fn(f.q_norm_w, t.q_norm_w);
    fn(f.k_norm_w, t.k_norm_w);
    fn(f.wo, t.wo);
    fn(f.bo, t.bo);
    fn(f.mlp_norm_w, t.mlp_norm_w);
    fn(f.mlp_norm_b, t.mlp_norm_b);
    fn(f.w_in, t.w_in);
    fn(f.b_in, t.b_in);
    fn(f.w_out, t.w_out);
    fn(f.b_out, t.b_out);
  }
  fn(from.final_norm_w, to.final_norm_w);
  fn(from.final_norm_b, to.final_norm_b);
  fn(from.lm_head, to.lm_head);
}

// Where one engine tensor lies in the mapped checkpoint: checkpoint tensors stacked as row blocks
// (Llama's q, k, v rows), each in its stored dtype. A transposed tensor is one part stored
// (in, out) (GPT-2's Conv1D) that the engine holds as (out, in). The views stay valid while the
// Checkpoint lives.
//
// FP8 parts (dtype kF8E4M3, from a checkpoint whose config has a quantization_config) come with
// their scales: value = fp8 * scale, one scale tensor per part laid out as `quantization.scales`
// says (one value, one per row, or one per block of block_rows x block_cols).
struct TensorSource {
  std::vector<TensorView> parts;
  bool transposed = false;
  std::vector<TensorView> scales;  // one per part when the parts are FP8, else empty
  WeightQuantization quantization;  // how `scales` are laid out
  // The static activation scale (the largest of the parts' input_scale, as one GEMM reads the
  // stacked parts' input); 0: activations are scaled per token at run time.
  float input_scale = 0.0f;

  bool fp8() const { return !scales.empty(); }

  bool empty() const { return parts.empty(); }
  int64_t numel() const;
};

using LayerWeights = LayerWeightsOf<std::vector<float>>;
using StageWeights = StageWeightsOf<std::vector<float>>;
using StageSources = StageWeightsOf<TensorSource>;

// Finds layers [first_layer, last_layer) and, where the range touches them, the embeddings and
// the head, without reading their data. Accepts HF's names with or without the "transformer." /
// "model." prefix. Errors name the tensor and the expected and found shapes, or a tensor of the
// checkpoint that the model as configured would not use.
absl::StatusOr<StageSources> FindStageWeights(Checkpoint& ckpt, int first_layer, int last_layer);

// FindStageWeights, then ReadStageWeights.
absl::StatusOr<StageWeights> LoadStageWeights(Checkpoint& ckpt, int first_layer, int last_layer);

// Every tensor of `sources` as fp32 in the engine's layout, converted on several threads in
// pieces of at most `piece_elements`.
StageWeights ReadStageWeights(const StageSources& sources,
                              int64_t piece_elements = int64_t{1} << 22);

// The source's values as fp32 (numel of them) into `dst`, in the engine's layout (FP8 parts
// multiplied by their scales).
void SourceToFloat(const TensorSource& src, float* dst);

// Rows [first_row, first_row + rows) of the source in the engine's layout, as fp32 (rows x in of
// them; one value per row of a 1-D tensor) into `dst`: what SourceToFloat gives for those rows,
// converting only them.
void SourceRowsToFloat(const TensorSource& src, int64_t first_row, int64_t rows, float* dst);

// Multiplies the FP8 parts' values in `dst` (their E4M3 values, as ToFloat gives them, in the
// engine's layout) by their scales. No-op for a source without FP8 parts.
void ApplyFp8Scales(const TensorSource& src, float* dst);

}  // namespace tandem
