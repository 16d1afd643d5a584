// KvBlock's checks before a stage imports it (worker/kv_block.cc): a block in host memory must
// hold the bytes its fields say; one in device memory must have both K and V there and nothing in
// host memory; its size counts K and V wherever they are. A block of an FP8 KV-cache carries its
// layers' scales, which must be the importing stage's; no dtype or scale is converted.
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/stage.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

ModelConfig TinyConfig() {
  ModelConfig c;
  c.num_layers = 4;
  c.num_kv_heads = 2;
  c.head_dim = 3;
  return c;
}

// Layers [1, 3), 5 positions, f16, in host memory.
KvBlock HostBlock() { return SizedKvBlock(DType::kF16, 1, 2, 2, 3, 5); }

absl::Status Check(const KvBlock& b) {
  return CheckKvBlock(b, /*slot=*/0, TinyConfig(), DType::kF16, /*first_layer=*/0,
                      /*last_layer=*/4, /*max_slots=*/2, /*max_seq_len=*/8);
}

TEST(KvBlockTest, HostBlocksMustHoldTheBytesTheirFieldsSay) {
  KvBlock b = HostBlock();
  EXPECT_TRUE(Check(b).ok()) << Check(b);
  EXPECT_EQ(b.bytes(), 2 * b.expected_bytes());
  EXPECT_EQ(b.expected_bytes(), size_t{2} * 5 * 2 * 3 * 2);
  b.v.pop_back();
  EXPECT_THAT(Check(b).message(), HasSubstr("bytes of K and"));
}

TEST(KvBlockTest, DeviceBlocksHaveKAndVThereAndNothingInHostMemory) {
  std::vector<uint8_t> memory(2 * HostBlock().expected_bytes());
  std::shared_ptr<uint8_t> all(memory.data(), [](uint8_t*) {});
  KvBlock b = HostBlock();
  b.k.clear();
  b.v.clear();
  b.device_k = all;
  b.device_v = std::shared_ptr<uint8_t>(all, all.get() + memory.size() / 2);
  ASSERT_TRUE(b.on_device());
  EXPECT_TRUE(Check(b).ok()) << Check(b);
  EXPECT_EQ(b.bytes(), memory.size());

  KvBlock only_k = b;
  only_k.device_v.reset();
  EXPECT_THAT(Check(only_k).message(), HasSubstr("not both in device memory"));
  KvBlock both = b;
  both.k.resize(4);
  EXPECT_THAT(Check(both).message(), HasSubstr("with 4 bytes in host memory too"));
  // The other checks come first, wherever the bytes are.
  KvBlock wrong_dims = b;
  wrong_dims.head_dim = 4;
  EXPECT_THAT(Check(wrong_dims).message(), HasSubstr("2 KV heads of 4"));
}

// Layers [1, 3) of a stage of layers [0, 4) whose FP8 KV-cache has these scales.
const std::vector<KvScales> kStageScales = {{0.5f, 0.25f}, {2, 4}, {0.125f, 3}, {6, 0.0625f}};

absl::Status CheckFp8(const KvBlock& b) {
  return CheckKvBlock(b, /*slot=*/0, TinyConfig(), DType::kF8E4M3, /*first_layer=*/0,
                      /*last_layer=*/4, /*max_slots=*/2, /*max_seq_len=*/8, kStageScales);
}

KvBlock Fp8Block() {
  KvBlock b = SizedKvBlock(DType::kF8E4M3, 1, 2, 2, 3, 5);
  b.scales = {kStageScales[1], kStageScales[2]};
  return b;
}

TEST(KvBlockTest, AnFp8BlockCarriesTheStagesScalesOfItsLayers) {
  KvBlock b = Fp8Block();
  EXPECT_EQ(b.expected_bytes(), size_t{2} * 5 * 2 * 3);  // one byte an element
  EXPECT_TRUE(CheckFp8(b).ok()) << CheckFp8(b);

  KvBlock other = b;
  other.scales[1].v = 3.5f;
  absl::Status s = CheckFp8(other);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("layer 2 is F8_E4M3 codes of k_scale 0.125, v_scale 3.5; "
                                     "this stage's KV-cache of that layer holds codes of "
                                     "k_scale 0.125, v_scale 3"));
  other = b;
  other.scales.pop_back();
  EXPECT_THAT(CheckFp8(other).message(),
              HasSubstr("F8_E4M3 with 1 pairs of scales for its 2 layers"));
  // Shifted by a layer: the scales are those of other layers.
  other = b;
  other.first_layer = 0;
  EXPECT_THAT(CheckFp8(other).message(), HasSubstr("layer 0 is F8_E4M3 codes of k_scale 2,"));
}

TEST(KvBlockTest, AStageTakesOnlyBlocksOfItsOwnDtype) {
  // An fp16 block into an FP8 stage, and an FP8 block into an fp16 stage: both named.
  EXPECT_THAT(CheckFp8(HostBlock()).message(),
              HasSubstr("dtype F16, this stage's KV-cache holds F8_E4M3 (no conversion"));
  EXPECT_THAT(Check(Fp8Block()).message(),
              HasSubstr("dtype F8_E4M3, this stage's KV-cache holds F16 (no conversion"));
  KvBlock with_scales = HostBlock();
  with_scales.scales = {{1, 1}, {1, 1}};
  EXPECT_THAT(Check(with_scales).message(),
              HasSubstr("2 pairs of scales on a F16 block; only F8_E4M3 blocks have scales"));
}

// A sequence's block table names distinct pages: one named twice would have two positions
// overwrite each other, so it is refused naming both entries; other sequences may share a page.
TEST(KvBlockTest, BlockTablesNamingAPageTwiceAreRefused) {
  // Pages of 4 positions, 8 pages, a context of 64.
  auto check = [](std::vector<int32_t> table, int positions) {
    return CheckBlockTable(table, positions, 4, 8, 64);
  };
  EXPECT_TRUE(check({4, 1, 7}, 12).ok());
  const absl::Status twice = check({4, 1, 7, 1}, 13);
  EXPECT_EQ(twice.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(twice.message(), HasSubstr("entries 1 and 3 both name page 1"));
  // Pages past those the positions need are checked too: the stage may write them next.
  EXPECT_THAT(check({0, 2, 0}, 4).message(),
              HasSubstr("entries 0 and 2 both name page 0"));
}

}  // namespace
}  // namespace tandem
