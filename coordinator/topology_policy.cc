#include "coordinator/topology_policy.h"

#include <algorithm>
#include <utility>

namespace tandem {
namespace {

const WorkerView* FindWorker(const ClusterState& state, int64_t id) {
  for (const WorkerView& w : state.workers) {
    if (w.id == id) return &w;
  }
  return nullptr;
}

bool Contains(const std::vector<int>& ids, int id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

bool Overlap(LayerRange a, LayerRange b) { return a.first < b.last && b.first < a.last; }

// Whether `w` can take a stage of the wanted size.
bool Fits(const ClusterState& state, const WorkerView& w) {
  return w.tensor_parallel >= state.wanted_tensor_parallel;
}

}  // namespace

int RestoredStages(const ClusterState& state) {
  const int usable = static_cast<int>(
      std::count_if(state.workers.begin(), state.workers.end(), [&](const WorkerView& w) {
        return (w.health == WorkerHealth::kIdle || w.health == WorkerHealth::kServing) &&
               Fits(state, w);
      }));
  if (state.effective_stages >= state.wanted_stages || usable < state.wanted_stages) {
    return state.effective_stages;
  }
  return state.wanted_stages;
}

std::vector<int> RetiringPipelines(const ClusterState& state) {
  std::vector<int> retiring;
  int kept = 0;
  for (const PipelineView& p : state.pipelines) {
    bool retire = p.draining || static_cast<int>(p.workers.size()) != state.effective_stages ||
                  p.tensor_parallel != state.wanted_tensor_parallel;
    for (int64_t id : p.workers) {
      const WorkerView* w = FindWorker(state, id);
      retire |= w != nullptr && w->health == WorkerHealth::kDrained;
    }
    if (!retire && kept >= state.wanted_replicas) retire = true;
    if (retire) {
      retiring.push_back(p.id);
    } else {
      ++kept;
    }
  }
  return retiring;
}

ClusterState AfterRetiring(ClusterState state, const std::vector<int>& retiring) {
  std::set<int64_t> freed;
  for (const PipelineView& p : state.pipelines) {
    if (Contains(retiring, p.id)) freed.insert(p.workers.begin(), p.workers.end());
  }
  std::erase_if(state.pipelines, [&](const PipelineView& p) { return Contains(retiring, p.id); });
  for (WorkerView& w : state.workers) {
    if (w.health == WorkerHealth::kServing && freed.contains(w.id)) w.health = WorkerHealth::kIdle;
  }
  return state;
}

absl::StatusOr<BuildPlan> PlanBuilds(const ClusterState& state) {
  std::vector<int64_t> idle;
  for (const WorkerView& w : state.workers) {
    if (w.health == WorkerHealth::kIdle && Fits(state, w)) idle.push_back(w.id);
  }
  BuildPlan plan;
  plan.stages = state.effective_stages;
  int live = static_cast<int>(state.pipelines.size());
  size_t next = 0;
  while (live < state.wanted_replicas) {
    const size_t left = idle.size() - next;
    if (left < static_cast<size_t>(plan.stages)) {
      // After a loss, serve on what is left rather than not at all.
      if (live > 0 || !state.planned_once || left == 0) break;
      plan.stages = static_cast<int>(left);
      plan.fewer_stages = true;
    }
    absl::StatusOr<std::vector<LayerRange>> ranges =
        PlanEvenPartition(state.num_layers, plan.stages);
    if (!ranges.ok()) return ranges.status();
    NewPipeline p;
    p.workers.assign(idle.begin() + next, idle.begin() + next + plan.stages);
    p.ranges = *std::move(ranges);
    next += plan.stages;
    ++live;
    plan.pipelines.push_back(std::move(p));
  }
  return plan;
}

std::vector<StageRelease> StagesToRelease(const ClusterState& state,
                                          const std::vector<int>& retiring,
                                          const std::vector<NewPipeline>& taking) {
  std::vector<StageRelease> out;
  for (const PipelineView& p : state.pipelines) {
    if (!Contains(retiring, p.id)) continue;
    for (int64_t w : p.workers) {
      const bool taken = std::any_of(taking.begin(), taking.end(), [w](const NewPipeline& n) {
        return std::find(n.workers.begin(), n.workers.end(), w) != n.workers.end();
      });
      if (!taken) out.push_back({.worker = w, .assignment = p.assignment});
    }
  }
  return out;
}

std::map<int64_t, std::set<int64_t>> KvLinksToMake(const ClusterState& state,
                                                   const std::vector<int>& retiring,
                                                   const std::vector<NewPipeline>& building) {
  std::map<int64_t, std::set<int64_t>> links;
  for (const NewPipeline& n : building) {
    for (size_t s = 0; s < n.workers.size(); ++s) {
      const WorkerView* taker = FindWorker(state, n.workers[s]);
      if (taker == nullptr || !taker->cuda) continue;
      for (const PipelineView& p : state.pipelines) {
        if (!Contains(retiring, p.id)) continue;
        for (size_t h = 0; h < p.workers.size(); ++h) {
          const WorkerView* holder = FindWorker(state, p.workers[h]);
          if (holder != nullptr && holder->cuda && holder->id != taker->id &&
              Overlap(p.ranges[h], n.ranges[s])) {
            links[taker->id].insert(holder->id);
          }
        }
      }
    }
  }
  return links;
}

TopologyActions PlanTopology(const ClusterState& state) {
  ClusterState restored = state;
  restored.effective_stages = RestoredStages(state);
  TopologyActions actions{.stages = restored.effective_stages,
                          .retiring = RetiringPipelines(restored),
                          .builds = absl::StatusOr<BuildPlan>()};
  actions.builds = PlanBuilds(AfterRetiring(std::move(restored), actions.retiring));
  return actions;
}

}  // namespace tandem
