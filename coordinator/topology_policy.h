// The coordinator's topology as a policy: from the cluster's state (its workers and their health,
// drained or not, the layout asked for, which pipelines serve on which workers) to the actions that
// bring the cluster to that layout (which pipelines retire, which to build from which workers with
// which layers, which stages to release, which KV links to make ahead). Plain data in, plain data
// out: no RPCs, no locks, no clocks. The re-plan and the prepared re-partition ask the same
// functions, so that what is prepared ahead is what the re-plan builds; topology_executor.h
// performs the actions.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/partition_planner.h"

namespace tandem {

enum class WorkerHealth {
  kIdle,     // up, no stage
  kServing,  // up, a stage of a pipeline
  kDrained,  // up, kept out of pipelines by the operator (Admin.Drain)
  kDown,     // its heartbeats stopped, its stream broke or it registered again
};

struct WorkerView {
  int64_t id = 0;
  WorkerHealth health = WorkerHealth::kIdle;
  bool cuda = false;  // a CUDA worker: links to other CUDA workers over NCCL, KV moves included
  int tensor_parallel = 1;  // the most ranks it splits a stage over
};

struct PipelineView {
  int id = 0;
  uint64_t assignment = 0;
  std::vector<int64_t> workers;    // per stage
  std::vector<LayerRange> ranges;  // per stage
  bool draining = false;           // the scheduler gives it no new work (it retires)
  int tensor_parallel = 0;         // its stages' ranks as assigned (0: each worker's own)
};

struct ClusterState {
  int num_layers = 0;  // the model's
  int wanted_stages = 1;
  int wanted_replicas = 1;
  int effective_stages = 1;   // < wanted_stages while too few workers are up
  bool planned_once = false;  // a pipeline has served: after a loss, serve on fewer stages
  // Ranks per stage asked for (0: each worker's own): pipelines of another size retire, and only
  // workers of at least that many ranks take stages.
  int wanted_tensor_parallel = 0;
  std::vector<WorkerView> workers;      // in id order
  std::vector<PipelineView> pipelines;  // in id order
};

// The stage count to plan with: the wanted once enough workers are up (idle or serving) again,
// else the effective one.
int RestoredStages(const ClusterState& state);

// The pipelines that retire, in id order: draining ones, those of another stage count than the
// effective one or with a drained worker, and the replicas beyond the wanted (the newest).
std::vector<int> RetiringPipelines(const ClusterState& state);

// `state` once the `retiring` pipelines have stopped: they are gone and their serving workers idle.
ClusterState AfterRetiring(ClusterState state, const std::vector<int>& retiring);

// A pipeline to build: its workers and their layers, per stage.
struct NewPipeline {
  std::vector<int64_t> workers;
  std::vector<LayerRange> ranges;
  bool operator==(const NewPipeline&) const = default;
};

struct BuildPlan {
  // The stage count the cluster serves with after the plan: the effective one, or fewer when
  // after a loss no pipeline serves and the workers left are too few for it (`fewer_stages`).
  int stages = 1;
  bool fewer_stages = false;
  // Built in this order, each from the first idle workers (in id order) that the ones before
  // left, until the replicas asked for serve or too few idle workers are left.
  std::vector<NewPipeline> pipelines;
};

// The pipelines to build from the idle workers of `state`. The error of PlanEvenPartition when a
// pipeline would be built with more stages than the model has layers.
absl::StatusOr<BuildPlan> PlanBuilds(const ClusterState& state);

// A stage a worker drops: the one of `assignment`.
struct StageRelease {
  int64_t worker = 0;
  uint64_t assignment = 0;
  bool operator==(const StageRelease&) const = default;
};

// The stages of the `retiring` pipelines whose workers none of `taking` (pipelines whose stages
// were prepared ahead) takes, in pipeline then stage order.
std::vector<StageRelease> StagesToRelease(const ClusterState& state,
                                          const std::vector<int>& retiring,
                                          const std::vector<NewPipeline>& taking);

// For KV moves from the `retiring` pipelines into `building`: per CUDA worker of `building`, the
// other CUDA workers of `retiring` that hold some of its new layers (those it fetches from, whose
// KV links are made ahead).
std::map<int64_t, std::set<int64_t>> KvLinksToMake(const ClusterState& state,
                                                   const std::vector<int>& retiring,
                                                   const std::vector<NewPipeline>& building);

// What a re-plan does, decided at once from the state before it.
struct TopologyActions {
  int stages = 1;            // RestoredStages: the stage count planned with
  std::vector<int> retiring;  // pipelines that stop (their sequences move or drain first)
  // What is built once they stopped (PlanBuilds on AfterRetiring), or why nothing can be.
  absl::StatusOr<BuildPlan> builds;
};
TopologyActions PlanTopology(const ClusterState& state);

}  // namespace tandem
