// The CPU stage over tensor-parallel ranks (cpu_tensor_parallel.h).
//
// Threads: the caller of Step (the worker's step loop) runs rank 0; ranks 1 .. N-1 each run on a
// thread of their own ("tp-rank-<r>") that waits for the next step. The ranks meet only in the
// all-reduce, twice a layer.
#include "worker/cpu/cpu_tensor_parallel.h"

#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "common/thread_name.h"
#include "worker/cpu/cpu_all_reduce.h"
#include "worker/cpu/cpu_stage.h"

namespace tandem {
namespace {

// Ranks 1 .. N-1's threads: Run hands each the same job and runs rank 0's on the caller.
class RankThreads {
 public:
  explicit RankThreads(int ranks) {
    for (int r = 1; r < ranks; ++r) threads_.emplace_back([this, r] { Loop(r); });
  }
  ~RankThreads() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    for (std::thread& t : threads_) t.join();
  }

  // fn(r) for every rank r, rank 0 on the calling thread; returns once all have.
  void Run(std::function<void(int)> fn) {
    {
      absl::MutexLock lock(&mu_);
      job_ = std::move(fn);
      running_ = static_cast<int>(threads_.size());
      ++generation_;
    }
    job_(0);
    absl::MutexLock lock(&mu_);
    auto finished = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return running_ == 0; };
    mu_.Await(absl::Condition(&finished));
  }

 private:
  void Loop(int rank) {
    SetThreadName(absl::StrCat("tp-rank-", rank));
    int64_t seen = 0;
    for (;;) {
      std::function<void(int)>* job;
      {
        absl::MutexLock lock(&mu_);
        auto woken = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stop_ || generation_ != seen;
        };
        mu_.Await(absl::Condition(&woken));
        if (stop_) return;
        seen = generation_;
        job = &job_;
      }
      (*job)(rank);  // job_ is not replaced before every rank has finished it
      absl::MutexLock lock(&mu_);
      --running_;
    }
  }

  absl::Mutex mu_;
  std::function<void(int)> job_;  // written under mu_ while no rank runs it
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

class CpuTensorParallelStage final : public Stage {
 public:
  CpuTensorParallelStage(std::unique_ptr<CpuAllReduce> all_reduce,
                         std::vector<std::unique_ptr<Stage>> ranks, ModelConfig config)
      : all_reduce_(std::move(all_reduce)),
        ranks_(std::move(ranks)),
        config_(std::move(config)),
        threads_(static_cast<int>(ranks_.size())) {}

  const ModelConfig& config() const override { return config_; }

  // Every rank validates the same step against the same slot lengths, so they accept or refuse
  // it together, before any reaches the all-reduce.
  absl::StatusOr<StepOutput> Step(const StepDescriptor& step, const Activations& in) override {
    std::vector<absl::StatusOr<StepOutput>> outs(ranks_.size());
    threads_.Run([&](int r) { outs[r] = ranks_[r]->Step(step, in); });
    for (size_t r = 1; r < outs.size(); ++r) {
      if (!outs[r].ok()) {
        return absl::Status(outs[r].status().code(), absl::StrCat("tensor-parallel rank ", r,
                                                                  ": ", outs[r].status().message()));
      }
    }
    return std::move(outs[0]);
  }

 private:
  std::unique_ptr<CpuAllReduce> all_reduce_;  // the ranks' stages point into it
  std::vector<std::unique_ptr<Stage>> ranks_;
  const ModelConfig config_;  // the whole model's (every rank's config())
  RankThreads threads_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Stage>> MakeCpuTensorParallelStage(const StageSpec& spec,
                                                                  int ranks) {
  if (ranks == 1) return MakeCpuStage(spec);
  auto all_reduce = std::make_unique<CpuAllReduce>(ranks);
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Stage>> stages,
                   MakeCpuStageRanks(spec, *all_reduce));
  ModelConfig config = stages[0]->config();
  return std::make_unique<CpuTensorParallelStage>(std::move(all_reduce), std::move(stages),
                                                  std::move(config));
}

}  // namespace tandem
