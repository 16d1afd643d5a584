// The cuda backend of a worker: stages on one GPU (cuda_stage.h), weights placed ahead of an
// assignment, and NCCL for the pipeline's activations and for KV-cache moves between GPUs.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "worker/backend.h"
#include "worker/cuda/cuda_stage.h"

namespace tandem {

struct CudaBackendOptions {
  CudaOptions stage;  // the device, the dtype and the rest of every stage's options
  // Each wait of the pipeline's NCCL link on a peer; joining a KV link waits at most this and
  // 60 s.
  absl::Duration recv_timeout = absl::Seconds(60);
  bool kv_over_nccl = false;  // KV-cache moves between GPUs over NCCL (Backend::has_kv_link)
  bool quantize_fp8 = false;  // every stage's linear weights in FP8 (StageSpec::quantize_fp8)
  // Every stage split over this many GPUs, stage.device and the next ones
  // (cuda_tensor_parallel.h), or over StageSpec::tensor_parallel of them where set.
  int tensor_parallel = 1;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(CudaBackendOptions options) : opt_(std::move(options)) {}

  absl::StatusOr<std::unique_ptr<Stage>> MakeStage(const StageSpec& spec) override;
  // Tensor-parallel ranks upload their shards as their stage loads: nothing is placed ahead.
  bool places_weights() const override { return opt_.tensor_parallel == 1; }
  int tensor_parallel() const override { return opt_.tensor_parallel; }
  absl::StatusOr<std::shared_ptr<const PlacedWeights>> PlaceWeights(const StageSpec& spec) override;
  absl::Status WarmUp(const StageSpec& spec) override;
  absl::StatusOr<KvBlock> KvToHost(const KvBlock& block) const override;
  bool has_nccl() const override { return true; }
  absl::StatusOr<std::string> MakeNcclId() override;
  absl::StatusOr<std::unique_ptr<ActivationTransport>> JoinNccl(const NcclJoin& join) override;
  bool has_kv_link() const override { return opt_.kv_over_nccl; }
  // On pages, in one GPU's stage (tensor parallelism keeps the model's dtype).
  bool has_fp8_kv_cache() const override { return opt_.tensor_parallel == 1; }
  absl::StatusOr<std::unique_ptr<KvLink>> JoinKvLink(const std::string& unique_id, int rank,
                                                     std::function<bool()> cancelled) override;

 private:
  const CudaBackendOptions opt_;
};

}  // namespace tandem
