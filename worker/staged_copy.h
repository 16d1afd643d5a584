// Copies many host byte ranges to a device through a ring of staging buffers: the ranges are cut
// into chunks, reader threads copy each chunk from (memory-mapped) host memory into a free staging
// buffer and hand it to the device, which transfers it asynchronously while the threads read on.
// The device side (pinned buffers, streams, events, conversion) is passed in, so that the schedule
// is the same, and testable, without a GPU.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "absl/status/status.h"

namespace tandem {

// One host range to copy: `bytes` bytes at `src`, cut only at multiples of `unit` bytes (an
// element, or a whole row where the device rearranges rows).
struct CopyJob {
  const std::byte* src = nullptr;
  size_t bytes = 0;
  size_t unit = 1;
};

// Bytes [offset, offset + bytes) of job `job`.
struct CopyChunk {
  size_t job = 0;
  size_t offset = 0;
  size_t bytes = 0;
};

// The chunks of `jobs` in order, each at most `max_bytes` (rounded down to the job's unit, and at
// least one unit), covering every byte of every job once. Empty jobs have no chunk.
std::vector<CopyChunk> SplitIntoChunks(std::span<const CopyJob> jobs, size_t max_bytes);

// The device side of a staged copy. Thread t of `threads` owns slots [t * slots_per_thread,
// (t + 1) * slots_per_thread) and calls only its own slots' methods, in this order per chunk:
// WaitFree(slot), then the copy into Buffer(slot), then Submit(slot, chunk). Every method may be
// called from several threads at once for different slots.
class StagingTarget {
 public:
  virtual ~StagingTarget() = default;
  // Called once on each reader thread before its first chunk (e.g. to select the device).
  virtual absl::Status BeginThread(int thread) = 0;
  // Returns once the device has finished with what was last submitted from `slot`.
  virtual absl::Status WaitFree(int slot) = 0;
  // Host memory of at least the largest chunk's size.
  virtual std::byte* Buffer(int slot) = 0;
  // Starts the transfer of the chunk now in Buffer(slot); may return before it ends.
  virtual absl::Status Submit(int slot, const CopyChunk& chunk) = 0;
};

// Copies every chunk through `target` with `threads` reader threads of `slots_per_thread` slots
// each; the chunks are taken in order as threads become free. Returns the first error (the other
// threads stop at their next chunk) once every thread has stopped; the caller waits for the
// device to finish what was submitted.
absl::Status StagedCopy(std::span<const CopyJob> jobs, std::span<const CopyChunk> chunks,
                        int threads, int slots_per_thread, StagingTarget& target);

}  // namespace tandem
