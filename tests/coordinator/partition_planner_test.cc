#include "coordinator/partition_planner.h"

#include "gtest/gtest.h"

namespace tandem {
namespace {

TEST(PartitionPlannerTest, SplitsEvenlyWithExtraLayersOnTheFirstStages) {
  absl::StatusOr<std::vector<LayerRange>> p = PlanEvenPartition(26, 2);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*p, (std::vector<LayerRange>{{0, 13}, {13, 26}}));
  p = PlanEvenPartition(4, 3);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*p, (std::vector<LayerRange>{{0, 2}, {2, 3}, {3, 4}}));
  p = PlanEvenPartition(7, 1);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*p, (std::vector<LayerRange>{{0, 7}}));
}

TEST(PartitionPlannerTest, RangesCoverEveryLayerOnceInOrder) {
  for (int layers = 1; layers <= 40; ++layers) {
    for (int stages = 1; stages <= layers; ++stages) {
      absl::StatusOr<std::vector<LayerRange>> p = PlanEvenPartition(layers, stages);
      ASSERT_TRUE(p.ok());
      ASSERT_EQ(static_cast<int>(p->size()), stages);
      int next = 0, smallest = layers, largest = 0;
      for (const LayerRange& r : *p) {
        EXPECT_EQ(r.first, next);
        EXPECT_GT(r.last, r.first);
        smallest = std::min(smallest, r.last - r.first);
        largest = std::max(largest, r.last - r.first);
        next = r.last;
      }
      EXPECT_EQ(next, layers);
      EXPECT_LE(largest - smallest, 1);
    }
  }
}

TEST(PartitionPlannerTest, RejectsMoreStagesThanLayersAndNonPositiveCounts) {
  EXPECT_EQ(PlanEvenPartition(4, 5).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanEvenPartition(4, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanEvenPartition(0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(PlanEvenPartition(4, 5).status().message().find("stages"), std::string::npos);
}

}  // namespace
}  // namespace tandem
