// The cpu backend of a worker (cpu_backend.h).
#include "worker/cpu/cpu_backend.h"

#include "worker/cpu/cpu_tensor_parallel.h"

namespace tandem {

absl::StatusOr<std::unique_ptr<Stage>> CpuBackend::MakeStage(const StageSpec& spec) {
  StageSpec s = spec;
  s.quantize_fp8 = s.quantize_fp8 || quantize_fp8_;
  s.kv_memory_fraction = kv_memory_fraction_;
  return MakeCpuTensorParallelStage(s,
                                    s.tensor_parallel > 0 ? s.tensor_parallel : tensor_parallel_);
}

}  // namespace tandem
