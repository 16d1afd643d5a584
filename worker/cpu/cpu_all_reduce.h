// The CPU backend's all-reduce: the ranks of a tensor-parallel stage are threads of one process,
// and sum their partial outputs through shared memory.
#pragma once

#include <barrier>
#include <cstddef>
#include <vector>

namespace tandem {

class CpuAllReduce {
 public:
  explicit CpuAllReduce(int ranks);
  int ranks() const { return ranks_; }

  // Every rank calls it at once with its own `n` floats; each returns with the elementwise sum
  // over the ranks in `data`. The sum runs in rank order, so every rank holds the same bits.
  // Each rank reduces a slice of the elements (a reduce-scatter), then copies all slices (an
  // all-gather). A rank that does not come blocks the others.
  void Sum(int rank, float* data, size_t n);

 private:
  const int ranks_;
  std::barrier<> barrier_;
  std::vector<float*> buffers_;             // per rank: its data in the running Sum
  std::vector<std::vector<float>> slices_;  // per rank: the sums of its slice
};

}  // namespace tandem
