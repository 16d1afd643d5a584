// The host's check of a step's block tables for the CUDA stage's paged KV-cache (the kernels read
// the pages the tables name without bounds checks of their own).
#pragma once

#include "absl/status/status.h"
#include "common/step.h"

namespace tandem::cuda {

// The block tables of a step's sequences on a stage of `num_pages` pages of `page_size`
// positions, a sequence holding at most `max_seq_pages`: each as CheckBlockTable (worker/stage.h)
// checks it for positions [0, position + num_tokens). INVALID_ARGUMENT naming the step and the
// sequence (its row and slot), then what CheckBlockTable names.
absl::Status CheckBlockTables(const StepDescriptor& step, int page_size, int num_pages,
                              int max_seq_pages);

}  // namespace tandem::cuda
