// The cpu backend of a worker: stages of the fp32 reference forward on the host (cpu_stage.h),
// nothing on a device.
#pragma once

#include <memory>

#include "worker/backend.h"

namespace tandem {

class CpuBackend final : public Backend {
 public:
  // quantize_fp8: every stage's linear weights quantized to FP8 and computed dequantized
  // (StageSpec::quantize_fp8). tensor_parallel: every stage split over that many thread ranks
  // (cpu_tensor_parallel.h), or over StageSpec::tensor_parallel where set.
  // kv_memory_fraction: StageSpec::kv_memory_fraction of every stage (--kv_memory_fraction).
  explicit CpuBackend(bool quantize_fp8 = false, int tensor_parallel = 1,
                      double kv_memory_fraction = 0.9)
      : quantize_fp8_(quantize_fp8),
        tensor_parallel_(tensor_parallel),
        kv_memory_fraction_(kv_memory_fraction) {}
  absl::StatusOr<std::unique_ptr<Stage>> MakeStage(const StageSpec& spec) override;
  bool has_fp8_kv_cache() const override { return true; }
  int tensor_parallel() const override { return tensor_parallel_; }

 private:
  bool quantize_fp8_;
  int tensor_parallel_;
  double kv_memory_fraction_;
};

}  // namespace tandem
