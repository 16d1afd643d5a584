#include "coordinator/kv_slots.h"

#include "gtest/gtest.h"

namespace tandem {
namespace {

TEST(KvSlotAllocatorTest, HandsOutEverySlotOnceThenNothing) {
  KvSlotAllocator a(3);
  EXPECT_EQ(a.Allocate(), 0);
  EXPECT_EQ(a.Allocate(), 1);
  EXPECT_EQ(a.Allocate(), 2);
  EXPECT_EQ(a.Allocate(), std::nullopt);
  EXPECT_EQ(a.used(), 3);
  EXPECT_EQ(a.free(), 0);
}

TEST(KvSlotAllocatorTest, FreedSlotIsReusedLowestFirst) {
  KvSlotAllocator a(4);
  for (int i = 0; i < 4; ++i) a.Allocate();
  EXPECT_TRUE(a.Free(2));
  EXPECT_TRUE(a.Free(1));
  EXPECT_EQ(a.free(), 2);
  EXPECT_EQ(a.Allocate(), 1);
  EXPECT_EQ(a.Allocate(), 2);
  EXPECT_EQ(a.Allocate(), std::nullopt);
}

TEST(KvSlotAllocatorTest, FreeingAFreeOrUnknownSlotChangesNothing) {
  KvSlotAllocator a(2);
  a.Allocate();
  EXPECT_FALSE(a.Free(1));
  EXPECT_FALSE(a.Free(-1));
  EXPECT_FALSE(a.Free(2));
  EXPECT_TRUE(a.Free(0));
  EXPECT_FALSE(a.Free(0));
  EXPECT_EQ(a.used(), 0);
}

TEST(KvSlotAllocatorTest, ZeroOrNegativeCapacityHasNoSlots) {
  KvSlotAllocator a(-3);
  EXPECT_EQ(a.capacity(), 0);
  EXPECT_EQ(a.Allocate(), std::nullopt);
}

}  // namespace
}  // namespace tandem
