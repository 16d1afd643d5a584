// The GEMV kernels alone on a model's decode projections, for every launch shape
// (cuda::GemvTuning), so that the per-shape choice (cuda::GemvTuningFor) rests on measurements.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "common/model_config.h"

namespace tandem {

// For each projection of `config` (QKV, out, MLP in, MLP out, LM head) and each row count of
// `rows` (1, 2, 4 or 8): µs per GEMV and GB/s of weights, per rows-per-warp and K split, and the
// shape's own choice. Each GEMV reads weights no earlier launch left in L2 (a ring of copies) and
// follows a one-row norm kernel, as in a decode step; both are replayed from a CUDA graph, and
// the norm kernels' own time is measured alone and subtracted. Markdown rows on stdout; with
// `json_path`, the same as JSON. fp8: the weights as E4M3 codes with a scale per row (GemvFp8),
// every launch shape also with 8 and 16 codes per lane; the LM head stays `dtype`, as the stage
// keeps it.
absl::Status RunGemvSweep(const ModelConfig& config, DType dtype, bool fp8,
                          const std::vector<int>& rows, const std::string& json_path);

}  // namespace tandem
