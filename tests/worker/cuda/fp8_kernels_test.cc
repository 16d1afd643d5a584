// The FP8-weight kernels against CPU references computed from the same E4M3 codes and row
// scales (common/fp8_quantize.h): the decode GEMV with every epilogue, row count and launch
// shape, the QKV-into-cache GEMV against the GEMV followed by the split/rotate kernel, and the
// dequantization the GEMM path uses. Skipped where no GPU is present.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/dtype.h"
#include "common/fp8_quantize.h"
#include "common/rng.h"
#include "gtest/gtest.h"
#include "tests/worker/cuda/cuda_test_util.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/cuda_stage.h"
#include "worker/cuda/fp8_gemm.h"
#include "worker/cuda/kernels.h"

namespace tandem::cuda {
namespace {

std::vector<float> Random(size_t n, uint64_t seed, float scale = 1.0f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = (UniformFloat(seed, i) * 2.0f - 1.0f) * scale;
  return v;
}

std::vector<float> Round(DType t, std::vector<float> v) {
  std::vector<uint16_t> h(v.size());
  FromFloat(t, v.data(), v.size(), h.data());
  ToFloat(t, h.data(), v.size(), v.data());
  return v;
}
float RoundHost(DType t, float f) { return Round(t, {f})[0]; }

template <typename T>
DeviceBuffer UploadRaw(const std::vector<T>& v) {
  DeviceBuffer b;
  EXPECT_TRUE(b.Allocate(std::max<size_t>(v.size() * sizeof(T), 16)).ok());
  EXPECT_EQ(cudaMemcpy(b.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return b;
}

DeviceBuffer Upload(DType t, const std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  FromFloat(t, v.data(), v.size(), h.data());
  return UploadRaw(h);
}

std::vector<float> Download(DType t, const DeviceBuffer& b, size_t n) {
  std::vector<uint16_t> h(n);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(h.data(), b.get(), n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<float> v(n);
  ToFloat(t, h.data(), n, v.data());
  return v;
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, float rel,
                 float abs, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(got[i] - want[i]) <= rel * std::fabs(want[i]) + abs)) {
      if (++bad <= 5)
        ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

// A (rows, cols) weight quantized per row: codes, scales, and the values they stand for.
struct Fp8Weight {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<float> values;
};
Fp8Weight MakeWeight(int rows, int cols, uint64_t seed) {
  Fp8Weight w;
  // Rows of different magnitudes, so that a scale applied to the wrong row shows.
  std::vector<float> v = Random(static_cast<size_t>(rows) * cols, seed, 0.2f);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) v[static_cast<size_t>(r) * cols + c] *= 1.0f + (r % 5);
  }
  w.codes.resize(v.size());
  w.scales.resize(rows);
  EXPECT_TRUE(
      QuantizeE4M3(v.data(), rows, cols, 1, cols, "w", w.codes.data(), w.scales.data()).ok());
  w.values.resize(v.size());
  DequantizeE4M3Rows(w.codes.data(), w.scales.data(), rows, cols, w.values.data());
  return w;
}

class Fp8KernelTest : public ::testing::TestWithParam<DType> {
 protected:
  DType t() const { return GetParam(); }
  float tol() const { return t() == DType::kF16 ? 4e-3f : 3e-2f; }
};

TEST_P(Fp8KernelTest, GemvMatchesReferenceForEveryEpilogueAndRowCount) {
  SKIP_WITHOUT_GPU();
  const int n = 37;
  // Codes per lane: 8 (8-byte loads) and 16 (16-byte loads, K a multiple of 16, refused elsewhere);
  // K of 1040 ends inside a 512-code step.
  const GemvTuning tunings[] = {{},     {1, 1},    {2, 1},     {1, 4},
                                {2, 2}, {0, 0, 8}, {1, 1, 16}, {2, 4, 16}};
  for (int k : {520, 1040}) {
    for (int m : {1, 2, 4, 8}) {
      for (GemvEpilogue e : {GemvEpilogue::kStore, GemvEpilogue::kResidual, GemvEpilogue::kGelu,
                             GemvEpilogue::kSwiGlu, GemvEpilogue::kF32}) {
        for (const GemvTuning& tuning : tunings) {
          SCOPED_TRACE(testing::Message()
                       << "K " << k << ", rows " << m << ", epilogue " << static_cast<int>(e)
                       << ", rows/warp " << tuning.rows_per_warp << ", K split " << tuning.k_split
                       << ", codes/lane " << tuning.fp8_lane_codes);
          const bool swiglu = e == GemvEpilogue::kSwiGlu, f32 = e == GemvEpilogue::kF32;
          const int wrows = swiglu ? 2 * n : n;
          const uint64_t seed = 500 + 10 * m + static_cast<int>(e);
          const auto x = Round(t(), Random(m * k, seed));
          const Fp8Weight w = MakeWeight(wrows, k, seed + 1000);
          const auto b = Round(t(), Random(n, seed + 2000));
          const auto y0 = Round(t(), Random(m * n, seed + 3000));
          DeviceBuffer dx = Upload(t(), x), dw = UploadRaw(w.codes), ds = UploadRaw(w.scales),
                       db = Upload(t(), b), dy;
          if (f32) {
            dy = UploadRaw(std::vector<float>(m * n, std::nanf("")));
          } else {
            dy = Upload(
                t(), e == GemvEpilogue::kResidual ? y0 : std::vector<float>(m * n, std::nanf("")));
          }
          const absl::Status st =
              GemvFp8(t(), e, dx.get(), dw.get(), ds.as<float>(), swiglu ? nullptr : db.get(),
                      dy.get(), m, n, k, nullptr, tuning);
          if (tuning.fp8_lane_codes == 16 && k % 16 != 0) {
            EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
            continue;
          }
          ASSERT_TRUE(st.ok()) << st;
          std::vector<float> want(m * n);
          for (int r = 0; r < m; ++r) {
            for (int o = 0; o < n; ++o) {
              auto dot = [&](int row) {
                double s = 0;
                for (int i = 0; i < k; ++i)
                  s += double(x[r * k + i]) * w.values[size_t(row) * k + i];
                return s;
              };
              const double v = dot(o) + (swiglu ? 0.0 : b[o]);
              float& out = want[r * n + o];
              switch (e) {
                case GemvEpilogue::kStore:
                case GemvEpilogue::kF32:
                  out = v;
                  break;
                case GemvEpilogue::kResidual:
                  out = y0[r * n + o] + RoundHost(t(), v);
                  break;
                case GemvEpilogue::kGelu: {
                  const double g = RoundHost(t(), v);
                  out =
                      0.5 * g * (1.0 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)));
                  break;
                }
                case GemvEpilogue::kSwiGlu: {
                  const double g = RoundHost(t(), dot(o)), u = RoundHost(t(), dot(n + o));
                  out = RoundHost(t(), g / (1.0 + std::exp(-g))) * u;
                  break;
                }
                default:
                  break;
              }
            }
          }
          if (f32) {
            std::vector<float> got(m * n);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            ASSERT_EQ(cudaMemcpy(got.data(), dy.get(), got.size() * 4, cudaMemcpyDeviceToHost),
                      cudaSuccess);
            ExpectClose(got, want, 1e-4f, 1e-4f, "fp8 gemv fp32");
          } else {
            ExpectClose(Download(t(), dy, m * n), want, 2 * tol(), 1e-2f, "fp8 gemv");
          }
        }
      }
    }
  }
}

// The fused QKV GEMV with FP8 weights writes the bits of the FP8 GEMV followed by the
// split/rotate kernel (both with one warp per K, the same order of the sums).
TEST_P(Fp8KernelTest, GemvQkvCacheEqualsGemvThenRopeCache) {
  SKIP_WITHOUT_GPU();
  const int heads = 4, kv_heads = 2, head_dim = 16, k = 256, cap = 64, slots = 3;
  const int out = (heads + 2 * kv_heads) * head_dim;
  std::vector<float> inv_freq(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * i / head_dim);
  for (int m : {1, 2, 4, 8}) {
    SCOPED_TRACE(m);
    const auto x = Round(t(), Random(m * k, 7000 + m));
    const Fp8Weight w = MakeWeight(out, k, 8000 + m);
    const auto b = Round(t(), Random(out, 9000 + m));
    std::vector<int32_t> pos(m), slot(m);
    for (int r = 0; r < m; ++r) pos[r] = 3 * r + 1, slot[r] = r % slots;
    DeviceBuffer dx = Upload(t(), x), dw = UploadRaw(w.codes), ds = UploadRaw(w.scales),
                 db = Upload(t(), b), dpos = UploadRaw(pos), dslot = UploadRaw(slot),
                 dfreq = UploadRaw(inv_freq), dqkv = Upload(t(), std::vector<float>(m * out));
    const size_t cache = static_cast<size_t>(slots) * kv_heads * cap * head_dim;
    DeviceBuffer q1 = Upload(t(), std::vector<float>(m * heads * head_dim)),
                 q2 = Upload(t(), std::vector<float>(m * heads * head_dim)),
                 k1 = Upload(t(), std::vector<float>(cache)),
                 v1 = Upload(t(), std::vector<float>(cache)),
                 k2 = Upload(t(), std::vector<float>(cache)),
                 v2 = Upload(t(), std::vector<float>(cache));
    ASSERT_TRUE(GemvFp8(t(), GemvEpilogue::kStore, dx.get(), dw.get(), ds.as<float>(), db.get(),
                        dqkv.get(), m, out, k, nullptr, {0, 1})
                    .ok());
    ASSERT_TRUE(LaunchQkvRopeCache(t(), dqkv.get(), nullptr, q1.get(), k1.get(), v1.get(),
                                   dpos.as<int32_t>(), dslot.as<int32_t>(), m, heads, kv_heads,
                                   head_dim, cap, dfreq.as<float>(), nullptr)
                    .ok());
    QkvCacheArgs a;
    a.q_out = q2.get();
    a.k_cache = k2.get();
    a.v_cache = v2.get();
    a.positions = dpos.as<int32_t>();
    a.slots = dslot.as<int32_t>();
    a.num_heads = heads;
    a.num_kv_heads = kv_heads;
    a.head_dim = head_dim;
    a.seq_capacity = cap;
    a.inv_freq = dfreq.as<float>();
    ASSERT_TRUE(
        GemvQkvCacheFp8(t(), dx.get(), dw.get(), ds.as<float>(), db.get(), a, m, k, nullptr, {0, 1})
            .ok());
    EXPECT_EQ(Download(t(), q1, m * heads * head_dim), Download(t(), q2, m * heads * head_dim));
    EXPECT_EQ(Download(t(), k1, cache), Download(t(), k2, cache));
    EXPECT_EQ(Download(t(), v1, cache), Download(t(), v2, cache));
  }
}

// The GEMM path's weights: each value E4M3(code) * scale rounded once to the dtype.
TEST_P(Fp8KernelTest, DequantizedRowsAreTheRoundedValues) {
  SKIP_WITHOUT_GPU();
  const int rows = 19, cols = 136;
  const Fp8Weight w = MakeWeight(rows, cols, 42);
  DeviceBuffer dw = UploadRaw(w.codes), ds = UploadRaw(w.scales),
               dout = Upload(t(), std::vector<float>(rows * cols, std::nanf("")));
  ASSERT_TRUE(
      LaunchDequantizeFp8Rows(t(), dw.get(), ds.as<float>(), dout.get(), rows, cols, nullptr).ok());
  EXPECT_EQ(Download(t(), dout, rows * cols), Round(t(), w.values));
  EXPECT_FALSE(
      LaunchDequantizeFp8Rows(t(), dw.get(), ds.as<float>(), dout.get(), rows, 12, nullptr).ok());
}

// Activations quantized per row: each row's largest magnitude becomes E4M3's largest value (448)
// and every code stands for its input within half an E4M3 step (a relative 2^-4).
TEST_P(Fp8KernelTest, RowsQuantizeToTheirOwnScale) {
  SKIP_WITHOUT_GPU();
  const int rows = 5, cols = 272;
  std::vector<float> x = Random(static_cast<size_t>(rows) * cols, 77);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) x[static_cast<size_t>(r) * cols + c] *= std::pow(10.0f, r - 2);
  }
  for (int c = 0; c < cols; ++c) x[static_cast<size_t>(4) * cols + c] = 0.0f;  // an all-zero row
  x = Round(t(), x);
  DeviceBuffer dx = Upload(t(), x), codes, scales;
  ASSERT_TRUE(codes.Allocate(rows * cols).ok());
  ASSERT_TRUE(scales.Allocate(rows * sizeof(float)).ok());
  ASSERT_TRUE(
      LaunchQuantizeRowsFp8(t(), dx.get(), codes.get(), scales.as<float>(), rows, cols, nullptr)
          .ok());
  std::vector<uint8_t> hc(rows * cols);
  std::vector<float> hs(rows), back(rows * cols);
  ASSERT_EQ(cudaMemcpy(hc.data(), codes.get(), hc.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(hs.data(), scales.get(), hs.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  DequantizeE4M3Rows(hc.data(), hs.data(), rows, cols, back.data());
  for (int r = 0; r < rows; ++r) {
    float amax = 0.0f;
    for (int c = 0; c < cols; ++c)
      amax = std::max(amax, std::fabs(x[static_cast<size_t>(r) * cols + c]));
    EXPECT_FLOAT_EQ(hs[r], amax > 0.0f ? amax / 448.0f : 1.0f) << "row " << r;
  }
  ExpectClose(back, x, 1.0f / 16, 0.0f, "dequantized activations");
  EXPECT_FALSE(
      LaunchQuantizeRowsFp8(t(), dx.get(), codes.get(), scales.as<float>(), rows, 24, nullptr)
          .ok());
}

// The FP8 tensor-core GEMM against the product of the values its codes stand for (the weight's
// per-channel and the activations' per-row scales applied), with and without accumulating into y,
// at row counts of decode batches and prompts. Where cuBLASLt offers no FP8 GEMM it says so.
TEST_P(Fp8KernelTest, Fp8GemmIsTheProductOfTheQuantizedValues) {
  SKIP_WITHOUT_GPU();
  absl::StatusOr<std::unique_ptr<Fp8Gemm>> gemm = Fp8Gemm::Create(nullptr, 64);
  if (absl::IsUnavailable(gemm.status())) GTEST_SKIP() << gemm.status();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  std::printf("FP8 GEMM scales applied %s\n", (*gemm)->outer_vector_scales()
                                                  ? "by cuBLASLt (outer vectors)"
                                                  : "by the fp32 epilogue");
  const int out = 48, in = 256;
  const Fp8Weight w = MakeWeight(out, in, 91);
  DeviceBuffer dw = UploadRaw(w.codes), ds = UploadRaw(w.scales), codes, scales;
  ASSERT_TRUE(codes.Allocate(1024 * in).ok());
  ASSERT_TRUE(scales.Allocate(1024 * sizeof(float)).ok());
  for (int rows : {1, 7, 64, 300, 700}) {
    for (float beta : {0.0f, 1.0f}) {
      SCOPED_TRACE(testing::Message() << "rows " << rows << ", beta " << beta);
      const auto x = Round(t(), Random(static_cast<size_t>(rows) * in, 300 + rows));
      const auto y0 = Round(t(), Random(static_cast<size_t>(rows) * out, 700 + rows));
      DeviceBuffer dx = Upload(t(), x), dy = Upload(t(), y0);
      ASSERT_TRUE((*gemm)
                      ->Run(t(), dx.get(), dw.get(), ds.as<float>(), dy.get(), rows, out, in, beta,
                            codes.get(), scales.as<float>())
                      .ok());
      const std::vector<float> got = Download(t(), dy, static_cast<size_t>(rows) * out);
      // The reference from the activations' own codes and scales, as the kernel made them.
      std::vector<uint8_t> hc(static_cast<size_t>(rows) * in);
      std::vector<float> hs(rows), xq(hc.size());
      ASSERT_EQ(cudaMemcpy(hc.data(), codes.get(), hc.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(hs.data(), scales.get(), rows * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      DequantizeE4M3Rows(hc.data(), hs.data(), rows, in, xq.data());
      std::vector<float> want(static_cast<size_t>(rows) * out);
      for (int r = 0; r < rows; ++r) {
        for (int o = 0; o < out; ++o) {
          double acc = 0.0;
          for (int k = 0; k < in; ++k) {
            acc += static_cast<double>(xq[static_cast<size_t>(r) * in + k]) *
                   w.values[static_cast<size_t>(o) * in + k];
          }
          want[static_cast<size_t>(r) * out + o] =
              RoundHost(t(), static_cast<float>(acc) + beta * y0[static_cast<size_t>(r) * out + o]);
        }
      }
      ExpectClose(got, want, tol(), tol(), "FP8 GEMM");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, Fp8KernelTest, ::testing::Values(DType::kF16, DType::kBF16),
                         [](const auto& info) {
                           return info.param == DType::kF16 ? std::string("F16")
                                                            : std::string("BF16");
                         });

}  // namespace
}  // namespace tandem::cuda
