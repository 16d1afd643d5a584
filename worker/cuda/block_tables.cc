#include "worker/cuda/block_tables.h"

#include <cstdint>

#include "absl/strings/str_cat.h"

namespace tandem::cuda {

absl::Status CheckBlockTables(const StepDescriptor& step, int page_size, int num_pages,
                              int max_seq_pages) {
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const SequenceStep& s = step.seqs[i];
    const int64_t end = int64_t{s.position} + s.num_tokens;
    const int64_t needed = (end + page_size - 1) / page_size;
    const int64_t held = static_cast<int64_t>(s.block_table.size());
    if (held < needed || held > max_seq_pages) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", step.id, ": sequence ", i, " (slot ", s.slot, "): block table of ", held,
          " pages; positions [0, ", end, ") need ", needed, " pages of ", page_size,
          " and a sequence holds at most ", max_seq_pages));
    }
    for (int64_t j = 0; j < held; ++j) {
      const int32_t page = s.block_table[j];
      if (page < 0 || page >= num_pages) {
        return absl::InvalidArgumentError(absl::StrCat(
            "step ", step.id, ": sequence ", i, " (slot ", s.slot, "): block table entry ", j,
            " is page ", page, ", outside the stage's ", num_pages, " pages"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::cuda
