// The GPU backend: fp16/bf16 weights and activations with fp32 accumulation, cuBLAS(Lt) GEMMs,
// kernels of our own for the rest, decode steps replayed from CUDA graphs.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "worker/stage.h"

namespace tandem {

struct CudaOptions {
  int device = 0;
  DType dtype = DType::kF16;       // kF16 or kBF16: weights, activations and KV-cache
  float kv_memory_fraction = 0.9f; // share of the memory left after the weights for the KV-cache
  bool cuda_graphs = true;         // replay decode steps from graphs per batch-size bucket
  // Forward passes of at most this many rows (1, 2, 4 or 8) use the fused GEMV kernels of
  // gemv.cu for every projection instead of cuBLAS; 0 uses cuBLAS throughout. At 8 rows cuBLAS
  // was faster on an H100 (docs/performance.md).
  int gemv_max_rows = 4;
  // Batch-invariant: a sequence's results do not depend on the other sequences of its batch (or
  // on how the batch is split into micro-batches and stages), so greedy outputs are the same at
  // every batch size and node count. Every projection goes through one cuBLASLt algorithm pinned
  // per shape without split-K (cuda::FixedAlgoGemm), the GEMV kernels are not used, and attention
  // never splits a row's keys. Slower at small batches (docs/performance.md).
  bool batch_invariant = false;
  // Rows of one forward pass for prompts (at least 1024 and the largest decode bucket): longer
  // steps run in chunks of this many rows. Larger chunks give the projections larger GEMMs.
  int prefill_rows = 8192;
};

// Watches a CUDA stage's decode steps from inside, for measurements (bench/decode_profile.h
// times them with CUDA events; Stage::SetDecodeObserver installs it). Called on the thread that
// runs the step. Mark queues work on the stage's stream at that point of the step, also while a
// decode step's graph is captured (then as a node of the graph, replayed with it: what it records
// must outlive the stage's graphs).
class DecodeObserver {
 public:
  // In a decode step's order: its start (before its inputs are copied), the forward pass's start,
  // the starts of the first, second and last layer, of what follows the layers (norm, LM head,
  // sampling), the forward pass's end, the step's end (after its outputs are queued).
  enum class Point { kBegin, kForward, kLayer0, kLayer1, kLastLayer, kHead, kForwardEnd, kEnd };
  virtual ~DecodeObserver() = default;
  virtual absl::Status Mark(Point point, void* stream) = 0;
  // After the host has waited for a decode step of a stage of `layers` layers.
  virtual void DecodeDone(int layers) = 0;
  // After any other step (prompts, chunks): the next decode step follows no decode step.
  virtual void OtherStep() = 0;
};

// `bytes` of device memory of CUDA device `device`, freed (on that device) when the last owner,
// aliases included, lets go.
absl::StatusOr<std::shared_ptr<uint8_t>> SharedDeviceBytes(int device, size_t bytes);

// `block` in host memory: a copy of one in device memory (Stage::ExportKvToDevice), or itself.
absl::StatusOr<KvBlock> KvBlockToHost(const KvBlock& block);

// True when a usable CUDA device is present (tests skip otherwise).
bool CudaDeviceAvailable();

// The UUID of CUDA device `device` as NVML and nvidia-smi write it ("GPU-xxxxxxxx-xxxx-...").
absl::StatusOr<std::string> CudaDeviceUuid(int device);

absl::StatusOr<std::unique_ptr<Stage>> MakeCudaStage(const StageSpec& spec,
                                                     const CudaOptions& options);
// The weights of `spec`'s layers that `spec.placed` lacks (arenas of this checkpoint directory,
// options.dtype and options.device), placed in the device's memory now as one arena, for a later
// MakeCudaStage to take (StageSpec::placed) instead of loading them then; null when nothing is
// lacking. A stage running meanwhile is not disturbed (but for the copies' share of the device).
// RESOURCE_EXHAUSTED when they do not fit; INVALID_ARGUMENT for layers outside the model.
absl::StatusOr<std::shared_ptr<const PlacedWeights>> PlaceCudaWeights(const StageSpec& spec,
                                                                     const CudaOptions& options);

}  // namespace tandem
