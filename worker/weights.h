// One stage's weights in the engine's layout, read from a checkpoint: every matrix row-major
// (out, in), so that y = x · Wᵀ, whatever the architecture stored (GPT-2's Conv1D is transposed
// here). fp32 on the host; backends convert and upload. Architectures differ only in which fields
// are empty.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/safetensors.h"

namespace tandem {

struct LayerWeights {
  std::vector<float> attn_norm_w;  // (hidden)
  std::vector<float> attn_norm_b;  // (hidden); GPT-2 only, empty for Llama
  std::vector<float> wqkv;         // (q_dim + 2 * kv_dim, hidden): q rows, then k, then v
  std::vector<float> bqkv;         // (q_dim + 2 * kv_dim); GPT-2 only
  std::vector<float> wo;           // (hidden, q_dim)
  std::vector<float> bo;           // (hidden); GPT-2 only
  std::vector<float> mlp_norm_w;   // (hidden)
  std::vector<float> mlp_norm_b;   // (hidden); GPT-2 only
  // GPT-2: (intermediate, hidden) c_fc. Llama: (2 * intermediate, hidden), gate rows then up rows.
  std::vector<float> w_in;
  std::vector<float> b_in;         // (intermediate); GPT-2 only
  std::vector<float> w_out;        // (hidden, intermediate)
  std::vector<float> b_out;        // (hidden); GPT-2 only
};

struct StageWeights {
  int first_layer = 0;                // inclusive
  int last_layer = 0;                 // exclusive
  bool has_embedding = false;         // first_layer == 0
  bool has_head = false;              // last_layer == num_layers
  std::vector<float> tok_embedding;   // (vocab, hidden) when has_embedding
  std::vector<float> pos_embedding;   // (max_positions, hidden); GPT-2 and has_embedding
  std::vector<LayerWeights> layers;   // last_layer - first_layer of them
  std::vector<float> final_norm_w;    // (hidden) when has_head
  std::vector<float> final_norm_b;    // (hidden); GPT-2 and has_head
  std::vector<float> lm_head;         // (vocab, hidden) when has_head (a copy when tied)
};

// Reads layers [first_layer, last_layer) and, where the range touches them, the embeddings and
// the head. Only those tensors are read. Accepts HF's names with or without the "transformer." /
// "model." prefix. Errors name the tensor and the expected and found shapes.
absl::StatusOr<StageWeights> LoadStageWeights(Checkpoint& ckpt, int first_layer, int last_layer);

}  // namespace tandem
