// The host's check of a step's block tables for the CUDA stage's paged KV-cache (the kernels read
// the pages the tables name without bounds checks of their own).
#pragma once

#include "absl/status/status.h"
#include "common/step.h"

namespace tandem::cuda {

// The block tables of a step's sequences on a stage of `num_pages` pages of `page_size`
// positions, a sequence holding at most `max_seq_pages`: each names the pages of positions
// [0, position + num_tokens), no more than max_seq_pages, each within [0, num_pages).
// INVALID_ARGUMENT naming the step, the sequence (its row and slot) and the entry otherwise.
absl::Status CheckBlockTables(const StepDescriptor& step, int page_size, int num_pages,
                              int max_seq_pages);

}  // namespace tandem::cuda
