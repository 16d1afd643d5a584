// The host's check of a paged step's block tables: needs no GPU.
#include "worker/cuda/block_tables.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::cuda {
namespace {

// A step of two sequences: one in slot 0 whose table is right, then one in slot 5 at `position`,
// `n` tokens, with `table`.
StepDescriptor TableStep(int position, int n, std::vector<int32_t> table) {
  StepDescriptor d;
  d.id = 9;
  SequenceStep ok;
  ok.slot = 0;
  ok.position = 15;
  ok.block_table = {3};  // position 15 is the last of page 0's 16
  SequenceStep s;
  s.slot = 5;
  s.position = position;
  s.num_tokens = n;
  s.block_table = std::move(table);
  d.seqs = {ok, s};
  return d;
}

// Pages of 16 positions, 10 pages, at most 4 per sequence.
absl::Status Check(const StepDescriptor& d) { return CheckBlockTables(d, 16, 10, 4); }

TEST(BlockTablesTest, TablesHoldingEveryPageTheStepWritesAreAccepted) {
  EXPECT_TRUE(Check(TableStep(0, 16, {9})).ok());           // 16 positions: one page
  EXPECT_TRUE(Check(TableStep(16, 1, {9, 0})).ok());        // position 16 opens page 1
  EXPECT_TRUE(Check(TableStep(40, 2, {1, 2, 3})).ok());
  EXPECT_TRUE(Check(TableStep(40, 2, {1, 2, 3, 4})).ok());  // a page beyond the last is allowed
}

void ExpectRefused(const StepDescriptor& d, const std::string& what) {
  const absl::Status st = Check(d);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << what;
  EXPECT_NE(st.message().find(what), std::string::npos) << st.message();
}

TEST(BlockTablesTest, TooFewPagesAreRefusedNamingTheRowAndWhatItNeeds) {
  ExpectRefused(TableStep(16, 1, {9}),
                "step 9: sequence 1 (slot 5): block table of 1 pages holds 16 positions, 17 need 2");
  ExpectRefused(TableStep(0, 17, {9}), "17 need 2 pages of 16");
  ExpectRefused(TableStep(0, 1, {}), "block table of 0 pages");
}

TEST(BlockTablesTest, MorePagesThanASequenceHoldsAreRefused) {
  ExpectRefused(TableStep(0, 1, {1, 2, 3, 4, 5}),
                "block table of 5 pages is longer than the context of 64 positions (4 pages)");
}

TEST(BlockTablesTest, PagesOutsideThePoolAreRefusedNamingTheEntry) {
  ExpectRefused(TableStep(40, 1, {1, 10, 3}),
                "sequence 1 (slot 5): block table entry 1: page 10 is outside the stage's [0, 10) "
                "pages");
  ExpectRefused(TableStep(40, 1, {1, 2, -1}), "entry 2: page -1");
}

// Two positions of a sequence in one page would overwrite each other in the kernels.
TEST(BlockTablesTest, APageNamedTwiceInATableIsRefusedNamingBothEntries) {
  ExpectRefused(TableStep(40, 1, {1, 2, 1}),
                "sequence 1 (slot 5): block table entries 0 and 2 both name page 1");
  ExpectRefused(TableStep(40, 1, {7, 3, 3, 4}), "entries 1 and 2 both name page 3");
  // The same page in two sequences' tables is sharing (a cached prefix), not a repeat; and a
  // table checked after another with the same pages is not mistaken for a repeat.
  StepDescriptor shared = TableStep(20, 1, {3, 4});
  shared.seqs[0].block_table = {3};
  EXPECT_TRUE(Check(shared).ok());
  EXPECT_TRUE(Check(shared).ok());
}

}  // namespace
}  // namespace tandem::cuda
