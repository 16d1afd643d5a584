// The decode profile of the benchmarks' --profile: a DecodeProfiler observes a CUDA stage's decode
// steps (DecodeObserver, cuda_stage.h) with CUDA events and sums what the device and the host
// spend on them (CudaDecodeProfile); PerStep and DecodeProfileTable turn the sums into means per
// step and a table.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/cuda_stage.h"

namespace tandem {

// Summed over the decode steps a DecodeProfiler saw.
struct CudaDecodeProfile {
  int64_t steps = 0;
  double host_ms = 0;      // in Stage::Step
  double launched_ms = 0;  // from entering Step until the forward pass is queued
  double device_ms = 0;    // on the device: from the step's first copy to its last
  double forward_ms = 0;   // of which the forward pass (layers, head, sampling)
  double idle_ms = 0;      // device time from the end of one decode step to the next one's start
  int64_t idle_gaps = 0;   // how many such gaps idle_ms sums (decode steps right after another)
  // The forward pass in parts (stages of 3 layers or more): from its start to the first layer's
  // (the graph's launch, the embedding), the first layer, a middle layer (mean), the last layer,
  // and what follows it (final norm, LM head, sampling).
  double start_ms = 0, first_layer_ms = 0, middle_layers_ms = 0, last_layer_ms = 0, head_ms = 0;
};

// Times a stage's decode steps with CUDA events at each DecodeObserver::Point. Set it on the stage
// before its first step (Stage::SetDecodeObserver) and keep it alive as long as the stage.
class DecodeProfiler final : public DecodeObserver {
 public:
  static absl::StatusOr<std::unique_ptr<DecodeProfiler>> Create();
  absl::Status Mark(Point point, void* stream) override;
  void DecodeDone(int layers) override;
  void OtherStep() override { after_decode_ = false; }
  // The sums since the last call, and a fresh start.
  CudaDecodeProfile Take() { return std::exchange(profile_, CudaDecodeProfile{}); }

 private:
  DecodeProfiler() = default;
  using SteadyClock = std::chrono::steady_clock;
  // One event per point; the step's end alternates between two, so that the previous step's end
  // (where the idle gap starts) is still there.
  cuda::Event begin_, forward_, layer_[3], head_, forward_end_, end_[2];
  int last_ = 0;               // end_[last_]: the previous decode step's end
  bool after_decode_ = false;  // the previous step was a decode step
  SteadyClock::time_point host_begin_, host_launched_;
  CudaDecodeProfile profile_;
};

// Means per decode step (idle: per gap between consecutive decode steps); zeros without steps.
struct DecodeStepTimes {
  double device_ms = 0, forward_ms = 0, host_ms = 0;
  double idle_us = 0, host_to_launch_us = 0;
  // The forward pass in parts: to the first layer's start (graph launch, embedding), the first
  // layer, a middle layer, the last layer, and after the layers (final norm, LM head, sampling).
  double to_first_layer_us = 0, first_layer_us = 0, middle_layer_us = 0, last_layer_us = 0;
  double after_layers_us = 0;
};

DecodeStepTimes PerStep(const CudaDecodeProfile& p);

struct DecodeProfileRow {
  int batch = 0;
  int stage = 0;
  CudaDecodeProfile profile;
};

// A Markdown table (with its legend) of the rows' per-step means, one line per row.
std::string DecodeProfileTable(const std::vector<DecodeProfileRow>& rows);

}  // namespace tandem
