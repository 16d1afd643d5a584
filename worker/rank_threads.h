// One thread per tensor-parallel rank of a stage (cpu_tensor_parallel.h, cuda_tensor_parallel.h):
// rank 0 runs on the caller's thread, ranks 1 .. N-1 each on a thread of their own
// ("tp-rank-<r>") that waits for the next job.
#pragma once

#include <cstdint>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/thread_name.h"

namespace tandem {

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

}  // namespace tandem
