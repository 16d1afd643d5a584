// Tensor parallelism within a stage: how a stage's weights split over N ranks of one node
// (Megatron's split, docs/tensor-parallel.md). A pure function of a layer's tensors and
// (rank, ranks); the backends run the ranks and sum their partial outputs (an all-reduce).
//
// Column-parallel (each rank a slice of the output rows): q, k, v (by head) and the MLP's input
// (gate and up, or GPT-2's c_fc, by intermediate column), with their biases. Row-parallel (each
// rank a slice of the input columns, its output a partial sum): the attention output and the
// MLP's down projection; their biases go to rank 0 alone, so that the sum adds them once.
// Replicated: the norms (Qwen3's per-head norms too), the embeddings and the LM head. K/V heads
// fewer than the ranks are replicated: ranks / num_kv_heads ranks share one.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "worker/stage.h"
#include "worker/weights.h"

namespace tandem {

// Whether `c` splits over `ranks`: query heads and the intermediate width divisible by it, and
// K/V heads a multiple of it or a divisor of it. INVALID_ARGUMENT naming the numbers.
absl::Status CheckTensorParallel(const ModelConfig& c, int ranks);

// The model as one rank of `ranks` sees it: num_heads / ranks query heads, its K/V heads
// (num_kv_heads / ranks, at least 1), intermediate_size / ranks; the rest unchanged.
ModelConfig RankConfig(const ModelConfig& c, int ranks);

// The query heads [first, first + count) and the K/V heads [first_kv, first_kv + kv_count) of
// the model that rank `rank` of `ranks` holds.
struct RankHeads {
  int first = 0;
  int count = 0;
  int first_kv = 0;
  int kv_count = 0;
};
RankHeads HeadsOfRank(const ModelConfig& c, int rank, int ranks);

// Rank `rank`'s shard of one layer of model `c` (CheckTensorParallel(c, ranks) OK).
LayerWeights ShardLayer(const ModelConfig& c, const LayerWeights& w, int rank, int ranks);

// Rank `rank`'s shard of a stage: every layer sharded, the embeddings replicated, the final norm
// and LM head on rank 0 alone (it samples; the others end with the hidden states, has_head
// false).
StageWeights ShardStage(const ModelConfig& c, const StageWeights& w, int rank, int ranks);

// A sequence's KV-cache between a split stage and a whole one (moves between tensor-parallel
// groups of different sizes): rank `rank`'s part of `whole`, a host block of all of the model's
// K/V heads, is its K/V heads (HeadsOfRank) at every layer and position; and the whole block is
// the ranks' parts (in rank order, host blocks as RankKvBlock gives them) side by side, a head
// that several ranks hold taken from the first. INVALID_ARGUMENT naming what does not fit: a
// block on a device, heads or head size other than the model's (or the rank's), bytes that do
// not match the fields, parts that disagree in layers, positions or dtype, a count of parts other
// than `ranks`.
absl::StatusOr<KvBlock> RankKvBlock(const ModelConfig& c, const KvBlock& whole, int rank,
                                    int ranks);
absl::StatusOr<KvBlock> WholeKvBlock(const ModelConfig& c, const std::vector<KvBlock>& parts,
                                     int ranks);

// A split stage's ExportKv and ImportKv over its ranks' stages (`c` the whole model's config): the
// ranks' blocks exported and put side by side; a block's heads given to each rank, every part
// made before any rank writes, so that a block that does not fit writes nothing. A rank's error
// is returned naming the rank.
absl::StatusOr<KvBlock> ExportSplitKv(const ModelConfig& c,
                                      const std::vector<std::unique_ptr<Stage>>& ranks,
                                      const KvPlace& place, int positions, int first_layer,
                                      int num_layers);
absl::Status ImportSplitKv(const ModelConfig& c, const std::vector<std::unique_ptr<Stage>>& ranks,
                           const KvPlace& place, const KvBlock& block);
// `st` with "tensor-parallel rank <rank>: " before its message.
absl::Status RankError(size_t rank, const absl::Status& st);

}  // namespace tandem
