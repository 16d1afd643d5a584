#include "coordinator/topology_policy.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

// A model of 8 layers, `n` idle CPU workers with ids 1..n, nothing serving yet.
ClusterState Fresh(int n, int stages, int replicas) {
  ClusterState s{.num_layers = 8,
                 .wanted_stages = stages,
                 .wanted_replicas = replicas,
                 .effective_stages = stages,
                 .planned_once = false,
                 .workers = {},
                 .pipelines = {}};
  for (int i = 1; i <= n; ++i) s.workers.push_back({.id = i});
  return s;
}

// `state` once `plan`'s pipelines serve (ids 0, 1, ... after those already there).
ClusterState Serve(ClusterState state, const BuildPlan& plan) {
  int id = state.pipelines.empty() ? 0 : state.pipelines.back().id + 1;
  for (const NewPipeline& n : plan.pipelines) {
    state.pipelines.push_back({.id = id,
                               .assignment = static_cast<uint64_t>(100 + id),
                               .workers = n.workers,
                               .ranges = n.ranges,
                               .draining = false,
                               .tensor_parallel = state.wanted_tensor_parallel});
    ++id;
    for (WorkerView& w : state.workers) {
      for (int64_t taken : n.workers) {
        if (w.id == taken) w.health = WorkerHealth::kServing;
      }
    }
  }
  state.effective_stages = plan.stages;
  state.planned_once = true;
  return state;
}

WorkerView& Worker(ClusterState& s, int64_t id) {
  for (WorkerView& w : s.workers) {
    if (w.id == id) return w;
  }
  ADD_FAILURE() << "no worker " << id;
  return s.workers.front();
}

TEST(TopologyPolicyTest, FreshStartBuildsEachReplicaFromTheFirstIdleWorkersInIdOrder) {
  absl::StatusOr<BuildPlan> plan = PlanBuilds(Fresh(5, 2, 2));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->stages, 2);
  EXPECT_FALSE(plan->fewer_stages);
  const std::vector<LayerRange> halves = {{0, 4}, {4, 8}};
  EXPECT_THAT(plan->pipelines, ElementsAre(NewPipeline{{1, 2}, halves},
                                           NewPipeline{{3, 4}, halves}));  // worker 5 stays idle
}

TEST(TopologyPolicyTest, NothingToBuildOnceTheWantedReplicasServe) {
  ClusterState s = Fresh(4, 2, 2);
  s = Serve(s, *PlanBuilds(s));
  EXPECT_THAT(RetiringPipelines(s), IsEmpty());
  EXPECT_THAT(PlanBuilds(s)->pipelines, IsEmpty());
}

TEST(TopologyPolicyTest, TooFewWorkersOnAFreshStartBuildNothingRatherThanFewerStages) {
  // Fewer stages are for serving on after a loss; a cluster still coming up waits for workers.
  absl::StatusOr<BuildPlan> plan = PlanBuilds(Fresh(2, 3, 1));
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(plan->pipelines, IsEmpty());
  EXPECT_EQ(plan->stages, 3);
}

TEST(TopologyPolicyTest, MoreStagesThanLayersIsTheErrorOfThePartition) {
  ClusterState s = Fresh(9, 9, 1);
  absl::StatusOr<BuildPlan> plan = PlanBuilds(s);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TopologyPolicyTest, AWorkerDownLeavesFewerStagesOnWhatIsLeftThenRestoresThem) {
  ClusterState s = Fresh(3, 3, 1);
  s = Serve(s, *PlanBuilds(s));
  // Worker 2 goes down: its pipeline is failed (gone), the others idle.
  s.pipelines.clear();
  Worker(s, 1).health = WorkerHealth::kIdle;
  Worker(s, 2).health = WorkerHealth::kDown;
  Worker(s, 3).health = WorkerHealth::kIdle;
  EXPECT_EQ(RestoredStages(s), 3);  // too few up to go back
  absl::StatusOr<BuildPlan> plan = PlanBuilds(s);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->fewer_stages);
  EXPECT_EQ(plan->stages, 2);
  EXPECT_THAT(plan->pipelines,
              ElementsAre(NewPipeline{{1, 3}, std::vector<LayerRange>{{0, 4}, {4, 8}}}));
  s = Serve(s, *plan);
  // A worker comes back: three are up again, so the 2-stage pipeline retires for a 3-stage one.
  s.workers.push_back({.id = 4});
  const TopologyActions actions = PlanTopology(s);
  EXPECT_EQ(actions.stages, 3);
  EXPECT_THAT(actions.retiring, ElementsAre(0));
  ASSERT_TRUE(actions.builds.ok());
  EXPECT_FALSE(actions.builds->fewer_stages);
  EXPECT_THAT(actions.builds->pipelines,
              ElementsAre(NewPipeline{{1, 3, 4}, std::vector<LayerRange>{{0, 3}, {3, 6}, {6, 8}}}));
}

TEST(TopologyPolicyTest, DrainRetiresThePipelineAndAnIdleWorkerTakesTheDrainedOnesPlace) {
  ClusterState s = Fresh(3, 2, 1);
  s = Serve(s, *PlanBuilds(s));  // workers 1 and 2; 3 idle
  Worker(s, 2).health = WorkerHealth::kDrained;
  const TopologyActions actions = PlanTopology(s);
  EXPECT_THAT(actions.retiring, ElementsAre(0));
  ASSERT_TRUE(actions.builds.ok());
  EXPECT_THAT(actions.builds->pipelines,
              ElementsAre(NewPipeline{{1, 3}, std::vector<LayerRange>{{0, 4}, {4, 8}}}));
  // Worker 1 keeps a stage in the new pipeline; only the drained one releases its old stage.
  EXPECT_THAT(StagesToRelease(s, actions.retiring, actions.builds->pipelines),
              ElementsAre(StageRelease{.worker = 2, .assignment = 100}));

  // Undrained, it is idle again: nothing retires, and with one replica wanted nothing is built.
  ClusterState after = Serve(AfterRetiring(s, actions.retiring), *actions.builds);
  Worker(after, 2).health = WorkerHealth::kIdle;
  EXPECT_THAT(RetiringPipelines(after), IsEmpty());
  EXPECT_THAT(PlanBuilds(after)->pipelines, IsEmpty());
}

TEST(TopologyPolicyTest, ADrainingPipelineRetires) {
  ClusterState s = Fresh(2, 1, 2);
  s = Serve(s, *PlanBuilds(s));
  s.pipelines[0].draining = true;
  EXPECT_THAT(RetiringPipelines(s), ElementsAre(0));
}

TEST(TopologyPolicyTest, ALayoutChangeRetiresEveryPipelineOfTheOldStageCount) {
  // 1 stage x 4 replicas becomes 2 stages x 2 replicas.
  ClusterState s = Fresh(4, 1, 4);
  s = Serve(s, *PlanBuilds(s));
  s.wanted_stages = s.effective_stages = 2;
  s.wanted_replicas = 2;
  const TopologyActions actions = PlanTopology(s);
  EXPECT_THAT(actions.retiring, ElementsAre(0, 1, 2, 3));
  ASSERT_TRUE(actions.builds.ok());
  const std::vector<LayerRange> halves = {{0, 4}, {4, 8}};
  EXPECT_THAT(actions.builds->pipelines,
              ElementsAre(NewPipeline{{1, 2}, halves}, NewPipeline{{3, 4}, halves}));
  EXPECT_THAT(StagesToRelease(s, actions.retiring, actions.builds->pipelines), IsEmpty());
}

// Worker 1 splits a stage over one rank, workers 2 and 3 over two: asking for two ranks a stage
// retires the pipeline on worker 1 and builds on worker 2; asking for each worker's own size
// again retires that one.
TEST(TopologyPolicyTest, ATensorParallelSizeRetiresOtherPipelinesAndBuildsOnWorkersOfThatSize) {
  ClusterState s = Fresh(3, 1, 1);
  Worker(s, 2).tensor_parallel = 2;
  Worker(s, 3).tensor_parallel = 2;
  s = Serve(s, *PlanBuilds(s));
  ASSERT_EQ(s.pipelines.size(), 1u);
  EXPECT_EQ(s.pipelines[0].workers, std::vector<int64_t>{1});
  s.wanted_tensor_parallel = 2;
  TopologyActions actions = PlanTopology(s);
  EXPECT_THAT(actions.retiring, ElementsAre(0));
  ASSERT_TRUE(actions.builds.ok());
  const std::vector<LayerRange> whole = {{0, 8}};
  EXPECT_THAT(actions.builds->pipelines, ElementsAre(NewPipeline{{2}, whole}));
  s = Serve(AfterRetiring(s, actions.retiring), *actions.builds);
  EXPECT_THAT(RetiringPipelines(s), IsEmpty());
  s.wanted_tensor_parallel = 0;
  actions = PlanTopology(s);
  EXPECT_THAT(actions.retiring, ElementsAre(0));  // the pipeline on worker 2
  EXPECT_THAT(actions.builds->pipelines, ElementsAre(NewPipeline{{1}, whole}));
}

// Two stages of two ranks need two workers of two ranks: with one such worker up (and one of a
// single rank) nothing is built on a fresh start, and a loss does not count the small worker.
TEST(TopologyPolicyTest, WorkersOfFewerRanksThanAskedTakeNoStage) {
  ClusterState s = Fresh(2, 2, 1);
  s.wanted_tensor_parallel = 2;
  Worker(s, 2).tensor_parallel = 2;
  absl::StatusOr<BuildPlan> plan = PlanBuilds(s);
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(plan->pipelines, IsEmpty());
  Worker(s, 1).tensor_parallel = 4;  // more ranks than asked: it takes a stage (two of its four)
  EXPECT_THAT(PlanBuilds(s)->pipelines,
              ElementsAre(NewPipeline{{1, 2}, std::vector<LayerRange>{{0, 4}, {4, 8}}}));
  s.effective_stages = 1;  // after a loss, back to two stages only with two fitting workers
  Worker(s, 1).tensor_parallel = 1;
  EXPECT_EQ(RestoredStages(s), 1);
  Worker(s, 1).tensor_parallel = 2;
  EXPECT_EQ(RestoredStages(s), 2);
}

TEST(TopologyPolicyTest, FewerReplicasRetireTheNewestPipelines) {
  ClusterState s = Fresh(3, 1, 3);
  s = Serve(s, *PlanBuilds(s));
  s.wanted_replicas = 1;
  const TopologyActions actions = PlanTopology(s);
  EXPECT_THAT(actions.retiring, ElementsAre(1, 2));
  EXPECT_THAT(actions.builds->pipelines, IsEmpty());
  EXPECT_THAT(StagesToRelease(s, actions.retiring, {}),
              ElementsAre(StageRelease{2, 101}, StageRelease{3, 102}));
}

TEST(TopologyPolicyTest, ALayoutNeedingMoreWorkersThanAreUpBuildsWhatFits) {
  ClusterState s = Fresh(3, 1, 1);
  s = Serve(s, *PlanBuilds(s));
  s.wanted_stages = s.effective_stages = 2;
  s.wanted_replicas = 2;  // 4 workers wanted, 3 up
  const TopologyActions actions = PlanTopology(s);
  EXPECT_THAT(actions.retiring, ElementsAre(0));
  ASSERT_TRUE(actions.builds.ok());
  EXPECT_THAT(actions.builds->pipelines,
              ElementsAre(NewPipeline{{1, 2}, std::vector<LayerRange>{{0, 4}, {4, 8}}}));
}

TEST(TopologyPolicyTest, ThePreparedRepartitionIsWhatTheReplanBuildsOnceTheOldPipelinesStop) {
  // What PrepareReplacements prepares (PlanTopology, before anything stops) and what RunPlan's
  // build loop then asks for (PlanBuilds on the state after the retiring pipelines stopped) are
  // the same pipelines on the same workers with the same layers.
  ClusterState s = Fresh(6, 1, 3);
  s = Serve(s, *PlanBuilds(s));  // workers 1..3; 4..6 idle
  Worker(s, 5).health = WorkerHealth::kDown;
  s.wanted_stages = s.effective_stages = 2;
  s.wanted_replicas = 2;
  const TopologyActions prepared = PlanTopology(s);
  ASSERT_TRUE(prepared.builds.ok());
  ASSERT_EQ(prepared.builds->pipelines.size(), 2u);

  ClusterState stopped = s;
  for (int id : prepared.retiring) {
    for (PipelineView& p : stopped.pipelines) {
      if (p.id != id) continue;
      for (int64_t w : p.workers) Worker(stopped, w).health = WorkerHealth::kIdle;
    }
  }
  std::erase_if(stopped.pipelines, [](const PipelineView&) { return true; });
  std::vector<NewPipeline> built;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<BuildPlan> next = PlanBuilds(stopped);
    ASSERT_TRUE(next.ok());
    if (next->pipelines.empty()) break;
    built.push_back(next->pipelines.front());
    stopped = Serve(stopped, BuildPlan{.stages = next->stages,
                                       .fewer_stages = false,
                                       .pipelines = {next->pipelines.front()}});
  }
  EXPECT_EQ(built, prepared.builds->pipelines);
  EXPECT_THAT(built[0].workers, ElementsAre(1, 2));
  EXPECT_THAT(built[1].workers, ElementsAre(3, 4));  // 5 is down
}

TEST(TopologyPolicyTest, KvLinksGoFromEachNewCudaStageToTheOldCudaHoldersOfItsLayers) {
  ClusterState s = Fresh(4, 2, 1);
  for (WorkerView& w : s.workers) w.cuda = w.id != 4;
  s = Serve(s, *PlanBuilds(s));  // worker 1: layers [0, 4), worker 2: [4, 8)
  s.wanted_stages = s.effective_stages = 3;
  const TopologyActions actions = PlanTopology(s);
  ASSERT_TRUE(actions.builds.ok());
  // New: worker 1 [0, 3), worker 2 [3, 6), worker 3 [6, 8).
  const std::map<int64_t, std::set<int64_t>> links =
      KvLinksToMake(s, actions.retiring, actions.builds->pipelines);
  // Worker 1's layers were its own; worker 2 fetches layer 3 from worker 1; worker 3 fetches
  // from worker 2.
  EXPECT_EQ(links, (std::map<int64_t, std::set<int64_t>>{{2, {1}}, {3, {2}}}));
}

TEST(TopologyPolicyTest, AfterRetiringIdlesTheServingWorkersButNotTheDrainedOnes) {
  ClusterState s = Fresh(2, 2, 1);
  s = Serve(s, *PlanBuilds(s));
  Worker(s, 2).health = WorkerHealth::kDrained;
  const ClusterState after = AfterRetiring(s, {0});
  EXPECT_THAT(after.pipelines, IsEmpty());
  EXPECT_EQ(after.workers[0].health, WorkerHealth::kIdle);
  EXPECT_EQ(after.workers[1].health, WorkerHealth::kDrained);
}

}  // namespace
}  // namespace tandem
