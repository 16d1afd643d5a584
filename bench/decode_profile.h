// A CudaDecodeProfile (cuda_stage.h) as means per decode step, and the benchmarks' table of them.
#pragma once

#include <string>
#include <vector>

#include "worker/cuda/cuda_stage.h"

namespace tandem {

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
