// Where a new stage's layers come from in a move (coordinator/kv_move.h KvSourcesFor): the part of
// each old stage's layers that the new stage holds, in layer order, with no address where the old
// stage is the same worker (its own stash), and nothing from old stages it shares no layer with.
#include <vector>

#include "coordinator/kv_move.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

KvStage Stage(int64_t worker, int first, int last) {
  return {.worker = worker,
          .address = "10.0.0." + std::to_string(worker) + ":50060",
          .layers = {first, last}};
}

struct Source {
  std::string address;
  int first = 0;
  int layers = 0;
  bool operator==(const Source&) const = default;
};

std::vector<Source> SourcesFor(const KvStage& taker, const std::vector<KvStage>& holders) {
  std::vector<Source> out;
  for (const v1::KvSource& s : KvSourcesFor(taker, holders)) {
    out.push_back({s.address(), s.first_layer(), s.num_layers()});
  }
  return out;
}

TEST(KvSourcesTest, OneStageSplitInTwoTakesItsHalfFromTheOldStage) {
  const std::vector<KvStage> old = {Stage(1, 0, 26)};
  // Worker 1 keeps the first half (its own stash), worker 2 fetches the second from worker 1.
  EXPECT_EQ(SourcesFor(Stage(1, 0, 13), old), (std::vector<Source>{{"", 0, 13}}));
  EXPECT_EQ(SourcesFor(Stage(2, 13, 26), old),
            (std::vector<Source>{{"10.0.0.1:50060", 13, 13}}));
}

TEST(KvSourcesTest, TwoStagesJoinedTakeEachPartInLayerOrder) {
  // Listed out of order on purpose: the sources come in layer order.
  const std::vector<KvStage> old = {Stage(2, 13, 26), Stage(1, 0, 13)};
  EXPECT_EQ(SourcesFor(Stage(1, 0, 26), old),
            (std::vector<Source>{{"", 0, 13}, {"10.0.0.2:50060", 13, 13}}));
}

TEST(KvSourcesTest, UnevenSplitsTakeOnlyTheOverlapAndSkipTheRest) {
  const std::vector<KvStage> old = {Stage(1, 0, 9), Stage(2, 9, 18), Stage(3, 18, 26)};
  // A stage of [7, 20) overlaps all three by 2, 9 and 2 layers.
  EXPECT_EQ(SourcesFor(Stage(4, 7, 20), old),
            (std::vector<Source>{{"10.0.0.1:50060", 7, 2},
                                 {"10.0.0.2:50060", 9, 9},
                                 {"10.0.0.3:50060", 18, 2}}));
  // Touching at a boundary is no overlap: [9, 18) takes nothing from [0, 9) or [18, 26).
  EXPECT_EQ(SourcesFor(Stage(2, 9, 18), old), (std::vector<Source>{{"", 9, 9}}));
}

}  // namespace
}  // namespace tandem
