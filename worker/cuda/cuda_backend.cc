// The cuda backend of a worker (cuda_backend.h).
#include "worker/cuda/cuda_backend.h"

#include <algorithm>
#include <utility>

#include "common/status_macros.h"
#include "worker/cuda/cuda_tensor_parallel.h"
#include "worker/transport/nccl_kv_link.h"
#include "worker/transport/nccl_transport.h"

namespace tandem {

namespace {

// `spec` with the backend's precision.
StageSpec WithPrecision(StageSpec spec, const CudaBackendOptions& opt) {
  spec.quantize_fp8 = spec.quantize_fp8 || opt.quantize_fp8;
  return spec;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Stage>> CudaBackend::MakeStage(const StageSpec& spec) {
  return MakeCudaTensorParallelStage(
      WithPrecision(spec, opt_), opt_.stage,
      spec.tensor_parallel > 0 ? spec.tensor_parallel : opt_.tensor_parallel);
}

absl::StatusOr<std::shared_ptr<const PlacedWeights>> CudaBackend::PlaceWeights(
    const StageSpec& spec) {
  return PlaceCudaWeights(WithPrecision(spec, opt_), opt_.stage);
}

absl::Status CudaBackend::WarmUp(const StageSpec& spec) {
  return MakeStage(spec).status();
}

absl::StatusOr<KvBlock> CudaBackend::KvToHost(const KvBlock& block) const {
  return KvBlockToHost(block);
}

absl::StatusOr<std::string> CudaBackend::MakeNcclId() { return MakeNcclUniqueId(); }

absl::StatusOr<std::unique_ptr<ActivationTransport>> CudaBackend::JoinNccl(const NcclJoin& join) {
  NcclTransportOptions o;
  o.device = opt_.stage.device;
  o.rank = join.rank;
  o.world = join.world;
  o.hidden_size = join.hidden_size;
  o.dtype = opt_.stage.dtype;
  o.max_rows = join.max_rows;
  o.timeout = opt_.recv_timeout;
  ASSIGN_OR_RETURN(std::unique_ptr<NcclTransport> t, NcclTransport::Create(o, join.unique_id));
  return std::unique_ptr<ActivationTransport>(std::move(t));
}

absl::StatusOr<std::unique_ptr<KvLink>> CudaBackend::JoinKvLink(const std::string& unique_id,
                                                                int rank,
                                                                std::function<bool()> cancelled) {
  if (!opt_.kv_over_nccl) return Backend::JoinKvLink(unique_id, rank, std::move(cancelled));
  // Joining waits for the other worker, which joins as it takes the request.
  const absl::Duration timeout = std::min(opt_.recv_timeout, absl::Seconds(60));
  ASSIGN_OR_RETURN(
      std::unique_ptr<NcclKvLink> link,
      NcclKvLink::Join(opt_.stage.device, rank, unique_id, timeout, std::move(cancelled)));
  return std::unique_ptr<KvLink>(std::move(link));
}

}  // namespace tandem
