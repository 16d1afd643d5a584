// Performs what the topology policy (topology_policy.h) decides, over the workers' RPCs: the
// AssignStage requests of a pipeline, stages prepared ahead of a re-partition, the KV links a move
// will fetch over, and the release of stages no pipeline keeps (each on a thread of its own).
// Timeouts live here. The coordinator's re-plan (replan.cc) calls these outside its mutex.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "coordinator/partition_planner.h"
#include "grpcpp/grpcpp.h"
#include "proto/tandem.pb.h"

namespace tandem {

// A stage may load gigabytes from disk before it answers AssignStage.
inline constexpr absl::Duration kAssignTimeout = absl::Seconds(300);
// An export or import of a move: gigabytes of KV-cache over gRPC at worst.
inline constexpr absl::Duration kMoveTimeout = absl::Seconds(300);
// Each RPC of a prefill hand-off (the KV-cache of a few prompts), or of making KV links.
inline constexpr absl::Duration kHandoffTimeout = absl::Seconds(60);

// What every stage of a pipeline is told besides its place in it.
struct StageSettings {
  std::string model_dir;
  int max_slots = 0;
  int max_seq_len = 0;
  int64_t max_step_rows = 0;  // MaxStepRows (config.h)
  int kv_page_size = 0;       // tokens per KV-cache page; 0: contiguous slots
  int kv_pages = 0;           // pages per stage; 0: as many as its memory holds
  // AssignStageRequest.kv_cache_dtype: "" (the model's dtype) or "fp8_e4m3".
  std::string kv_cache_dtype;
  int tensor_parallel = 0;  // AssignStageRequest.tensor_parallel: ranks per stage, 0 the worker's
};

// The AssignStage requests of pipeline `id`'s stages, on the workers at `addresses` (per stage).
std::vector<v1::AssignStageRequest> StageRequests(const StageSettings& settings, int id,
                                                  uint64_t assignment,
                                                  const std::vector<std::string>& addresses,
                                                  const std::vector<LayerRange>& ranges);

// Has every stage of pipeline `id` get ready while the pipelines it replaces still serve
// (`requests` with prepare set: link joined, weights placed). Whether all did (a failure is
// logged: the stages then load when assigned).
bool PrepareStages(int id, const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                   std::vector<v1::AssignStageRequest>& requests, bool all_cuda);

// Has `worker` make its KV links to the workers at `sources` now (an ImportKv of no sequence),
// rather than in the pause of a move; a failure is logged (the move makes them).
void MakeKvLinks(int64_t worker, const std::shared_ptr<grpc::Channel>& channel,
                 const std::set<std::string>& sources);

// Workers drop stages (ReleaseStage), each on a thread of its own, so that the links between the
// old stages close on both sides at once while other workers take new ones. Failures are logged.
class StageReleaser {
 public:
  StageReleaser() = default;
  StageReleaser(const StageReleaser&) = delete;
  StageReleaser& operator=(const StageReleaser&) = delete;
  ~StageReleaser() { Join(); }

  void Release(std::shared_ptr<grpc::Channel> channel, uint64_t assignment);
  // Waits for every release started.
  void Join();

 private:
  std::vector<std::thread> threads_;
};

}  // namespace tandem
