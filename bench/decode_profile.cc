#include "bench/decode_profile.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace tandem {

absl::StatusOr<std::unique_ptr<DecodeProfiler>> DecodeProfiler::Create() {
  std::unique_ptr<DecodeProfiler> p(new DecodeProfiler());
  for (cuda::Event* e : {&p->begin_, &p->forward_, &p->layer_[0], &p->layer_[1], &p->layer_[2],
                         &p->head_, &p->forward_end_, &p->end_[0], &p->end_[1]}) {
    RETURN_IF_ERROR(e->Create());
  }
  return p;
}

absl::Status DecodeProfiler::Mark(Point point, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const cuda::Event* e = nullptr;
  switch (point) {
    case Point::kBegin:
      host_begin_ = SteadyClock::now();
      e = &begin_;
      break;
    case Point::kForward: e = &forward_; break;
    case Point::kLayer0: e = &layer_[0]; break;
    case Point::kLayer1: e = &layer_[1]; break;
    case Point::kLastLayer: e = &layer_[2]; break;
    case Point::kHead: e = &head_; break;
    case Point::kForwardEnd:
      host_launched_ = SteadyClock::now();
      e = &forward_end_;
      break;
    case Point::kEnd: e = &end_[1 - last_]; break;
  }
  // Inside a graph's capture the record becomes a node of the graph.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(s, &capture));
  CUDA_CHECK(cudaEventRecordWithFlags(
      e->get(), s,
      capture == cudaStreamCaptureStatusActive ? cudaEventRecordExternal : cudaEventRecordDefault));
  return absl::OkStatus();
}

void DecodeProfiler::DecodeDone(int layers) {
  using Ms = std::chrono::duration<double, std::milli>;
  const auto elapsed = [](const cuda::Event& a, const cuda::Event& b) {
    float ms = 0;
    cudaEventElapsedTime(&ms, a.get(), b.get());
    return static_cast<double>(ms);
  };
  const int end = 1 - last_;
  profile_.steps += 1;
  profile_.host_ms += Ms(SteadyClock::now() - host_begin_).count();
  profile_.launched_ms += Ms(host_launched_ - host_begin_).count();
  profile_.device_ms += elapsed(begin_, end_[end]);
  profile_.forward_ms += elapsed(forward_, forward_end_);
  if (layers >= 3) {
    profile_.start_ms += elapsed(forward_, layer_[0]);
    profile_.first_layer_ms += elapsed(layer_[0], layer_[1]);
    profile_.middle_layers_ms += elapsed(layer_[1], layer_[2]) / (layers - 2);
    profile_.last_layer_ms += elapsed(layer_[2], head_);
    profile_.head_ms += elapsed(head_, forward_end_);
  }
  if (after_decode_) {
    profile_.idle_ms += elapsed(end_[last_], begin_);
    profile_.idle_gaps += 1;
  }
  last_ = end;
  after_decode_ = true;
}

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
