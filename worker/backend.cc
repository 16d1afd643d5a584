// Backend's defaults (worker/backend.h): a backend of the host alone.
#include "worker/backend.h"

#include <utility>

namespace tandem {

absl::StatusOr<std::shared_ptr<const PlacedWeights>> Backend::PlaceWeights(const StageSpec& spec) {
  (void)spec;
  return absl::UnimplementedError("this backend places no weights ahead");
}

absl::Status Backend::WarmUp(const StageSpec& spec) {
  (void)spec;
  return absl::UnimplementedError("this backend has nothing to warm up");
}

absl::StatusOr<KvBlock> Backend::KvToHost(const KvBlock& block) const {
  if (!block.on_device()) return block;
  return absl::UnimplementedError("this backend holds no KV-cache in device memory");
}

absl::StatusOr<std::string> Backend::MakeNcclId() {
  return absl::FailedPreconditionError(
      "this worker has no NCCL (a CUDA build with --backend=cuda)");
}

absl::StatusOr<std::unique_ptr<ActivationTransport>> Backend::JoinNccl(const NcclJoin& join) {
  (void)join;
  return absl::FailedPreconditionError(
      "transport nccl: this worker has no NCCL (a CUDA build with --backend=cuda)");
}

absl::StatusOr<std::unique_ptr<KvLink>> Backend::JoinKvLink(const std::string& unique_id, int rank,
                                                            std::function<bool()> cancelled) {
  (void)unique_id, (void)rank, (void)cancelled;
  return absl::FailedPreconditionError(
      "this worker moves no KV-cache over NCCL (a CUDA build with --backend=cuda and "
      "--kv_over_nccl)");
}

}  // namespace tandem
