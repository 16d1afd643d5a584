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
                "step 9: sequence 1 (slot 5): block table of 1 pages; positions [0, 17) need 2");
  ExpectRefused(TableStep(0, 17, {9}), "positions [0, 17) need 2 pages of 16");
  ExpectRefused(TableStep(0, 1, {}), "block table of 0 pages");
}

TEST(BlockTablesTest, MorePagesThanASequenceHoldsAreRefused) {
  ExpectRefused(TableStep(0, 1, {1, 2, 3, 4, 5}), "at most 4");
}

TEST(BlockTablesTest, PagesOutsideThePoolAreRefusedNamingTheEntry) {
  ExpectRefused(TableStep(40, 1, {1, 10, 3}),
                "sequence 1 (slot 5): block table entry 1 is page 10, outside the stage's 10 "
                "pages");
  ExpectRefused(TableStep(40, 1, {1, 2, -1}), "entry 2 is page -1");
}

}  // namespace
}  // namespace tandem::cuda
