// The CPU stage's KV-cache pool: how many pages a paged cache takes when none is asked for, in
// fp32 and in FP8; an FP8 cache's rounding through the layers' scales.
#include "worker/cpu/cpu_kv_cache.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <vector>

#include "common/fp8_quantize.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

// 2 layers x 4 positions x 8 floats x 4 bytes x 2 (K and V): 512 bytes a page.
CpuKvLayout Paged(int64_t budget_bytes) {
  return {.layers = 2,
          .kv_dim = 8,
          .max_slots = 3,
          .max_seq_len = 10,
          .page_size = 4,
          .num_pages = 0,
          .budget_bytes = budget_bytes};
}

TEST(CpuKvCacheTest, WithoutABudgetAPagedCacheTakesWhatEverySlotsWholeContextNeeds) {
  absl::StatusOr<CpuKvCache> kv = CpuKvCache::Make(Paged(0));
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->layout().num_pages, 3 * 3);  // 3 slots x ceil(10 / 4)
}

TEST(CpuKvCacheTest, ABudgetBoundsThePagesToWhatItHolds) {
  // 5 pages and a half: 5.
  absl::StatusOr<CpuKvCache> kv = CpuKvCache::Make(Paged(5 * 512 + 256));
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->layout().num_pages, 5);
  // Exactly 9 pages' worth, and far more: never more than the slots' contexts need.
  kv = CpuKvCache::Make(Paged(9 * 512));
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->layout().num_pages, 9);
  kv = CpuKvCache::Make(Paged(int64_t{1} << 40));
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->layout().num_pages, 9);
}

TEST(CpuKvCacheTest, ABudgetBelowOnePageIsRefusedNamingBoth) {
  absl::StatusOr<CpuKvCache> kv = CpuKvCache::Make(Paged(511));
  ASSERT_FALSE(kv.ok());
  EXPECT_EQ(kv.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(kv.status().message(), HasSubstr("takes 512 bytes"));
  EXPECT_THAT(kv.status().message(), HasSubstr("budget is 511 bytes"));
}

TEST(CpuKvCacheTest, AGivenPageCountOrContiguousSlotsIgnoreTheBudget) {
  CpuKvLayout given = Paged(1);
  given.num_pages = 7;
  absl::StatusOr<CpuKvCache> kv = CpuKvCache::Make(given);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->layout().num_pages, 7);
  CpuKvLayout slots = Paged(1);
  slots.page_size = 0;
  EXPECT_TRUE(CpuKvCache::Make(slots).ok());
}

// An FP8 cache counts one byte an element: the same budget holds four times the pages of fp32
// (twice those an fp16 cache would hold), and within the slots' needs it takes every one of them.
TEST(CpuKvCacheTest, AnFp8PoolHoldsFourTimesTheFp32PagesOfTheSameBudget) {
  const std::vector<KvScales> scales(2);
  for (int64_t budget : {int64_t{512}, int64_t{5 * 512 + 256}, int64_t{1} << 20}) {
    CpuKvLayout l = Paged(budget);
    l.max_slots = 100000;  // the slots' needs bound neither
    absl::StatusOr<CpuKvCache> fp32 = CpuKvCache::Make(l);
    l.fp8 = true;
    absl::StatusOr<CpuKvCache> fp8 = CpuKvCache::Make(l, scales);
    ASSERT_TRUE(fp32.ok()) << fp32.status();
    ASSERT_TRUE(fp8.ok()) << fp8.status();
    EXPECT_EQ(fp32->layout().num_pages, budget / 512) << budget;
    EXPECT_EQ(fp8->layout().num_pages, budget / 128) << budget;  // 128 bytes an FP8 page
    EXPECT_GE(fp8->layout().num_pages, 4 * fp32->layout().num_pages) << budget;
    EXPECT_EQ(fp8->dtype(), DType::kF8E4M3);
    EXPECT_EQ(fp32->dtype(), DType::kF32);
  }
  // 128 bytes an FP8 page: a budget of 127 holds none.
  CpuKvLayout l = Paged(127);
  l.fp8 = true;
  absl::StatusOr<CpuKvCache> kv = CpuKvCache::Make(l, scales);
  EXPECT_EQ(kv.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(kv.status().message(), HasSubstr("takes 128 bytes"));
}

TEST(CpuKvCacheTest, AnFp8CacheHasAPairOfScalesPerLayerAndOthersNone) {
  CpuKvLayout l = Paged(0);
  l.fp8 = true;
  EXPECT_EQ(CpuKvCache::Make(l, {KvScales{}}).status().code(), absl::StatusCode::kInvalidArgument);
  l.fp8 = false;
  EXPECT_EQ(CpuKvCache::Make(l, {KvScales{}, KvScales{}}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Written K and V are rounded through the layer's scales and read back as code x scale, on pages
// and in slots; what is copied out is the codes.
TEST(CpuKvCacheTest, Fp8RowsAreTheCodesTimesTheLayersScales) {
  for (int page_size : {0, 4}) {
    CpuKvLayout l = Paged(0);
    l.page_size = page_size;
    l.fp8 = true;
    const std::vector<KvScales> scales = {{0.5f, 0.25f}, {0.037f, 3.0f}};
    absl::StatusOr<CpuKvCache> kv = CpuKvCache::Make(l, scales);
    ASSERT_TRUE(kv.ok()) << kv.status();
    const std::vector<int32_t> table =
        page_size > 0 ? std::vector<int32_t>{5, 2} : std::vector<int32_t>{};
    std::vector<float> k(8), v(8);
    for (int pos = 0; pos < 6; ++pos) {
      for (int i = 0; i < 8; ++i) {
        k[i] = 0.1f * (pos + 1) * (i - 3.5f);
        v[i] = 1000.0f * (i - 4);  // saturates
      }
      kv->Write(1, table, 1, pos, k.data(), v.data());
    }
    std::vector<float> k_rows, v_rows;
    const auto [kr, vr] = kv->Rows(1, table, 1, 6, k_rows, v_rows);
    std::vector<uint8_t> k_codes(6 * 8), v_codes(6 * 8);
    kv->Gather(1, table, 1, 6, k_codes.data(), v_codes.data());
    for (int pos = 0; pos < 6; ++pos) {
      for (int i = 0; i < 8; ++i) {
        const float x = 0.1f * (pos + 1) * (i - 3.5f), y = 1000.0f * (i - 4);
        const int at = pos * 8 + i;
        EXPECT_EQ(k_codes[at], EncodeKvE4M3(x, 0.037f)) << pos << " " << i;
        EXPECT_EQ(kr[at], DecodeKvE4M3(EncodeKvE4M3(x, 0.037f), 0.037f)) << pos << " " << i;
        EXPECT_EQ(vr[at], DecodeKvE4M3(EncodeKvE4M3(y, 3.0f), 3.0f)) << pos << " " << i;
      }
    }
    EXPECT_EQ(vr[0], -448.0f * 3.0f);
  }
}

TEST(CpuKvCacheTest, TheHostHasSomeMemoryAvailableAndNoMoreThanItHas) {
  const int64_t available = HostAvailableBytes();
  EXPECT_GT(available, 0);
  EXPECT_LE(available, static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE));
}

}  // namespace
}  // namespace tandem
