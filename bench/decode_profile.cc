#include "bench/decode_profile.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tandem {

DecodeStepTimes PerStep(const CudaDecodeProfile& p) {
  DecodeStepTimes t;
  if (p.steps == 0) return t;
  const double n = static_cast<double>(p.steps);
  t.device_ms = p.device_ms / n;
  t.forward_ms = p.forward_ms / n;
  t.host_ms = p.host_ms / n;
  t.idle_us = p.idle_gaps > 0 ? 1e3 * p.idle_ms / static_cast<double>(p.idle_gaps) : 0;
  t.host_to_launch_us = 1e3 * p.launched_ms / n;
  t.to_first_layer_us = 1e3 * p.start_ms / n;
  t.first_layer_us = 1e3 * p.first_layer_ms / n;
  t.middle_layer_us = 1e3 * p.middle_layers_ms / n;
  t.last_layer_us = 1e3 * p.last_layer_ms / n;
  t.after_layers_us = 1e3 * p.head_ms / n;
  return t;
}

std::string DecodeProfileTable(const std::vector<DecodeProfileRow>& rows) {
  std::string out =
      "Per decode step (--profile): the device's time on the step (from queueing its inputs) and "
      "on its forward pass, in ms; in µs the device idle between the stage's steps, the host's "
      "time from entering Step to the forward pass queued, and the forward pass in parts: to the "
      "first layer (graph launch, embedding), first layer, a middle layer (mean), last layer, "
      "after the layers (norm, LM head, sampling).\n\n"
      "| batch | stage | device ms | forward ms | idle | to launch | to first layer | first | "
      "middle | last | after |\n|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const DecodeProfileRow& r : rows) {
    const DecodeStepTimes t = PerStep(r.profile);
    absl::StrAppend(&out,
                    absl::StrFormat("| %d | %d | %.3f | %.3f | %.1f | %.1f | %.1f | %.1f | "
                                    "%.1f | %.1f | %.1f |\n",
                                    r.batch, r.stage, t.device_ms, t.forward_ms, t.idle_us,
                                    t.host_to_launch_us, t.to_first_layer_us, t.first_layer_us,
                                    t.middle_layer_us, t.last_layer_us, t.after_layers_us));
  }
  return out;
}

}  // namespace tandem
