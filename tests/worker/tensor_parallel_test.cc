// The Megatron split of a layer's weights: which rows and columns each rank gets, and the
// checks of a tensor-parallel size against a model's heads and MLP width.
#include "worker/tensor_parallel.h"

#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// hidden 2, head_dim 1: 4 query heads, `kv` K/V heads, MLP width 4.
ModelConfig Tiny(Arch arch, int kv) {
  ModelConfig c;
  c.arch = arch;
  c.hidden_size = 2;
  c.intermediate_size = 4;
  c.num_heads = 4;
  c.num_kv_heads = kv;
  c.head_dim = 1;
  return c;
}

// 0, 1, 2, ...: each element names its index.
std::vector<float> Iota(size_t n) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), 0.0f);
  return v;
}

LayerWeights Layer(const ModelConfig& c) {
  const int qkv = c.q_dim() + 2 * c.kv_dim(), hidden = c.hidden_size, inter = c.intermediate_size;
  const bool gated = c.arch == Arch::kLlama;
  LayerWeights w;
  w.attn_norm_w = {7, 8};
  w.wqkv = Iota(static_cast<size_t>(qkv) * hidden);
  w.bqkv = Iota(qkv);
  w.wo = Iota(static_cast<size_t>(hidden) * c.q_dim());
  w.bo = {5, 6};
  w.w_in = Iota(static_cast<size_t>(gated ? 2 * inter : inter) * hidden);
  if (!gated) w.b_in = Iota(inter);
  w.w_out = Iota(static_cast<size_t>(hidden) * inter);
  w.b_out = {3, 4};
  return w;
}

// Llama with 2 K/V heads over 2 ranks: rank 1 holds query heads 2, 3 and K/V head 1; the
// attention output's and the MLP's down columns of its heads and slice; no output biases.
TEST(ShardLayerTest, ColumnParallelRowsAndRowParallelColumnsOfRankOne) {
  const ModelConfig c = Tiny(Arch::kLlama, 2);
  const LayerWeights s = ShardLayer(c, Layer(c), 1, 2);
  // wqkv rows: q 0-3, k 4-5, v 6-7, two columns each.
  EXPECT_THAT(s.wqkv, ElementsAre(4, 5, 6, 7, 10, 11, 14, 15));
  EXPECT_THAT(s.bqkv, ElementsAre(2, 3, 5, 7));
  EXPECT_THAT(s.wo, ElementsAre(2, 3, 6, 7));  // (2, 4): columns 2, 3 of each row
  EXPECT_TRUE(s.bo.empty());
  // w_in: gate rows 0-3, up rows 4-7; rank 1 takes gate 2, 3 and up 6, 7.
  EXPECT_THAT(s.w_in, ElementsAre(4, 5, 6, 7, 12, 13, 14, 15));
  EXPECT_THAT(s.w_out, ElementsAre(2, 3, 6, 7));
  EXPECT_TRUE(s.b_out.empty());
  EXPECT_THAT(s.attn_norm_w, ElementsAre(7, 8));
}

// Rank 0 keeps the row-parallel biases, which the all-reduce then adds once.
TEST(ShardLayerTest, RankZeroKeepsTheOutputBiases) {
  const ModelConfig c = Tiny(Arch::kGpt2, 4);
  const LayerWeights s = ShardLayer(c, Layer(c), 0, 2);
  EXPECT_THAT(s.bo, ElementsAre(5, 6));
  EXPECT_THAT(s.b_out, ElementsAre(3, 4));
  EXPECT_THAT(s.w_in, ElementsAre(0, 1, 2, 3));  // GPT-2's c_fc: rows 0, 1, no up half
  EXPECT_THAT(s.b_in, ElementsAre(0, 1));
}

// One K/V head over 4 ranks: each rank holds that head whole.
TEST(ShardLayerTest, FewerKvHeadsThanRanksAreReplicated) {
  const ModelConfig c = Tiny(Arch::kLlama, 1);
  for (int rank = 0; rank < 4; ++rank) {
    const LayerWeights s = ShardLayer(c, Layer(c), rank, 4);
    // wqkv rows: q 0-3, k 4, v 5.
    EXPECT_THAT(s.wqkv, ElementsAre(2 * rank, 2 * rank + 1, 8, 9, 10, 11)) << "rank " << rank;
  }
  const RankHeads h = HeadsOfRank(Tiny(Arch::kLlama, 2), 3, 4);
  EXPECT_EQ(h.first, 3);
  EXPECT_EQ(h.first_kv, 1);  // query heads 2, 3 read K/V head 1
  EXPECT_EQ(h.kv_count, 1);
  EXPECT_EQ(RankConfig(Tiny(Arch::kLlama, 2), 4).num_kv_heads, 1);
}

TEST(CheckTensorParallelTest, SizesThatDoNotSplitTheModelAreRefusedNamingTheNumbers) {
  EXPECT_TRUE(CheckTensorParallel(Tiny(Arch::kLlama, 2), 4).ok());
  absl::Status heads = CheckTensorParallel(Tiny(Arch::kLlama, 2), 3);
  EXPECT_THAT(heads.message(), HasSubstr("does not divide the model's 4 attention heads"));
  ModelConfig kv3 = Tiny(Arch::kLlama, 2);
  kv3.num_heads = 12;
  kv3.num_kv_heads = 3;
  kv3.intermediate_size = 8;
  EXPECT_THAT(CheckTensorParallel(kv3, 2).message(), HasSubstr("3 key/value heads"));
  ModelConfig mlp = Tiny(Arch::kLlama, 2);
  mlp.intermediate_size = 6;
  EXPECT_THAT(CheckTensorParallel(mlp, 4).message(), HasSubstr("MLP width 6"));
  EXPECT_FALSE(CheckTensorParallel(Tiny(Arch::kLlama, 2), 0).ok());
}

}  // namespace
}  // namespace tandem
