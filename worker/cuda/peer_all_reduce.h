// A one-shot all-reduce over NVLink peer memory for the ranks of one process (the tensor-parallel
// GPUs of a CUDA stage, worker/cuda/cuda_tensor_parallel.h): each rank copies its input into a
// staging buffer of its own, tells every peer so through a flag in the peer's memory, waits for
// the peers' flags, and sums every rank's staging buffer, read over NVLink, in rank order in fp32.
// Every rank gets the same bits. One kernel per call, with no host work and its epoch counters in
// device memory, so that it is captured in a CUDA graph once and replayed any number of times.
// It is launched as a programmatic dependent launch and lets the kernel after it start at once:
// the projection that wrote its input drains while it starts, and the next layer's kernels may
// prefetch their weights while it waits for its peers.
// For the small messages of decode (a few rows of the hidden state) it takes a few microseconds
// where NCCL's ring takes ~20; larger messages are NCCL's.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace tandem::cuda {

class PeerAllReduce {
 public:
  static constexpr int kMaxRanks = 8;
  static constexpr int kBlocks = 32;  // at most; each block sums a slice, with barriers of its own

  // Peer access between every pair of devices [first_device, first_device + ranks), enabled here;
  // FAILED_PRECONDITION naming the pair where a device cannot reach another. `max_elements`:
  // the largest message, in 2-byte elements.
  static absl::StatusOr<std::unique_ptr<PeerAllReduce>> Create(int first_device, int ranks,
                                                               size_t max_elements);
  ~PeerAllReduce();
  PeerAllReduce(const PeerAllReduce&) = delete;
  PeerAllReduce& operator=(const PeerAllReduce&) = delete;

  int ranks() const { return ranks_; }
  size_t max_elements() const { return max_elements_; }

  // Rank `rank`'s part of one all-reduce (sum) of `elements` values of `dtype` (F16 or BF16) at
  // `x` (on the rank's device), in place, launched on `stream` (the rank's device current).
  // Every rank must make the same calls in the same order.
  absl::Status Run(int rank, void* x, size_t elements, DType dtype, cudaStream_t stream) const;

 private:
  PeerAllReduce() = default;

  int first_device_ = 0;
  int ranks_ = 0;
  size_t max_elements_ = 0;
  // Per rank, on its device: two staging buffers of max_elements (by the call's parity), the
  // flags its peers write (kBlocks x kMaxRanks), its blocks' epochs (kBlocks).
  std::vector<void*> staging_;
  std::vector<unsigned*> flags_;
  std::vector<unsigned*> epochs_;
};

}  // namespace tandem::cuda
