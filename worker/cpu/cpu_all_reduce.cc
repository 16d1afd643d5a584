// The shared-memory all-reduce of a CPU stage's tensor-parallel ranks (cpu_all_reduce.h).
#include "worker/cpu/cpu_all_reduce.h"

#include <algorithm>

namespace tandem {

CpuAllReduce::CpuAllReduce(int ranks)
    : ranks_(ranks), barrier_(ranks), buffers_(ranks, nullptr), slices_(ranks) {}

void CpuAllReduce::Sum(int rank, float* data, size_t n) {
  const size_t per = (n + ranks_ - 1) / ranks_;
  auto slice_begin = [&](int r) { return std::min(n, per * r); };
  buffers_[rank] = data;
  // The barriers order the phases: every buffer is published before any is read; every slice is
  // summed before any is copied back (and no buffer is read once its owner writes it); and no
  // rank's next Sum overwrites a slice before every rank has copied it (its first barrier).
  barrier_.arrive_and_wait();
  const size_t begin = slice_begin(rank), end = slice_begin(rank + 1);
  std::vector<float>& mine = slices_[rank];
  mine.assign(buffers_[0] + begin, buffers_[0] + end);
  for (int r = 1; r < ranks_; ++r) {
    const float* other = buffers_[r];
    for (size_t i = begin; i < end; ++i) mine[i - begin] += other[i];
  }
  barrier_.arrive_and_wait();
  for (int r = 0; r < ranks_; ++r) {
    std::copy(slices_[r].begin(), slices_[r].end(), data + slice_begin(r));
  }
}

}  // namespace tandem
