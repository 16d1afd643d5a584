// The Megatron split of a layer's weights: which rows and columns each rank gets, and the
// checks of a tensor-parallel size against a model's heads and MLP width.
#include "worker/tensor_parallel.h"

#include <cstring>
#include <memory>
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

// A host block of `kv` K/V heads of head_dim 1 (f32), 2 layers x 3 positions: element (row, head)
// holds 10 * row + head.
KvBlock Block(int kv, float salt = 0.0f) {
  KvBlock b;
  b.dtype = DType::kF32;
  b.first_layer = 1;
  b.num_layers = 2;
  b.num_kv_heads = kv;
  b.head_dim = 1;
  b.positions = 3;
  std::vector<float> k, v;
  for (int row = 0; row < 6; ++row) {
    for (int h = 0; h < kv; ++h) {
      k.push_back(10.0f * row + h + salt);
      v.push_back(-10.0f * row - h - salt);
    }
  }
  b.k.resize(k.size() * 4);
  b.v.resize(v.size() * 4);
  std::memcpy(b.k.data(), k.data(), b.k.size());
  std::memcpy(b.v.data(), v.data(), b.v.size());
  return b;
}

std::vector<float> Floats(const std::vector<uint8_t>& bytes) {
  std::vector<float> f(bytes.size() / 4);
  std::memcpy(f.data(), bytes.data(), bytes.size());
  return f;
}

// Rank r of 2 over 2 K/V heads holds head r of every layer and position; the ranks' parts side by
// side are the block again.
TEST(KvBlockSplitTest, EachRankTakesItsHeadsAndThePartsMakeTheWhole) {
  const ModelConfig c = Tiny(Arch::kLlama, 2);
  const KvBlock whole = Block(2);
  std::vector<KvBlock> parts;
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<KvBlock> p = RankKvBlock(c, whole, r, 2);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->num_kv_heads, 1);
    EXPECT_EQ(p->first_layer, 1);
    EXPECT_EQ(p->positions, 3);
    const float f = static_cast<float>(r);
    EXPECT_THAT(Floats(p->k), ElementsAre(f, 10 + f, 20 + f, 30 + f, 40 + f, 50 + f));
    EXPECT_THAT(Floats(p->v), ElementsAre(-f, -10 - f, -20 - f, -30 - f, -40 - f, -50 - f));
    parts.push_back(*std::move(p));
  }
  absl::StatusOr<KvBlock> back = WholeKvBlock(c, parts, 2);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->num_kv_heads, 2);
  EXPECT_EQ(back->k, whole.k);
  EXPECT_EQ(back->v, whole.v);
}

// 2 K/V heads over 4 ranks: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1; the whole block
// takes each head from the first rank that holds it.
TEST(KvBlockSplitTest, ReplicatedHeadsComeFromTheFirstRankThatHoldsThem) {
  const ModelConfig c = Tiny(Arch::kLlama, 2);
  const KvBlock whole = Block(2);
  std::vector<KvBlock> parts;
  for (int r = 0; r < 4; ++r) {
    absl::StatusOr<KvBlock> p = RankKvBlock(c, whole, r, 4);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(Floats(p->k)[0], r < 2 ? 0.0f : 1.0f) << "rank " << r;
    parts.push_back(*std::move(p));
  }
  parts[1] = *RankKvBlock(c, Block(2, 0.5f), 1, 4);  // a replica that differs: not read
  parts[3] = *RankKvBlock(c, Block(2, 0.5f), 3, 4);
  absl::StatusOr<KvBlock> back = WholeKvBlock(c, parts, 4);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->k, whole.k);
  EXPECT_EQ(back->v, whole.v);
}

// A rank's block has the whole block's header (here FP8 codes with their per-layer scales) and
// memory for its own heads only, not a copy of the whole block's; the parts side by side have the
// header again.
TEST(KvBlockSplitTest, ARanksBlockKeepsTheHeaderAndHoldsOnlyItsHeadsBytes) {
  const ModelConfig c = Tiny(Arch::kLlama, 2);
  KvBlock whole;
  whole.dtype = DType::kF8E4M3;
  whole.first_layer = 1;
  whole.num_layers = 2;
  whole.num_kv_heads = 2;
  whole.head_dim = 1;
  whole.positions = 3;
  whole.scales = {{0.5f, 0.25f}, {2.0f, 4.0f}};
  for (uint8_t i = 0; i < 12; ++i) {
    whole.k.push_back(i);
    whole.v.push_back(static_cast<uint8_t>(100 + i));
  }
  std::vector<KvBlock> parts;
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<KvBlock> p = RankKvBlock(c, whole, r, 2);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->version, whole.version);
    EXPECT_EQ(p->dtype, DType::kF8E4M3);
    EXPECT_EQ(p->first_layer, 1);
    EXPECT_EQ(p->num_layers, 2);
    EXPECT_EQ(p->head_dim, 1);
    EXPECT_EQ(p->positions, 3);
    EXPECT_EQ(p->scales, whole.scales);
    const uint8_t h = static_cast<uint8_t>(r);
    EXPECT_THAT(p->k, ElementsAre(h, 2 + h, 4 + h, 6 + h, 8 + h, 10 + h));
    EXPECT_THAT(p->v, ElementsAre(100 + h, 102 + h, 104 + h, 106 + h, 108 + h, 110 + h));
    EXPECT_LT(p->k.capacity(), whole.k.size()) << "rank " << r << " holds the whole block's K";
    EXPECT_LT(p->v.capacity(), whole.v.size()) << "rank " << r << " holds the whole block's V";
    parts.push_back(*std::move(p));
  }
  absl::StatusOr<KvBlock> back = WholeKvBlock(c, parts, 2);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->dtype, DType::kF8E4M3);
  EXPECT_EQ(back->first_layer, 1);
  EXPECT_EQ(back->num_layers, 2);
  EXPECT_EQ(back->positions, 3);
  EXPECT_EQ(back->scales, whole.scales);
  EXPECT_EQ(back->k, whole.k);
  EXPECT_EQ(back->v, whole.v);
}

TEST(KvBlockSplitTest, BlocksThatDoNotFitAreRefusedNamingWhy) {
  const ModelConfig c = Tiny(Arch::kLlama, 2);
  KvBlock b = Block(2);
  b.num_kv_heads = 1;  // bytes of 2 heads
  EXPECT_THAT(RankKvBlock(c, b, 0, 2).status().message(),
              HasSubstr("1 K/V heads of 1, expected 2"));
  b = Block(2);
  b.k.pop_back();
  EXPECT_THAT(RankKvBlock(c, b, 0, 2).status().message(), HasSubstr("bytes of K and V"));
  b = Block(2);
  b.device_k = std::shared_ptr<uint8_t>(new uint8_t[1], std::default_delete<uint8_t[]>());
  EXPECT_THAT(RankKvBlock(c, b, 0, 2).status().message(), HasSubstr("device memory"));

  std::vector<KvBlock> parts = {*RankKvBlock(c, Block(2), 0, 2), *RankKvBlock(c, Block(2), 1, 2)};
  EXPECT_THAT(WholeKvBlock(c, parts, 4).status().message(), HasSubstr("2 parts from 4 ranks"));
  parts[1].positions = 2;
  parts[1].k.resize(parts[1].expected_bytes());
  parts[1].v.resize(parts[1].expected_bytes());
  const absl::Status st = WholeKvBlock(c, parts, 2).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("rank 1: layers [1, 3), 2 positions"));
  parts[1] = *RankKvBlock(c, Block(2), 0, 2);
  parts[1].num_kv_heads = 2;  // rank 1 holds one head
  EXPECT_THAT(WholeKvBlock(c, parts, 2).status().message(), HasSubstr("expected 1 of 1"));
}

}  // namespace
}  // namespace tandem
