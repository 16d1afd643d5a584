// The CPU stage's KV-cache pool: how many pages a paged cache takes when none is asked for.
#include "worker/cpu/cpu_kv_cache.h"

#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tandem {
namespace {

using ::testing::HasSubstr;

// 2 layers x 4 positions x 8 floats x 4 bytes x 2 (K and V): 512 bytes a page.
CpuKvLayout Paged(int64_t budget_bytes) {
  return {.layers = 2, .kv_dim = 8, .max_slots = 3, .max_seq_len = 10, .page_size = 4,
          .num_pages = 0, .budget_bytes = budget_bytes};
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

TEST(CpuKvCacheTest, TheHostHasSomeMemoryAvailableAndNoMoreThanItHas) {
  const int64_t available = HostAvailableBytes();
  EXPECT_GT(available, 0);
  EXPECT_LE(available, static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE));
}

}  // namespace
}  // namespace tandem
