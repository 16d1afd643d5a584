// A worker's compute backend: how it makes stages and what its device offers the worker around
// them (weights placed ahead, copies to the host, the NCCL links of pipelines and of KV-cache
// moves). One per worker, chosen once from its settings: CpuBackend (worker/cpu/cpu_backend.h)
// or CudaBackend (worker/cuda/cuda_backend.h). What a made stage offers is Stage's (stage.h).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/stage.h"
#include "worker/transport/activation_transport.h"
#include "worker/transport/kv_link.h"

namespace tandem {

// What a stage needs to join its pipeline's NCCL communicator.
struct NcclJoin {
  std::string unique_id;  // kNcclUniqueIdBytes bytes from the first stage's PrepareLink
  int rank = 0;           // the stage index
  int world = 1;          // stages in the pipeline
  int hidden_size = 0;    // cols of every activation
  int64_t max_rows = 0;   // rows of the largest step
};

// The defaults describe a backend of the host alone: it places no weights ahead, warms nothing,
// holds KV-cache only in host memory and has no NCCL (UNIMPLEMENTED where asked).
class Backend {
 public:
  virtual ~Backend() = default;

  // A stage of `spec`'s layers (taking spec.placed where they fit).
  virtual absl::StatusOr<std::unique_ptr<Stage>> MakeStage(const StageSpec& spec) = 0;
  // The most ranks a stage may be split over (StageSpec::tensor_parallel; the worker's
  // --tensor_parallel), and what a stage of tensor_parallel 0 gets.
  virtual int tensor_parallel() const { return 1; }

  // Whether PlaceWeights and WarmUp do anything.
  virtual bool places_weights() const { return false; }
  // The weights of `spec`'s layers that spec.placed lacks, placed now for a later MakeStage to
  // take (StageSpec::placed) instead of loading them then; null when nothing lacks.
  virtual absl::StatusOr<std::shared_ptr<const PlacedWeights>> PlaceWeights(const StageSpec& spec);
  // Makes a stage of `spec` (on placed weights, with a small KV-cache) and drops it, so that a
  // worker's first stage does not load its libraries' and kernels' code in a re-partition's pause.
  virtual absl::Status WarmUp(const StageSpec& spec);

  // Whether its stages keep their KV-cache in FP8 when asked (StageSpec::kv_cache_fp8). The worker
  // refuses an assignment of an FP8 KV-cache to a backend without, rather than serve it in the
  // model's dtype.
  virtual bool has_fp8_kv_cache() const { return false; }

  // `block` in host memory: a copy of one in device memory (Stage::ExportKvToDevice), or itself.
  virtual absl::StatusOr<KvBlock> KvToHost(const KvBlock& block) const;

  // Whether this worker's pipelines may link over NCCL (MakeNcclId, JoinNccl).
  virtual bool has_nccl() const { return false; }
  // A new NCCL unique id (kNcclUniqueIdBytes bytes), for a pipeline's or a KV link's ranks.
  virtual absl::StatusOr<std::string> MakeNcclId();
  // Joins the pipeline's NCCL communicator as `join`'s stage.
  virtual absl::StatusOr<std::unique_ptr<ActivationTransport>> JoinNccl(const NcclJoin& join);

  // Whether KV-cache moves between GPUs over NCCL (JoinKvLink, MakeNcclId). With it, ExportKv
  // keeps stashes on the GPU when asked, and fetches between two such workers go over NCCL (gRPC
  // when the other worker cannot). Without: KV-cache moves through host memory and gRPC.
  virtual bool has_kv_link() const { return false; }
  // Joins the two-rank NCCL communicator of `unique_id` as rank 0 (sends) or 1 (receives), giving
  // up once `cancelled` says so (null: never).
  virtual absl::StatusOr<std::unique_ptr<KvLink>> JoinKvLink(const std::string& unique_id, int rank,
                                                             std::function<bool()> cancelled);
};

}  // namespace tandem
