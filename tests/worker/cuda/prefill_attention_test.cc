// The tensor-core prefill attention against a CPU reference (double-precision softmax attention
// over inputs already rounded to the device type): head dims 64 to 128 (100 padded; 64 and 128 run
// the warpgroup-MMA kernel on an H100), grouped-query ratios 1 to 8, chunks that start after a
// cached prefix, rows of several sequences sharing a tile, lengths not a multiple of the tile,
// tiles that reach past the cache's capacity, a sliding window. Skipped where no GPU is present.
// With --gtest_also_run_disabled_tests, PrefillAttentionBenchmark times the kernel alone at the
// llama3.1-8b shape (8,192 rows, 32 heads over 8, head_dim 128) and prints its rate.
#include "worker/cuda/prefill_attention.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/rng.h"
#include "gtest/gtest.h"
#include "tests/worker/cuda/cuda_test_util.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/cuda_stage.h"
#include "worker/cuda/prefill_attention_sm90.h"

namespace tandem::cuda {
namespace {

// A run of rows of one slot at consecutive positions [start, start + len).
struct RowRun {
  int slot, start, len;
};

std::vector<float> Random(size_t n, uint64_t seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = UniformFloat(seed, i) * 2.0f - 1.0f;
  return v;
}

std::vector<uint16_t> ToDevice(DType t, std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  FromFloat(t, v.data(), v.size(), h.data());
  ToFloat(t, h.data(), v.size(), v.data());  // v becomes what the device sees
  return h;
}

template <typename E>
DeviceBuffer Upload(const std::vector<E>& v) {
  DeviceBuffer b;
  EXPECT_TRUE(b.Allocate(std::max<size_t>(v.size() * sizeof(E), 16)).ok());
  EXPECT_EQ(cudaMemcpy(b.get(), v.data(), v.size() * sizeof(E), cudaMemcpyHostToDevice),
            cudaSuccess);
  return b;
}

// (dtype, head_dim, heads per kv head)
class PrefillAttentionTest : public ::testing::TestWithParam<std::tuple<DType, int, int>> {
 protected:
  // Runs the kernel over `runs` and compares every output with the reference.
  void Check(const std::vector<RowRun>& runs, int window) {
    const auto [t, head_dim, group] = GetParam();
    const int kv_heads = 2, heads = kv_heads * group, slots = 3, capacity = 320;
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    std::vector<int32_t> pos, slot;
    for (const RowRun& r : runs) {
      for (int i = 0; i < r.len; ++i) {
        pos.push_back(r.start + i);
        slot.push_back(r.slot);
      }
    }
    const int rows = static_cast<int>(pos.size());
    const size_t cache_n = static_cast<size_t>(slots) * kv_heads * capacity * head_dim;
    std::vector<float> q = Random(static_cast<size_t>(rows) * heads * head_dim, 11);
    std::vector<float> k = Random(cache_n, 12), v = Random(cache_n, 13);
    // Larger query values make the softmax peaked, so that a wrong key shows.
    for (float& x : q) x *= 3.0f;
    const DeviceBuffer qd = Upload(ToDevice(t, q)), kd = Upload(ToDevice(t, k)),
                       vd = Upload(ToDevice(t, v)), pd = Upload(pos), sd = Upload(slot);
    DeviceBuffer od;
    ASSERT_TRUE(od.Allocate(q.size() * 2).ok());
    ASSERT_TRUE(LaunchPrefillAttention(t, qd.get(), kd.get(), vd.get(), pd.as<int32_t>(),
                                       sd.as<int32_t>(), od.get(), rows, heads, kv_heads, head_dim,
                                       capacity, AttentionParams{scale, window}, nullptr)
                    .ok());
    std::vector<uint16_t> oh(q.size());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(oh.data(), od.get(), oh.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    std::vector<float> got(q.size());
    ToFloat(t, oh.data(), oh.size(), got.data());

    // P is rounded to the device type before P·V: about one rounding of each output.
    const double tol = t == DType::kF16 ? 2e-3 : 1.6e-2;
    int bad = 0;
    for (int r = 0; r < rows; ++r) {
      for (int h = 0; h < heads; ++h) {
        const int kvh = h / group;
        const size_t base = (static_cast<size_t>(slot[r]) * kv_heads + kvh) * capacity * head_dim;
        const float* qr = &q[(static_cast<size_t>(r) * heads + h) * head_dim];
        const int lo = window > 0 ? std::max(0, pos[r] - window + 1) : 0;
        std::vector<double> p(pos[r] + 1, 0.0);
        double mx = -1e300, sum = 0.0;
        for (int j = lo; j <= pos[r]; ++j) {
          double s = 0.0;
          for (int d = 0; d < head_dim; ++d) s += qr[d] * k[base + j * head_dim + d];
          p[j] = s * scale;
          mx = std::max(mx, p[j]);
        }
        for (int j = lo; j <= pos[r]; ++j) sum += p[j] = std::exp(p[j] - mx);
        for (int d = 0; d < head_dim; ++d) {
          double o = 0.0;
          for (int j = lo; j <= pos[r]; ++j) o += p[j] * v[base + j * head_dim + d];
          o /= sum;
          const float g = got[(static_cast<size_t>(r) * heads + h) * head_dim + d];
          if (!(std::fabs(g - o) <= tol)) {
            if (++bad <= 5) {
              ADD_FAILURE() << "row " << r << " (slot " << slot[r] << ", position " << pos[r]
                            << ") head " << h << " dim " << d << ": got " << g << ", want " << o;
            }
          }
        }
      }
    }
    EXPECT_EQ(bad, 0);
  }
};


TEST_P(PrefillAttentionTest, WholePromptOfOneSequence) {
  SKIP_WITHOUT_GPU();
  Check({{1, 0, 131}}, 0);
}

TEST_P(PrefillAttentionTest, ChunkAfterCachedPrefixAndSecondPromptShareTiles) {
  SKIP_WITHOUT_GPU();
  // 37 cached positions then a 150-row chunk; a second prompt starts inside the third tile.
  Check({{2, 37, 150}, {0, 0, 90}}, 0);
}

TEST_P(PrefillAttentionTest, ManyShortRunsInOneTile) {
  SKIP_WITHOUT_GPU();
  // Decode-like rows and short chunks of different slots mixed in one 64-row tile.
  Check({{0, 200, 1}, {1, 5, 3}, {2, 63, 2}, {0, 201, 1}, {1, 64, 70}}, 0);
}

TEST_P(PrefillAttentionTest, SingleRowAndOddRunsAcrossTwoBlocks) {
  SKIP_WITHOUT_GPU();
  // A 1-row run, then runs whose ends fall inside both 64-row halves of a block and across the
  // block boundary at row 128.
  Check({{0, 17, 1}, {1, 0, 70}, {2, 120, 100}, {0, 18, 1}}, 0);
}

TEST_P(PrefillAttentionTest, SlidingWindowSeesOnlyTheLastWindowKeys) {
  SKIP_WITHOUT_GPU();
  Check({{1, 100, 120}, {2, 0, 45}}, 50);
}

TEST_P(PrefillAttentionTest, LongPromptWithWindowHasUnmaskedTilesBetweenMaskedOnes) {
  SKIP_WITHOUT_GPU();
  // Rows from 192 on see 150 keys: tiles wholly inside every row's window (no mask) lie between a
  // tile cut by the window's start and one cut by the causal edge.
  Check({{0, 0, 300}, {2, 10, 70}}, 150);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PrefillAttentionTest,
    ::testing::Values(std::make_tuple(DType::kF16, 64, 1), std::make_tuple(DType::kF16, 64, 8),
                      std::make_tuple(DType::kF16, 80, 4), std::make_tuple(DType::kF16, 96, 2),
                      std::make_tuple(DType::kF16, 100, 1), std::make_tuple(DType::kF16, 108, 2),
                      std::make_tuple(DType::kF16, 128, 1), std::make_tuple(DType::kF16, 128, 4),
                      std::make_tuple(DType::kF16, 128, 8), std::make_tuple(DType::kBF16, 64, 4),
                      std::make_tuple(DType::kBF16, 128, 1), std::make_tuple(DType::kBF16, 128, 8)),
    [](const auto& info) {
      return absl::StrCat(std::string(DTypeName(std::get<0>(info.param))), "_d",
                          std::get<1>(info.param), "_g", std::get<2>(info.param));
    });

TEST(PrefillAttentionShapes, RejectsHeadDimsNotCompiled) {
  SKIP_WITHOUT_GPU();
  EXPECT_TRUE(PrefillAttentionSupported(100));
  EXPECT_FALSE(PrefillAttentionSupported(136));
  EXPECT_FALSE(PrefillAttentionSupported(98));
  const absl::Status st =
      LaunchPrefillAttention(DType::kF16, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 1,
                             1, 1, 98, 64, AttentionParams{1.0f, 0}, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("head_dim 98"), std::string::npos) << st;
}

bool IsHopper() {
  int device = 0, major = 0, minor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return major == 9 && minor == 0;
}

TEST(PrefillAttentionShapes, HeadDims64And128TakeTheWarpgroupKernelOnHopper) {
  SKIP_WITHOUT_GPU();
  if (!IsHopper()) GTEST_SKIP() << "not a compute capability 9.0 device";
  DeviceBuffer b;
  ASSERT_TRUE(b.Allocate(1024).ok());
  const char* p = static_cast<const char*>(b.get());
  EXPECT_TRUE(PrefillAttentionSm90Usable(128, p, p, p));
  EXPECT_TRUE(PrefillAttentionSm90Usable(64, p, p, p));
  EXPECT_FALSE(PrefillAttentionSm90Usable(96, p, p, p));
  EXPECT_FALSE(PrefillAttentionSm90Usable(128, p + 8, p, p));  // TMA needs 16-byte alignment
}

// The kernel alone at the llama3.1-8b shape: one prompt of 8,192 rows, 32 heads over 8 KV heads
// of 128; the rate counts QKᵀ and PV over each row's visible keys (2 FLOPs per multiply-add).
// Disabled (gtest's DISABLED_: listed, never run, not a skip) unless asked for with
// --gtest_also_run_disabled_tests.
TEST(PrefillAttentionBenchmark, DISABLED_Llama8bShape) {
  SKIP_WITHOUT_GPU();
  const int rows = 8192, heads = 32, kv_heads = 8, head_dim = 128, capacity = 8192;
  const size_t q_bytes = static_cast<size_t>(rows) * heads * head_dim * 2;
  const size_t cache_bytes = static_cast<size_t>(kv_heads) * capacity * head_dim * 2;
  std::vector<int32_t> pos(rows), slot(rows, 0);
  for (int i = 0; i < rows; ++i) pos[i] = i;
  std::vector<float> x = Random(q_bytes / 2, 21);
  const DeviceBuffer qd = Upload(ToDevice(DType::kF16, x)), pd = Upload(pos), sd = Upload(slot);
  x = Random(cache_bytes / 2, 22);
  const DeviceBuffer kd = Upload(ToDevice(DType::kF16, x));
  x = Random(cache_bytes / 2, 23);
  const DeviceBuffer vd = Upload(ToDevice(DType::kF16, x));
  DeviceBuffer od;
  ASSERT_TRUE(od.Allocate(q_bytes).ok());
  auto launch = [&] {
    return LaunchPrefillAttention(DType::kF16, qd.get(), kd.get(), vd.get(), pd.as<int32_t>(),
                                  sd.as<int32_t>(), od.get(), rows, heads, kv_heads, head_dim,
                                  capacity, AttentionParams{0.088f, 0}, nullptr);
  };
  ASSERT_TRUE(launch().ok());
  cudaEvent_t start, stop;
  ASSERT_EQ(cudaEventCreate(&start), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&stop), cudaSuccess);
  constexpr int kReps = 20;
  ASSERT_EQ(cudaEventRecord(start), cudaSuccess);
  for (int i = 0; i < kReps; ++i) ASSERT_TRUE(launch().ok());
  ASSERT_EQ(cudaEventRecord(stop), cudaSuccess);
  ASSERT_EQ(cudaEventSynchronize(stop), cudaSuccess);
  float ms = 0.0f;
  ASSERT_EQ(cudaEventElapsedTime(&ms, start, stop), cudaSuccess);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  const double us = ms * 1e3 / kReps;
  const double flops = 4.0 * heads * head_dim * (static_cast<double>(rows) * (rows + 1) / 2);
  std::printf(
      "prefill attention %d rows, %d heads over %d, head_dim %d, %s: %.1f us, %.0f TFLOP/s\n", rows,
      heads, kv_heads, head_dim,
      PrefillAttentionSm90Usable(head_dim, qd.get(), kd.get(), vd.get()) ? "wgmma" : "mma.sync", us,
      flops / us * 1e-6);
}

}  // namespace
}  // namespace tandem::cuda
