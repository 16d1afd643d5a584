// The schedule of a staged copy: chunking, and reader threads over their own staging slots.
#include "worker/staged_copy.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "absl/synchronization/mutex.h"

namespace tandem {

std::vector<CopyChunk> SplitIntoChunks(std::span<const CopyJob> jobs, size_t max_bytes) {
  std::vector<CopyChunk> chunks;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const size_t unit = std::max<size_t>(jobs[j].unit, 1);
    const size_t step = std::max(unit, max_bytes / unit * unit);
    for (size_t off = 0; off < jobs[j].bytes; off += step) {
      chunks.push_back({j, off, std::min(step, jobs[j].bytes - off)});
    }
  }
  return chunks;
}

absl::Status StagedCopy(std::span<const CopyJob> jobs, std::span<const CopyChunk> chunks,
                        int threads, int slots_per_thread, StagingTarget& target) {
  threads = std::max(1, std::min<int>(threads, static_cast<int>(chunks.size())));
  slots_per_thread = std::max(1, slots_per_thread);
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  absl::Mutex mu;
  absl::Status first_error;
  auto fail = [&](absl::Status status) {
    absl::MutexLock lock(&mu);
    if (first_error.ok()) first_error = std::move(status);
    failed = true;
  };
  auto run = [&](int thread) {
    if (absl::Status status = target.BeginThread(thread); !status.ok()) return fail(status);
    int turn = 0;  // this thread's slots in rotation: the oldest submission is reused first
    while (!failed) {
      const size_t i = next++;
      if (i >= chunks.size()) return;
      const CopyChunk& chunk = chunks[i];
      const int slot = thread * slots_per_thread + turn;
      turn = (turn + 1) % slots_per_thread;
      if (absl::Status status = target.WaitFree(slot); !status.ok()) return fail(status);
      std::memcpy(target.Buffer(slot), jobs[chunk.job].src + chunk.offset, chunk.bytes);
      if (absl::Status status = target.Submit(slot, chunk); !status.ok()) return fail(status);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(run, t);
  run(0);
  for (std::thread& th : pool) th.join();
  return first_error;
}

}  // namespace tandem
