// A stage's weights from the memory-mapped checkpoint to one device arena, in the stored dtype:
// reader threads copy chunks of the mapped file into a ring of pinned staging buffers while the
// device copies the previous ones in (worker/staged_copy.h); tensors stored in another dtype than
// the device's, and GPT-2's transposed Conv1D matrices, are converted on the device from a
// staging area in device memory (weight_convert.h).
#pragma once

#include <cstddef>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "worker/cuda/cuda_check.h"
#include "worker/weights.h"

namespace tandem::cuda {

struct UploadOptions {
  int threads = 8;                    // reader threads, each with its own stream
  int slots_per_thread = 2;           // staging buffers per thread: one filling, one in flight
  size_t slot_bytes = size_t{16} << 20;  // per staging buffer (and chunk)
};

struct DeviceWeights {
  DeviceBuffer arena;                       // every tensor, 256-byte aligned, in dtype
  StageWeightsOf<const void*> tensors;      // into arena; nullptr where the source is empty
  // FP8: the linear weights (wqkv, wo, w_in, w_out) are E4M3 codes (out, in) in `tensors` and
  // these their per-row fp32 scales (out), also in the arena; nullptr elsewhere and without FP8.
  StageWeightsOf<const float*> scales;
};

// Uploads every tensor of `sources` as `dtype` (kF16 or kBF16) to the current device. With
// `share_head` the LM head is the token embedding (tied and on the same stage) and is not copied
// again. RESOURCE_EXHAUSTED when the arena does not fit; returns once the device holds the data.
// With `fp8` the linear weights are held in FP8 (worker/fp8_weights.h: stored codes where the
// checkpoint has them, else quantized per row on the host); INVALID_ARGUMENT naming the tensor
// for a NaN or infinite weight. FP8 sources need `fp8`.
absl::StatusOr<DeviceWeights> UploadStageWeights(const StageSources& sources, DType dtype,
                                                 bool share_head,
                                                 const UploadOptions& options = {},
                                                 bool fp8 = false);

}  // namespace tandem::cuda
