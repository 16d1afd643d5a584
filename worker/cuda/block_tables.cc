#include "worker/cuda/block_tables.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "worker/stage.h"

namespace tandem::cuda {

absl::Status CheckBlockTables(const StepDescriptor& step, int page_size, int num_pages,
                              int max_seq_pages) {
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const SequenceStep& s = step.seqs[i];
    const absl::Status st =
        CheckBlockTable(s.block_table, int64_t{s.position} + s.num_tokens, page_size, num_pages,
                        max_seq_pages * page_size);
    if (!st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("step ", step.id, ": sequence ", i, " (slot ",
                                                     s.slot, "): ", st.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::cuda
