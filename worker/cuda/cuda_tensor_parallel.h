// A CUDA stage split over N GPUs of one node (docs/tensor-parallel.md): rank r a CUDA stage on
// device first_device + r over its shard of the layers (worker/tensor_parallel.h), the ranks'
// row-parallel outputs summed by an in-process NCCL all-reduce on each rank's stream, twice a
// layer (inside the decode graphs too). The worker sees one stage: Step runs every rank on the
// step, each on its own thread, and returns rank 0's output.
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/cuda/cuda_stage.h"
#include "worker/stage.h"

namespace tandem {

// OK when devices [first_device, first_device + ranks) exist; FAILED_PRECONDITION naming how
// many there are otherwise.
absl::Status CheckTensorParallelDevices(int first_device, int ranks);

// `spec`'s stage over `ranks` GPUs from options.device on (1: MakeCudaStage). Every rank holds
// the embeddings, the final norm and the LM head and samples alike (their residual streams are
// the same bits after each all-reduce); rank 0's tokens are returned. INVALID_ARGUMENT where the
// model does not split over `ranks` (CheckTensorParallel), has biases on the row-parallel
// projections (GPT-2, attention_bias) or FP8 weights. KV-cache moves (ExportKv, ImportKv,
// OpenKvOut) are UNIMPLEMENTED with more than one rank.
absl::StatusOr<std::unique_ptr<Stage>> MakeCudaTensorParallelStage(const StageSpec& spec,
                                                                   const CudaOptions& options,
                                                                   int ranks);

}  // namespace tandem
