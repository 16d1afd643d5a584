// The CPU all-reduce on real threads: every rank ends with the same elementwise sum, over sizes
// that do not divide by the ranks and over repeated calls.
#include "worker/cpu/cpu_all_reduce.h"

#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace tandem {
namespace {

TEST(CpuAllReduceTest, EveryRankEndsWithTheSumOfAllRanksData) {
  for (int ranks : {1, 2, 3, 4}) {
    CpuAllReduce all_reduce(ranks);
    for (size_t n : {size_t{1}, size_t{7}, size_t{64}}) {
      // Rank r's element i: r * 1000 + i, so the sum is 1000 * (0 + ... + ranks-1) + ranks * i.
      std::vector<std::vector<float>> data(ranks, std::vector<float>(n));
      for (int r = 0; r < ranks; ++r) {
        for (size_t i = 0; i < n; ++i) data[r][i] = static_cast<float>(r * 1000 + i);
      }
      std::vector<std::thread> threads;
      for (int r = 0; r < ranks; ++r) {
        threads.emplace_back([&, r] {
          for (int repeat = 0; repeat < 3; ++repeat) {  // sums of sums: x, ranks x, ranks² x
            all_reduce.Sum(r, data[r].data(), n);
          }
        });
      }
      for (std::thread& t : threads) t.join();
      const float scale = static_cast<float>(ranks * ranks);
      for (int r = 0; r < ranks; ++r) {
        for (size_t i = 0; i < n; ++i) {
          const float sum = 1000.0f * (ranks * (ranks - 1) / 2) + static_cast<float>(ranks * i);
          ASSERT_EQ(data[r][i], sum * scale) << ranks << " ranks, n " << n << ", rank " << r
                                             << ", element " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace tandem
