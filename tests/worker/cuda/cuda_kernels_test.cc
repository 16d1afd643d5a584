// Each CUDA kernel against a CPU reference on inputs already rounded to the device type, so that
// the comparison sees only the kernel's own arithmetic. Skipped where no GPU is present.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "common/rng.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/cuda/cuda_test_util.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/cuda_stage.h"
#include "worker/cuda/head_norm.h"
#include "worker/cuda/kernels.h"
#include "worker/sampling.h"

namespace tandem::cuda {
namespace {

std::vector<float> Random(size_t n, uint64_t seed, float scale = 1.0f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = (UniformFloat(seed, i) * 2.0f - 1.0f) * scale;
  return v;
}

// Rounds every element through `t`, as the device will see it.
std::vector<float> Quantize(DType t, std::vector<float> v) {
  std::vector<uint16_t> h(v.size());
  FromFloat(t, v.data(), v.size(), h.data());
  ToFloat(t, h.data(), v.size(), v.data());
  return v;
}

DeviceBuffer Upload(DType t, const std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  FromFloat(t, v.data(), v.size(), h.data());
  DeviceBuffer b;
  EXPECT_TRUE(b.Allocate(std::max<size_t>(h.size() * 2, 16)).ok());
  EXPECT_EQ(cudaMemcpy(b.get(), h.data(), h.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  return b;
}

template <typename T>
DeviceBuffer UploadRaw(const std::vector<T>& v) {
  DeviceBuffer b;
  EXPECT_TRUE(b.Allocate(std::max<size_t>(v.size() * sizeof(T), 16)).ok());
  EXPECT_EQ(cudaMemcpy(b.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return b;
}

std::vector<float> Download(DType t, const DeviceBuffer& b, size_t n) {
  std::vector<uint16_t> h(n);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(h.data(), b.get(), n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<float> f(n);
  ToFloat(t, h.data(), n, f.data());
  return f;
}

// |a - b| <= rel * |b| + abs, element by element.
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

class KernelTest : public ::testing::TestWithParam<DType> {
 protected:
  DType t() const { return GetParam(); }
  // bf16 keeps 8 bits of mantissa, fp16 11.
  float tol() const { return t() == DType::kF16 ? 4e-3f : 3e-2f; }
};

// Widths at both sides of each register-count instantiation of the norm kernel (rows of up to
// 2,048, 4,096, 8,192 and 16,384 columns), and openllama-3b's 3,200.
TEST_P(KernelTest, RmsNormAddsPendingBiasAndMatchesReference) {
  SKIP_WITHOUT_GPU();
  for (const int cols : {8, 2048, 2056, 3200, 4096, 4104, 8192, 8200, 16384}) {
    SCOPED_TRACE(cols);
    const int rows = 3;
    auto x = Quantize(t(), Random(rows * cols, 1, 2.0f));
    auto bias = Quantize(t(), Random(cols, 2, 0.5f));
    auto w = Quantize(t(), Random(cols, 3, 1.0f));
    DeviceBuffer dx = Upload(t(), x), db = Upload(t(), bias), dw = Upload(t(), w);
    DeviceBuffer out;
    ASSERT_TRUE(out.Allocate(rows * cols * 2).ok());
    ASSERT_TRUE(LaunchNorm(t(), true, dx.get(), db.get(), dw.get(), nullptr, nullptr, out.get(),
                           rows, cols, 1e-6f, nullptr)
                    .ok());
    std::vector<float> want(rows * cols), want_x(rows * cols);
    for (int r = 0; r < rows; ++r) {
      double ss = 0;
      for (int c = 0; c < cols; ++c) {
        want_x[r * cols + c] = Quantize(t(), {x[r * cols + c] + bias[c]})[0];
        ss += double(want_x[r * cols + c]) * want_x[r * cols + c];
      }
      const double inv = 1.0 / std::sqrt(ss / cols + 1e-6);
      for (int c = 0; c < cols; ++c) want[r * cols + c] = want_x[r * cols + c] * inv * w[c];
    }
    ExpectClose(Download(t(), out, rows * cols), want, 2 * tol(), 1e-3f, "rmsnorm");
    ExpectClose(Download(t(), dx, rows * cols), want_x, 0, 0, "residual with bias");
  }
}

// Qwen3's q_norm / k_norm in place in qkv rows: with a bias (v heads get it alone) and without
// (v heads untouched), at head_dim 128 and at 40 (not a multiple of the warp).
TEST_P(KernelTest, HeadNormNormsQAndKHeadsInPlaceAndMatchesReference) {
  SKIP_WITHOUT_GPU();
  for (const int hd : {128, 40}) {
    for (const bool with_bias : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "head_dim " << hd << " bias " << with_bias);
      const int rows = 3, heads = 4, kv_heads = 2, cols = (heads + 2 * kv_heads) * hd;
      auto x = Quantize(t(), Random(rows * cols, 11, 2.0f));
      auto bias = Quantize(t(), Random(cols, 12, 0.5f));
      auto qw = Quantize(t(), Random(hd, 13, 1.0f));
      auto kw = Quantize(t(), Random(hd, 14, 1.0f));
      DeviceBuffer dx = Upload(t(), x), db = Upload(t(), bias), dq = Upload(t(), qw),
                   dk = Upload(t(), kw);
      ASSERT_TRUE(LaunchHeadNorm(t(), dx.get(), with_bias ? db.get() : nullptr, dq.get(), dk.get(),
                                 rows, heads, kv_heads, hd, 1e-6f, nullptr)
                      .ok());
      std::vector<float> want(rows * cols);
      for (int r = 0; r < rows; ++r) {
        for (int h = 0; h < heads + 2 * kv_heads; ++h) {
          const int base = r * cols + h * hd;
          double ss = 0;
          for (int j = 0; j < hd; ++j) {
            const float b = with_bias ? bias[h * hd + j] : 0.0f;
            want[base + j] = with_bias ? Quantize(t(), {x[base + j] + b})[0] : x[base + j];
            ss += double(want[base + j]) * want[base + j];
          }
          if (h >= heads + kv_heads) continue;  // a v head: the bias only
          const std::vector<float>& w = h < heads ? qw : kw;
          const double inv = 1.0 / std::sqrt(ss / hd + 1e-6);
          for (int j = 0; j < hd; ++j) want[base + j] = want[base + j] * inv * w[j];
        }
      }
      ExpectClose(Download(t(), dx, rows * cols), want, 2 * tol(), 1e-3f, "head norm");
    }
  }
}

TEST_P(KernelTest, LayerNormGathersRowsAndMatchesReference) {
  SKIP_WITHOUT_GPU();
  const int rows = 4, cols = 768;
  auto x = Quantize(t(), Random(rows * cols, 4, 3.0f));
  for (int c = 0; c < cols; ++c) x[2 * cols + c] += 5.0f;  // a large mean
  x = Quantize(t(), x);
  auto w = Quantize(t(), Random(cols, 5, 1.0f));
  auto b = Quantize(t(), Random(cols, 6, 0.3f));
  DeviceBuffer dx = Upload(t(), x), dw = Upload(t(), w), dbias = Upload(t(), b);
  std::vector<int32_t> gather = {2, 0};
  DeviceBuffer dg = UploadRaw(gather);
  DeviceBuffer out;
  ASSERT_TRUE(out.Allocate(2 * cols * 2).ok());
  ASSERT_TRUE(LaunchNorm(t(), false, dx.get(), nullptr, dw.get(), dbias.get(), dg.as<int32_t>(),
                         out.get(), 2, cols, 1e-5f, nullptr)
                  .ok());
  std::vector<float> want(2 * cols);
  for (int i = 0; i < 2; ++i) {
    const float* row = &x[gather[i] * cols];
    double mean = 0, var = 0;
    for (int c = 0; c < cols; ++c) mean += row[c];
    mean /= cols;
    for (int c = 0; c < cols; ++c) var += (row[c] - mean) * (row[c] - mean);
    var /= cols;
    for (int c = 0; c < cols; ++c) {
      want[i * cols + c] = (row[c] - mean) / std::sqrt(var + 1e-5) * w[c] + b[c];
    }
  }
  ExpectClose(Download(t(), out, 2 * cols), want, 2 * tol(), 2e-3f, "layernorm");
}

TEST_P(KernelTest, NormRejectsWidthNotMultipleOfEight) {
  SKIP_WITHOUT_GPU();
  EXPECT_FALSE(LaunchNorm(t(), true, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 1, 12,
                          1e-5f, nullptr)
                   .ok());
}

TEST_P(KernelTest, EmbeddingAddsLearnedPositions) {
  SKIP_WITHOUT_GPU();
  const int vocab = 10, hidden = 16, positions = 8;
  auto tok = Quantize(t(), Random(vocab * hidden, 7));
  auto pos = Quantize(t(), Random(positions * hidden, 8));
  DeviceBuffer dt = Upload(t(), tok), dp = Upload(t(), pos);
  std::vector<int32_t> ids = {3, 9, 0}, at = {0, 7, 2};
  DeviceBuffer di = UploadRaw(ids), da = UploadRaw(at), out;
  ASSERT_TRUE(out.Allocate(3 * hidden * 2).ok());
  ASSERT_TRUE(LaunchEmbedding(t(), di.as<int32_t>(), da.as<int32_t>(), dt.get(), dp.get(),
                              out.get(), 3, hidden, nullptr)
                  .ok());
  std::vector<float> want(3 * hidden);
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < hidden; ++c) {
      want[r * hidden + c] = tok[ids[r] * hidden + c] + pos[at[r] * hidden + c];
    }
  }
  ExpectClose(Download(t(), out, 3 * hidden), want, tol(), 1e-3f, "embedding");
}

TEST_P(KernelTest, RopeRotatesQueryAndKeyAndFillsCacheSlot) {
  SKIP_WITHOUT_GPU();
  const int rows = 2, heads = 4, kv_heads = 2, hd = 16, cap = 128, slots = 2;
  const int q_dim = heads * hd, kv_dim = kv_heads * hd, cols = q_dim + 2 * kv_dim;
  auto qkv = Quantize(t(), Random(rows * cols, 9));
  DeviceBuffer dqkv = Upload(t(), qkv), q, k, v;
  ASSERT_TRUE(q.Allocate(rows * q_dim * 2).ok());
  const size_t cache = size_t{slots} * kv_heads * cap * hd;
  ASSERT_TRUE(k.Allocate(cache * 2).ok());
  ASSERT_TRUE(v.Allocate(cache * 2).ok());
  cudaMemset(k.get(), 0, cache * 2);
  cudaMemset(v.get(), 0, cache * 2);
  std::vector<int32_t> pos = {5, 100}, slot = {1, 0};
  DeviceBuffer dpos = UploadRaw(pos), dslot = UploadRaw(slot);
  // Frequencies from the host, as the stage passes them: here scaled unevenly (llama3-like), so
  // that a kernel using any other frequency than inv_freq[i] for pair i fails.
  std::vector<float> inv_freq(hd / 2);
  for (int i = 0; i < hd / 2; ++i) {
    inv_freq[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / hd) / (i % 3 == 0 ? 8.0 : 1.0));
  }
  DeviceBuffer dfreq = UploadRaw(inv_freq);
  ASSERT_TRUE(LaunchQkvRopeCache(t(), dqkv.get(), nullptr, q.get(), k.get(), v.get(),
                                 dpos.as<int32_t>(), dslot.as<int32_t>(), rows, heads, kv_heads, hd,
                                 cap, dfreq.as<float>(), nullptr)
                  .ok());
  auto rot = [&](const float* x, int p, float* y) {
    for (int i = 0; i < hd / 2; ++i) {
      const double f = p * double(inv_freq[i]);
      const double c = std::cos(f), s = std::sin(f);
      y[i] = x[i] * c - x[i + hd / 2] * s;
      y[i + hd / 2] = x[i + hd / 2] * c + x[i] * s;
    }
  };
  std::vector<float> want_q(rows * q_dim), want_k(cache, 0.0f), want_v(cache, 0.0f);
  for (int r = 0; r < rows; ++r) {
    const float* in = &qkv[r * cols];
    for (int h = 0; h < heads; ++h) rot(in + h * hd, pos[r], &want_q[r * q_dim + h * hd]);
    for (int h = 0; h < kv_heads; ++h) {
      const size_t at = ((size_t(slot[r]) * kv_heads + h) * cap + pos[r]) * hd;
      rot(in + q_dim + h * hd, pos[r], &want_k[at]);
      for (int d = 0; d < hd; ++d) want_v[at + d] = in[q_dim + kv_dim + h * hd + d];
    }
  }
  ExpectClose(Download(t(), q, rows * q_dim), want_q, 4 * tol(), 4e-3f, "q");
  ExpectClose(Download(t(), k, cache), want_k, 4 * tol(), 4e-3f, "k cache");
  ExpectClose(Download(t(), v, cache), want_v, 0, 0, "v cache");
}

// A prefill's many rows take the row kernel (vector loads, cos and sin once per row), a few rows
// the element kernel: for every vector width (head_dim 6, 8, 100, 128: 1, 4, 2 and 8 elements),
// with and without the QKV bias and the rotation, the many-row launch must write the very bits of
// one-row launches, into the same cache entries and nowhere else, and match the CPU reference.
TEST_P(KernelTest, RopeOfManyRowsEqualsRowByRowForEveryVectorWidth) {
  SKIP_WITHOUT_GPU();
  const int rows = 300, heads = 4, kv_heads = 2, cap = 128, slots = 3;
  for (int hd : {6, 8, 100, 128}) {
    for (bool with_bias : {false, true}) {
      for (bool rotate : {false, true}) {
        SCOPED_TRACE(testing::Message()
                     << "head_dim " << hd << " bias " << with_bias << " rotate " << rotate);
        const int q_dim = heads * hd, kv_dim = kv_heads * hd, cols = q_dim + 2 * kv_dim;
        auto qkv = Quantize(t(), Random(size_t{rows} * cols, 21));
        auto bias = Quantize(t(), Random(cols, 22, 0.5f));
        std::vector<int32_t> pos(rows), slot(rows);
        for (int r = 0; r < rows; ++r) {
          slot[r] = r % slots;
          pos[r] = 7 + r / slots;
        }
        std::vector<float> inv_freq(hd / 2);
        for (int i = 0; i < hd / 2; ++i) {
          inv_freq[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / hd) / (i % 3 ? 1.0 : 8.0));
        }
        DeviceBuffer dqkv = Upload(t(), qkv), dbias = Upload(t(), bias);
        DeviceBuffer dpos = UploadRaw(pos), dslot = UploadRaw(slot), dfreq = UploadRaw(inv_freq);
        const size_t cache = size_t{slots} * kv_heads * cap * hd;
        DeviceBuffer q[2], k[2], v[2];
        for (int i = 0; i < 2; ++i) {
          ASSERT_TRUE(q[i].Allocate(size_t{rows} * q_dim * 2).ok());
          ASSERT_TRUE(k[i].Allocate(cache * 2).ok());
          ASSERT_TRUE(v[i].Allocate(cache * 2).ok());
          ASSERT_EQ(cudaMemset(k[i].get(), 0x11, cache * 2), cudaSuccess);
          ASSERT_EQ(cudaMemset(v[i].get(), 0x22, cache * 2), cudaSuccess);
        }
        const void* b = with_bias ? dbias.get() : nullptr;
        const float* f = rotate ? dfreq.as<float>() : nullptr;
        ASSERT_TRUE(LaunchQkvRopeCache(t(), dqkv.get(), b, q[0].get(), k[0].get(), v[0].get(),
                                       dpos.as<int32_t>(), dslot.as<int32_t>(), rows, heads,
                                       kv_heads, hd, cap, f, nullptr)
                        .ok());
        for (int r = 0; r < rows; ++r) {
          ASSERT_TRUE(LaunchQkvRopeCache(t(), dqkv.as<char>() + size_t(r) * cols * 2, b,
                                         q[1].as<char>() + size_t(r) * q_dim * 2, k[1].get(),
                                         v[1].get(), dpos.as<int32_t>() + r,
                                         dslot.as<int32_t>() + r, 1, heads, kv_heads, hd, cap, f,
                                         nullptr)
                          .ok());
        }
        auto bits = [&](const DeviceBuffer& d, size_t n) {
          std::vector<uint16_t> h(n);
          EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          EXPECT_EQ(cudaMemcpy(h.data(), d.get(), n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
          return h;
        };
        EXPECT_EQ(bits(q[0], size_t(rows) * q_dim), bits(q[1], size_t(rows) * q_dim)) << "q";
        EXPECT_EQ(bits(k[0], cache), bits(k[1], cache)) << "k cache";
        EXPECT_EQ(bits(v[0], cache), bits(v[1], cache)) << "v cache";
        // The reference, on a sample of rows: the biased input rounded, then rotated in double.
        // The kernel rounds cos, sin, both products and their sum to T (unit roundoff u), so a
        // rotated pair may be off by a few u times |x1| + |x2|, however much the sum cancels.
        const std::vector<float> got_q = Download(t(), q[0], size_t(rows) * q_dim);
        const std::vector<float> got_k = Download(t(), k[0], cache);
        const std::vector<float> got_v = Download(t(), v[0], cache);
        std::vector<float> want_q, want_k, want_v, have_q, have_k, have_v, bound_q, bound_k;
        const double u = t() == DType::kF16 ? 1.0 / 2048 : 1.0 / 256;
        for (int r = 0; r < rows; r += 37) {
          std::vector<float> x(qkv.begin() + size_t(r) * cols, qkv.begin() + size_t(r + 1) * cols);
          if (with_bias) {
            for (int c = 0; c < cols; ++c) x[c] += bias[c];
            x = Quantize(t(), x);
          }
          for (int h = 0; h < heads + kv_heads; ++h) {
            const float* in = &x[h * hd];
            for (int i = 0; i < hd / 2; ++i) {
              const double a = rotate ? pos[r] * double(inv_freq[i]) : 0.0;
              const double y1 = in[i] * std::cos(a) - in[i + hd / 2] * std::sin(a);
              const double y2 = in[i + hd / 2] * std::cos(a) + in[i] * std::sin(a);
              const size_t at =
                  h < heads ? size_t(r) * q_dim + h * hd
                            : ((size_t(slot[r]) * kv_heads + h - heads) * cap + pos[r]) * hd;
              auto& want = h < heads ? want_q : want_k;
              auto& have = h < heads ? have_q : have_k;
              auto& bound = h < heads ? bound_q : bound_k;
              const float b = 6 * u * (std::fabs(in[i]) + std::fabs(in[i + hd / 2])) + 1e-6;
              bound.insert(bound.end(), {b, b});
              const auto& got = h < heads ? got_q : got_k;
              want.insert(want.end(), {float(y1), float(y2)});
              have.insert(have.end(), {got[at + i], got[at + i + hd / 2]});
            }
          }
          for (int h = 0; h < kv_heads; ++h) {
            const size_t at = ((size_t(slot[r]) * kv_heads + h) * cap + pos[r]) * hd;
            for (int d = 0; d < hd; ++d) {
              want_v.push_back(x[q_dim + kv_dim + h * hd + d]);
              have_v.push_back(got_v[at + d]);
            }
          }
        }
        for (auto [have, want, bound, what] :
             {std::tuple{&have_q, &want_q, &bound_q, "q"}, {&have_k, &want_k, &bound_k, "k"}}) {
          int bad = 0;
          for (size_t i = 0; i < have->size(); ++i) {
            if (!(std::fabs((*have)[i] - (*want)[i]) <= (*bound)[i]) && ++bad <= 5) {
              ADD_FAILURE() << what << "[" << i << "]: got " << (*have)[i] << ", want "
                            << (*want)[i] << " within " << (*bound)[i];
            }
          }
          EXPECT_EQ(bad, 0) << what;
        }
        ExpectClose(have_v, want_v, 0, 0, "v cache");
      }
    }
  }
}

// Causal attention over a filled cache for rows of different lengths and slots, GQA heads. The
// kernel runs twice (the second launch sees the counters the first one reset): the same bits both
// times, the counters left zero, and the output against the reference below.
// `copies` > 1 repeats the five rows (more than 8 rows take the kernel's one-load-at-a-time path).
// `window` > 0: a sliding window (keys [pos - window + 1, pos]); `scale` 0: 1 / sqrt(head_dim).
void CheckAttention(DType t, float tol, int head_dim, int heads, int kv_heads, int splits,
                    int copies = 1, int window = 0, float scale = 0.0f) {
  const AttentionParams params{scale > 0 ? scale : 1.0f / std::sqrt(float(head_dim)), window};
  const int slots = 3, cap = 320;
  const size_t cache = size_t{slots} * kv_heads * cap * head_dim;
  auto kc = Quantize(t, Random(cache, 10));
  auto vc = Quantize(t, Random(cache, 11));
  std::vector<int32_t> pos, slot;
  for (int c = 0; c < copies; ++c) {
    pos.insert(pos.end(), {0, 63, 64, 299, 130});
    slot.insert(slot.end(), {0, 2, 1, 2, 0});
  }
  const int rows = static_cast<int>(pos.size()), q_dim = heads * head_dim;
  auto q = Quantize(t, Random(rows * q_dim, 12, 2.0f));
  DeviceBuffer dk = Upload(t, kc), dv = Upload(t, vc), dq = Upload(t, q);
  DeviceBuffer dpos = UploadRaw(pos), dslot = UploadRaw(slot), part, out, counters;
  ASSERT_TRUE(part.Allocate(AttentionPartialFloats(rows, heads, head_dim, splits) * 4).ok());
  ASSERT_TRUE(out.Allocate(rows * q_dim * 2).ok());
  ASSERT_TRUE(counters.Allocate(rows * kv_heads * 4).ok());
  ASSERT_EQ(cudaMemset(counters.get(), 0, rows * kv_heads * 4), cudaSuccess);
  std::vector<float> got;
  for (int run = 0; run < 2; ++run) {
    ASSERT_EQ(cudaMemset(out.get(), 0xff, rows * q_dim * 2), cudaSuccess);  // NaN
    ASSERT_TRUE(LaunchAttention(t, dq.get(), dk.get(), dv.get(), dpos.as<int32_t>(),
                                dslot.as<int32_t>(), part.as<float>(), out.get(), rows, heads,
                                kv_heads, head_dim, cap, splits, params, nullptr,
                                counters.as<uint32_t>())
                    .ok());
    const std::vector<float> again = Download(t, out, rows * q_dim);
    for (size_t i = 0; run == 1 && i < got.size(); ++i) {
      ASSERT_EQ(std::memcmp(&got[i], &again[i], sizeof(float)), 0)
          << "element " << i << ": " << again[i] << " on the second run, " << got[i] << " first";
    }
    got = again;
  }
  std::vector<uint32_t> left(rows * kv_heads, 1);
  ASSERT_EQ(cudaMemcpy(left.data(), counters.get(), left.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(left, std::vector<uint32_t>(rows * kv_heads, 0u)) << "counters left non-zero";
  std::vector<float> want(rows * q_dim);
  const int group = heads / kv_heads;
  for (int r = 0; r < rows; ++r) {
    for (int h = 0; h < heads; ++h) {
      const int kvh = h / group;
      const float* qh = &q[r * q_dim + h * head_dim];
      // Keys [lo, pos]: the query's own and the window - 1 before it.
      const int lo = window > 0 ? std::max(0, pos[r] - window + 1) : 0;
      std::vector<double> s(pos[r] + 1, 0.0);
      double mx = -1e30;
      for (int j = lo; j <= pos[r]; ++j) {
        const float* kr = &kc[((size_t(slot[r]) * kv_heads + kvh) * cap + j) * head_dim];
        double dot = 0;
        for (int d = 0; d < head_dim; ++d) dot += double(qh[d]) * kr[d];
        s[j] = dot * params.scale;
        mx = std::max(mx, s[j]);
      }
      double sum = 0;
      for (int j = lo; j <= pos[r]; ++j) sum += (s[j] = std::exp(s[j] - mx));
      for (int d = 0; d < head_dim; ++d) {
        double o = 0;
        for (int j = lo; j <= pos[r]; ++j) {
          o += s[j] * vc[((size_t(slot[r]) * kv_heads + kvh) * cap + j) * head_dim + d];
        }
        want[r * q_dim + h * head_dim + d] = o / sum;
      }
    }
  }
  ExpectClose(Download(t, out, rows * q_dim), want, 2 * tol, 3e-3f, "attention");
}

TEST_P(KernelTest, AttentionGroupedQueryHeadsOneSplit) {
  SKIP_WITHOUT_GPU();
  CheckAttention(t(), tol(), 64, 8, 2, 1);
}

TEST_P(KernelTest, AttentionGroupedQueryHeadsManySplits) {
  SKIP_WITHOUT_GPU();
  CheckAttention(t(), tol(), 64, 8, 2, 5);
}

// The register kernel's shapes (head_dim 64, 100 and 128; 1 to 8 query heads per kv head, 3 and
// 7 in the kernels built for 4 and 8) and one it does not take (16 per kv head: the
// shared-memory kernel), in one split and in several.
TEST_P(KernelTest, AttentionOfEveryGroupWidthMatchesTheReference) {
  SKIP_WITHOUT_GPU();
  for (int splits : {1, 4}) {
    SCOPED_TRACE(testing::Message() << splits << " splits");
    CheckAttention(t(), tol(), 128, 8, 8, splits);   // 1 per kv head
    CheckAttention(t(), tol(), 128, 4, 2, splits);   // 2
    CheckAttention(t(), tol(), 128, 32, 8, splits);  // 4: the Llama-3.1-8B shape
    CheckAttention(t(), tol(), 128, 16, 2, splits);  // 8: the 70B shape
    CheckAttention(t(), tol(), 64, 8, 1, splits);    // 8 of head_dim 64
    CheckAttention(t(), tol(), 64, 2, 2, splits);    // GPT-2's 1
    CheckAttention(t(), tol(), 128, 6, 2, splits);   // 3
    CheckAttention(t(), tol(), 128, 14, 2, splits);  // 7: the Qwen2.5-7B shape
    CheckAttention(t(), tol(), 100, 8, 2, splits);   // 4 of head_dim 100
    CheckAttention(t(), tol(), 64, 16, 1, splits);   // 16
  }
}

TEST_P(KernelTest, AttentionHeadDimNotMultipleOfEight) {
  SKIP_WITHOUT_GPU();
  CheckAttention(t(), tol(), 100, 4, 4, 3);  // the OpenLLaMA-3B head size
}

TEST_P(KernelTest, AttentionOfManyRowsMatchesTheReference) {
  SKIP_WITHOUT_GPU();
  CheckAttention(t(), tol(), 100, 4, 4, 3, 3);
  CheckAttention(t(), tol(), 64, 8, 2, 5, 2);
}

// Mistral's sliding window: rows at positions 0, 63, 64, 299 and 130 against windows that cut
// inside the first tile, on a tile boundary and beyond every row's context; in one split and in
// several, with the splits combined either way. A window off by one key fails the comparison.
TEST_P(KernelTest, AttentionSlidingWindowSeesOnlyTheLastWindowKeys) {
  SKIP_WITHOUT_GPU();
  for (int window : {1, 2, 17, 64, 65, 200, 1000}) {
    SCOPED_TRACE(testing::Message() << "window " << window);
    CheckAttention(t(), tol(), 64, 8, 2, 1, 1, window);
    CheckAttention(t(), tol(), 64, 8, 2, 5, 1, window);
    CheckAttention(t(), tol(), 100, 4, 4, 3, 3, window);
  }
}

// GPT-2's scale_attn_weights false / scale_attn_by_inverse_layer_idx: the scale is the caller's.
TEST_P(KernelTest, AttentionScalesScoresByTheGivenFactor) {
  SKIP_WITHOUT_GPU();
  CheckAttention(t(), tol(), 64, 8, 2, 5, 1, 0, 1.0f / 3.0f);
  CheckAttention(t(), tol(), 64, 8, 2, 1, 1, 30, 0.05f);
}

TEST_P(KernelTest, AttentionRejectsGroupWiderThanKernel) {
  SKIP_WITHOUT_GPU();
  EXPECT_FALSE(LaunchAttention(t(), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                               1, 32, 1, 128, 64, 1, AttentionParams{0.1f, 0}, nullptr, nullptr)
                   .ok());
}

TEST_P(KernelTest, AttentionRejectsNegativeWindowAndNonPositiveScale) {
  SKIP_WITHOUT_GPU();
  EXPECT_FALSE(LaunchAttention(t(), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                               1, 8, 2, 64, 64, 1, AttentionParams{0.1f, -1}, nullptr, nullptr)
                   .ok());
  EXPECT_FALSE(LaunchAttention(t(), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                               1, 8, 2, 64, 64, 1, AttentionParams{0.0f, 0}, nullptr, nullptr)
                   .ok());
}

TEST_P(KernelTest, AttentionRejectsMissingSplitCounters) {
  const absl::Status st =
      LaunchAttention(t(), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 1, 8, 2,
                      64, 64, 1, AttentionParams{0.1f, 0}, nullptr, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), testing::HasSubstr("counters"));
}

TEST_P(KernelTest, GeluTanhWithBias) {
  SKIP_WITHOUT_GPU();
  const int rows = 3, cols = 40;
  auto h = Quantize(t(), Random(rows * cols, 13, 4.0f));
  auto b = Quantize(t(), Random(cols, 14));
  DeviceBuffer dh = Upload(t(), h), db = Upload(t(), b);
  ASSERT_TRUE(LaunchGeluBias(t(), dh.get(), db.get(), rows, cols, nullptr).ok());
  std::vector<float> want(rows * cols);
  for (int i = 0; i < rows * cols; ++i) {
    const double x = h[i] + b[i % cols];
    want[i] = 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
  }
  ExpectClose(Download(t(), dh, rows * cols), want, 3 * tol(), 3e-3f, "gelu");
}

// Widths that are a multiple of 8 take the 16-byte kernel (one row per block row, 1,104 columns:
// more than one block of columns), others the element kernel.
TEST_P(KernelTest, SwiGluGateTimesUp) {
  SKIP_WITHOUT_GPU();
  for (auto [rows, cols] : {std::pair{2, 24}, std::pair{3, 20}, std::pair{70, 1104}}) {
    SCOPED_TRACE(testing::Message() << rows << " x " << cols);
    auto gu = Quantize(t(), Random(size_t(rows) * 2 * cols, 15, 4.0f));
    DeviceBuffer dgu = Upload(t(), gu), out;
    ASSERT_TRUE(out.Allocate(size_t(rows) * cols * 2).ok());
    ASSERT_TRUE(LaunchSwiGlu(t(), dgu.get(), out.get(), rows, cols, nullptr).ok());
    std::vector<float> want(size_t(rows) * cols);
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < cols; ++c) {
        const double g = gu[size_t(r) * 2 * cols + c], u = gu[size_t(r) * 2 * cols + cols + c];
        want[size_t(r) * cols + c] = g / (1 + std::exp(-g)) * u;
      }
    }
    ExpectClose(Download(t(), out, size_t(rows) * cols), want, 3 * tol(), 3e-3f, "swiglu");
  }
}

TEST_P(KernelTest, GemmAccumulatesIntoOutputAndWritesFp32) {
  SKIP_WITHOUT_GPU();
  const int rows = 5, out = 24, in = 40;
  auto x = Quantize(t(), Random(rows * in, 16));
  auto w = Quantize(t(), Random(out * in, 17));
  auto y0 = Quantize(t(), Random(rows * out, 18));
  DeviceBuffer dx = Upload(t(), x), dw = Upload(t(), w), dy = Upload(t(), y0), dyf;
  ASSERT_TRUE(dyf.Allocate(rows * out * 4).ok());
  CublasHandle h;
  ASSERT_TRUE(h.Create().ok());
  ASSERT_TRUE(Gemm(h.get(), t(), dx.get(), dw.get(), dy.get(), rows, out, in, 1.0f, false).ok());
  ASSERT_TRUE(Gemm(h.get(), t(), dx.get(), dw.get(), dyf.get(), rows, out, in, 0.0f, true).ok());
  std::vector<float> want(rows * out), want_f(rows * out);
  for (int r = 0; r < rows; ++r) {
    for (int o = 0; o < out; ++o) {
      double s = 0;
      for (int i = 0; i < in; ++i) s += double(x[r * in + i]) * w[o * in + i];
      want_f[r * out + o] = s;
      want[r * out + o] = s + y0[r * out + o];
    }
  }
  ExpectClose(Download(t(), dy, rows * out), want, 2 * tol(), 1e-2f, "gemm beta=1");
  std::vector<float> got_f(rows * out);
  cudaMemcpy(got_f.data(), dyf.get(), got_f.size() * 4, cudaMemcpyDeviceToHost);
  ExpectClose(got_f, want_f, 1e-4f, 1e-4f, "gemm fp32 out");
}

float RoundHost(DType t, float f) { return Quantize(t, {f})[0]; }

double GeluHost(double x) {
  return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}

// Every epilogue of the GEMV kernels at every supported row count and launch shape, against a
// CPU reference with the same rounding points. Sizes leave a partial 256-element step of K, a
// warp with no step at all when 4 warps divide K, and an odd output width (a last warp with one
// valid row of two, a last block with spare warps).
TEST_P(KernelTest, GemvMatchesReferenceForEveryEpilogueAndRowCount) {
  SKIP_WITHOUT_GPU();
  const int n = 37, k = 520;
  const GemvTuning tunings[] = {{}, {1, 1}, {2, 1}, {1, 2}, {2, 2}, {1, 4}, {2, 4}};
  for (int m : {1, 2, 4, 8}) {
    for (GemvEpilogue e : {GemvEpilogue::kStore, GemvEpilogue::kResidual, GemvEpilogue::kGelu,
                           GemvEpilogue::kSwiGlu, GemvEpilogue::kF32}) {
      for (const GemvTuning& tuning : tunings) {
        SCOPED_TRACE(testing::Message()
                     << "rows " << m << ", epilogue " << static_cast<int>(e) << ", rows/warp "
                     << tuning.rows_per_warp << ", K split " << tuning.k_split);
        const bool swiglu = e == GemvEpilogue::kSwiGlu;
        const int wrows = swiglu ? 2 * n : n;
        const uint64_t seed = 100 + 10 * m + static_cast<int>(e);
        auto x = Quantize(t(), Random(m * k, seed));
        auto w = Quantize(t(), Random(wrows * k, seed + 1000, 0.2f));
        auto b = Quantize(t(), Random(n, seed + 2000));
        auto y0 = Quantize(t(), Random(m * n, seed + 3000));
        const bool f32 = e == GemvEpilogue::kF32;
        DeviceBuffer dx = Upload(t(), x), dw = Upload(t(), w), db = Upload(t(), b), dy;
        if (f32) {
          // Poisoned with NaN: every output must be written.
          std::vector<float> nan(m * n, std::nanf(""));
          dy = UploadRaw(nan);
        } else if (e == GemvEpilogue::kResidual) {
          dy = Upload(t(), y0);
        } else {
          dy = Upload(t(), std::vector<float>(m * n, std::nanf("")));
        }
        ASSERT_TRUE(Gemv(t(), e, dx.get(), dw.get(), swiglu ? nullptr : db.get(), dy.get(), m, n, k,
                         nullptr, tuning)
                        .ok());
        std::vector<float> want(m * n);
        for (int r = 0; r < m; ++r) {
          for (int o = 0; o < n; ++o) {
            auto dot = [&](int row) {
              double s = 0;
              for (int i = 0; i < k; ++i) s += double(x[r * k + i]) * w[size_t(row) * k + i];
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
              case GemvEpilogue::kGelu:
                out = GeluHost(RoundHost(t(), v));
                break;
              case GemvEpilogue::kSwiGlu: {
                const double g = RoundHost(t(), dot(o)), u = RoundHost(t(), dot(n + o));
                out = RoundHost(t(), g / (1.0 + std::exp(-g))) * u;
                break;
              }
              case GemvEpilogue::kQkvCache:  // GemvQkvCache's own tests
                break;
            }
          }
        }
        if (f32) {
          std::vector<float> got(m * n);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          ASSERT_EQ(cudaMemcpy(got.data(), dy.get(), got.size() * 4, cudaMemcpyDeviceToHost),
                    cudaSuccess);
          ExpectClose(got, want, 1e-4f, 1e-4f, "gemv fp32");
        } else {
          ExpectClose(Download(t(), dy, m * n), want, 2 * tol(), 1e-2f, "gemv");
        }
      }
    }
  }
}

// The QKV GEMV that writes q and the cache itself gives the very bits of the GEMV followed by the
// split/rotate kernel: grouped-query heads, rows at different slots and positions, with and
// without bias and rotation, at every row count and K split. The rest of the cache is untouched.
TEST_P(KernelTest, GemvQkvCacheEqualsGemvThenRopeCache) {
  SKIP_WITHOUT_GPU();
  const int heads = 4, kv_heads = 2, hd = 32, cap = 64, slots = 3, k = 1040;
  const int q_dim = heads * hd, kv_dim = kv_heads * hd, cols = q_dim + 2 * kv_dim;
  const size_t cache = size_t{slots} * kv_heads * cap * hd;
  auto w = Quantize(t(), Random(size_t(cols) * k, 70, 0.1f));
  auto b = Quantize(t(), Random(cols, 71));
  DeviceBuffer dw = Upload(t(), w), db = Upload(t(), b);
  std::vector<float> inv_freq(hd / 2);
  for (int i = 0; i < hd / 2; ++i) inv_freq[i] = static_cast<float>(std::pow(5e5, -2.0 * i / hd));
  DeviceBuffer dfreq = UploadRaw(inv_freq);
  const std::vector<int32_t> all_pos = {5, 63, 0, 17, 40, 1, 33, 62};
  const std::vector<int32_t> all_slot = {1, 0, 2, 2, 1, 0, 0, 2};
  for (int m : {1, 2, 4, 8}) {
    const std::vector<int32_t> pos(all_pos.begin(), all_pos.begin() + m);
    const std::vector<int32_t> slot(all_slot.begin(), all_slot.begin() + m);
    DeviceBuffer dpos = UploadRaw(pos), dslot = UploadRaw(slot);
    DeviceBuffer dx = Upload(t(), Quantize(t(), Random(size_t(m) * k, 72 + m)));
    for (bool rope : {true, false}) {
      for (bool bias : {true, false}) {
        for (int split : {1, 2, 4}) {
          SCOPED_TRACE(testing::Message() << "rows " << m << ", rope " << rope << ", bias " << bias
                                          << ", K split " << split);
          const auto background = Quantize(t(), Random(cache, 73));
          DeviceBuffer qkv, q[2], kc[2] = {Upload(t(), background), Upload(t(), background)},
                                  vc[2] = {Upload(t(), background), Upload(t(), background)};
          ASSERT_TRUE(qkv.Allocate(size_t(m) * cols * 2).ok());
          for (DeviceBuffer& buf : q) ASSERT_TRUE(buf.Allocate(size_t(m) * q_dim * 2).ok());
          const GemvTuning tuning{0, split};
          ASSERT_TRUE(Gemv(t(), GemvEpilogue::kStore, dx.get(), dw.get(), bias ? db.get() : nullptr,
                           qkv.get(), m, cols, k, nullptr, tuning)
                          .ok());
          ASSERT_TRUE(LaunchQkvRopeCache(t(), qkv.get(), nullptr, q[0].get(), kc[0].get(),
                                         vc[0].get(), dpos.as<int32_t>(), dslot.as<int32_t>(), m,
                                         heads, kv_heads, hd, cap,
                                         rope ? dfreq.as<float>() : nullptr, nullptr)
                          .ok());
          QkvCacheArgs a;
          a.q_out = q[1].get();
          a.k_cache = kc[1].get();
          a.v_cache = vc[1].get();
          a.positions = dpos.as<int32_t>();
          a.slots = dslot.as<int32_t>();
          a.num_heads = heads;
          a.num_kv_heads = kv_heads;
          a.head_dim = hd;
          a.seq_capacity = cap;
          a.inv_freq = rope ? dfreq.as<float>() : nullptr;
          ASSERT_TRUE(GemvQkvCache(t(), dx.get(), dw.get(), bias ? db.get() : nullptr, a, m, k,
                                   nullptr, tuning)
                          .ok());
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          auto bytes = [](const DeviceBuffer& d, size_t n) {
            std::vector<uint16_t> h(n);
            EXPECT_EQ(cudaMemcpy(h.data(), d.get(), n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
            return h;
          };
          EXPECT_EQ(bytes(q[1], size_t(m) * q_dim), bytes(q[0], size_t(m) * q_dim)) << "q";
          EXPECT_EQ(bytes(kc[1], cache), bytes(kc[0], cache)) << "k cache";
          EXPECT_EQ(bytes(vc[1], cache), bytes(vc[0], cache)) << "v cache";
        }
      }
    }
  }
}

// The GEMV kernel and cuBLAS compute the same projection on a decode-sized shape of real width
// (several full 1024-element unrolled steps of K plus a tail).
TEST_P(KernelTest, GemvAgreesWithCublas) {
  SKIP_WITHOUT_GPU();
  const int n = 300, k = 3200;
  CublasHandle h;
  ASSERT_TRUE(h.Create().ok());
  for (int m : {1, 8}) {
    auto x = Quantize(t(), Random(m * k, 50 + m));
    auto w = Quantize(t(), Random(n * k, 60 + m, 0.05f));
    DeviceBuffer dx = Upload(t(), x), dw = Upload(t(), w), a, c;
    ASSERT_TRUE(a.Allocate(m * n * 4).ok());
    ASSERT_TRUE(c.Allocate(m * n * 4).ok());
    ASSERT_TRUE(
        Gemv(t(), GemvEpilogue::kF32, dx.get(), dw.get(), nullptr, a.get(), m, n, k, nullptr).ok());
    ASSERT_TRUE(Gemm(h.get(), t(), dx.get(), dw.get(), c.get(), m, n, k, 0.0f, true).ok());
    std::vector<float> ga(m * n), gc(m * n);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    cudaMemcpy(ga.data(), a.get(), ga.size() * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(gc.data(), c.get(), gc.size() * 4, cudaMemcpyDeviceToHost);
    ExpectClose(ga, gc, 1e-4f, 1e-4f, "gemv vs cublas");
  }
}

// A chain of dependent launches on a stream of our own, each reading the previous one's output
// and overwriting the buffer the one before read (ping-pong): with the norms launched
// programmatically (the GEMVs always are), the same bits as with them launched plainly.
TEST_P(KernelTest, ProgrammaticLaunchChainEqualsPlainLaunches) {
  SKIP_WITHOUT_GPU();
  const int k = 1024, steps = 24;
  auto x0 = Quantize(t(), Random(k, 31, 2.0f));
  auto nw = Quantize(t(), Random(k, 32, 1.0f));
  auto nb = Quantize(t(), Random(k, 33, 0.3f));
  auto w = Quantize(t(), Random(size_t(k) * k, 34, 0.05f));
  DeviceBuffer dnw = Upload(t(), nw), dnb = Upload(t(), nb), dw = Upload(t(), w);
  Stream stream;
  ASSERT_TRUE(stream.Create().ok());
  std::vector<float> results[2];
  for (int pdl = 0; pdl < 2; ++pdl) {
    DeviceBuffer a = Upload(t(), x0), b = Upload(t(), std::vector<float>(k, 0.0f)), xn;
    ASSERT_TRUE(xn.Allocate(k * 2).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int i = 0; i < steps; ++i) {
      DeviceBuffer& src = i % 2 ? b : a;
      DeviceBuffer& dst = i % 2 ? a : b;
      ASSERT_TRUE(LaunchNorm(t(), i % 3 == 0, src.get(), nullptr, dnw.get(), dnb.get(), nullptr,
                             xn.get(), 1, k, 1e-5f, stream.get(), pdl == 1 && i > 0)
                      .ok());
      ASSERT_TRUE(Gemv(t(), GemvEpilogue::kStore, xn.get(), dw.get(), nullptr, dst.get(), 1, k, k,
                       stream.get())
                      .ok());
    }
    ASSERT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);
    results[pdl] = Download(t(), steps % 2 ? b : a, k);
  }
  ASSERT_EQ(results[0].size(), results[1].size());
  EXPECT_EQ(std::memcmp(results[0].data(), results[1].data(), k * sizeof(float)), 0);
  for (float v : results[1]) ASSERT_TRUE(std::isfinite(v));
}

INSTANTIATE_TEST_SUITE_P(Types, KernelTest, ::testing::Values(DType::kF16, DType::kBF16),
                         [](const auto& info) {
                           return info.param == DType::kF16 ? std::string("F16")
                                                            : std::string("BF16");
                         });

// Shapes the GEMV kernels do not take are refused before anything is launched.
// One slot's positions between the cache (slots, kv_heads, seq_capacity, head_dim) and a KV
// block's (positions, kv_heads * head_dim), against the index arithmetic on the host: the gather
// reads that slot's rows only, the scatter writes them only (the other slots and the positions
// past the block keep their bits). A head_dim that is no multiple of 8, and a block larger than
// one pass of the grid.
TEST(KvBlockCopyTest, GathersAndScattersOneSlotBitForBit) {
  SKIP_WITHOUT_GPU();
  struct Shape {
    int slots, heads, head_dim, capacity, positions, slot;
  };
  for (const Shape& sh : {Shape{3, 3, 6, 64, 37, 1}, Shape{2, 8, 128, 2112, 2100, 1}}) {
    SCOPED_TRACE(testing::Message() << sh.heads << " heads of " << sh.head_dim << ", "
                                    << sh.positions << " positions");
    const size_t cache_n = size_t(sh.slots) * sh.heads * sh.capacity * sh.head_dim;
    const size_t block_n = size_t(sh.positions) * sh.heads * sh.head_dim;
    auto bits = [](size_t n, uint64_t seed) {
      std::vector<uint16_t> v(n);
      for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint16_t>(RandomBits(seed, i));
      return v;
    };
    auto at = [&](int slot, int p, int h, int d) {
      return ((size_t(slot) * sh.heads + h) * sh.capacity + p) * sh.head_dim + d;
    };
    const std::vector<uint16_t> k = bits(cache_n, 1), v = bits(cache_n, 2);
    const std::vector<uint16_t> k_in = bits(block_n, 3), v_in = bits(block_n, 4);
    std::vector<uint16_t> k_want(block_n), v_want(block_n), k_after = k, v_after = v;
    for (int p = 0; p < sh.positions; ++p) {
      for (int h = 0; h < sh.heads; ++h) {
        for (int d = 0; d < sh.head_dim; ++d) {
          const size_t b = (size_t(p) * sh.heads + h) * sh.head_dim + d;
          k_want[b] = k[at(sh.slot, p, h, d)];
          v_want[b] = v[at(sh.slot, p, h, d)];
          k_after[at(sh.slot, p, h, d)] = k_in[b];
          v_after[at(sh.slot, p, h, d)] = v_in[b];
        }
      }
    }
    DeviceBuffer dk = UploadRaw(k), dv = UploadRaw(v), bk, bv;
    ASSERT_TRUE(bk.Allocate(block_n * 2).ok());
    ASSERT_TRUE(bv.Allocate(block_n * 2).ok());
    ASSERT_TRUE(LaunchKvBlockCopy(dk.get(), dv.get(), sh.slot, bk.get(), bv.get(), sh.positions,
                                  sh.heads, sh.head_dim, sh.capacity, /*to_block=*/true, nullptr)
                    .ok());
    std::vector<uint16_t> k_got(block_n), v_got(block_n);
    ASSERT_EQ(cudaMemcpy(k_got.data(), bk.get(), block_n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(v_got.data(), bv.get(), block_n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_TRUE(k_got == k_want);
    EXPECT_TRUE(v_got == v_want);

    DeviceBuffer ik = UploadRaw(k_in), iv = UploadRaw(v_in);
    ASSERT_TRUE(LaunchKvBlockCopy(dk.get(), dv.get(), sh.slot, ik.get(), iv.get(), sh.positions,
                                  sh.heads, sh.head_dim, sh.capacity, /*to_block=*/false, nullptr)
                    .ok());
    std::vector<uint16_t> k_cache(cache_n), v_cache(cache_n);
    ASSERT_EQ(cudaMemcpy(k_cache.data(), dk.get(), cache_n * 2, cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(v_cache.data(), dv.get(), cache_n * 2, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_TRUE(k_cache == k_after);
    EXPECT_TRUE(v_cache == v_after);
  }
}

TEST(GemvTest, RejectsUnsupportedRowCountsAndWidths) {
  alignas(16) static uint16_t buf[64];
  for (int rows : {0, 3, 5, 16}) {
    EXPECT_EQ(
        Gemv(DType::kF16, GemvEpilogue::kStore, buf, buf, nullptr, buf, rows, 4, 8, nullptr).code(),
        absl::StatusCode::kInvalidArgument)
        << rows;
  }
  EXPECT_FALSE(GemvSupported(1, 12));
  EXPECT_EQ(
      Gemv(DType::kF16, GemvEpilogue::kStore, buf, buf, nullptr, buf, 1, 4, 12, nullptr).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      Gemv(DType::kF16, GemvEpilogue::kStore, buf, buf, nullptr, buf, 1, 0, 8, nullptr).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Gemv(DType::kF16, GemvEpilogue::kStore, reinterpret_cast<char*>(buf) + 2, buf, nullptr,
                 buf, 1, 4, 8, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      Gemv(DType::kF32, GemvEpilogue::kStore, buf, buf, nullptr, buf, 1, 4, 8, nullptr).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(GemvSupported(8, 3200));
  // Launch shapes the kernels do not have.
  for (GemvTuning bad : {GemvTuning{3, 0}, GemvTuning{-1, 0}, GemvTuning{0, 3}, GemvTuning{0, 8},
                         GemvTuning{1, -2}}) {
    const absl::Status s =
        Gemv(DType::kF16, GemvEpilogue::kStore, buf, buf, nullptr, buf, 1, 4, 8, nullptr, bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("GEMV")) << s;
  }
  EXPECT_EQ(
      Gemv(DType::kF16, GemvEpilogue::kQkvCache, buf, buf, nullptr, buf, 1, 4, 8, nullptr).code(),
      absl::StatusCode::kInvalidArgument);
}

// The QKV-into-cache GEMV refuses head shapes and missing outputs by name.
TEST(GemvTest, QkvCacheRejectsBadHeadsAndMissingOutputs) {
  using ::testing::HasSubstr;
  alignas(16) static uint16_t buf[4096];
  alignas(16) static int32_t ints[16];
  auto good = [&] {
    QkvCacheArgs a;
    a.q_out = a.k_cache = a.v_cache = buf;
    a.positions = a.slots = ints;
    a.num_heads = 2;
    a.num_kv_heads = 1;
    a.head_dim = 8;
    a.seq_capacity = 4;
    return a;
  };
  auto call = [&](const QkvCacheArgs& a, int rows = 1, int in = 8) {
    const absl::Status s = GemvQkvCache(DType::kF16, buf, buf, nullptr, a, rows, in, nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    return std::string(s.message());
  };
  QkvCacheArgs a = good();
  a.head_dim = 7;
  EXPECT_THAT(call(a), HasSubstr("head_dim 7"));
  a = good();
  a.num_kv_heads = 0;
  EXPECT_THAT(call(a), HasSubstr("kv heads 0"));
  a = good();
  a.seq_capacity = 0;
  EXPECT_THAT(call(a), HasSubstr("capacity 0"));
  a = good();
  a.v_cache = nullptr;
  EXPECT_THAT(call(a), HasSubstr("both caches"));
  a = good();
  a.slots = nullptr;
  EXPECT_THAT(call(a), HasSubstr("slots"));
  EXPECT_THAT(call(good(), 3), HasSubstr("got rows 3"));
  EXPECT_THAT(call(good(), 1, 12), HasSubstr("in 12"));
}

// The per-shape launch choice, as measured on an H100 (132 multiprocessors): K divided between 4
// warps for narrow outputs with a long K and for outputs wider than the resident warps, never for
// outputs that fill about one wave; two rows per warp from 4 input rows on.
TEST(GemvTest, TuningSplitsKWhereTheSweepMeasuredItFaster) {
  const int sms = 132;
  EXPECT_EQ(GemvTuningFor(1, 768, 3072, sms).k_split, 4);    // gpt2 MLP down
  EXPECT_EQ(GemvTuningFor(1, 768, 768, sms).k_split, 1);     // gpt2 out-proj: 3 steps of K
  EXPECT_EQ(GemvTuningFor(1, 3072, 768, sms).k_split, 1);    // gpt2 MLP up
  EXPECT_EQ(GemvTuningFor(1, 3200, 3200, sms).k_split, 1);   // openllama-3b out-proj
  EXPECT_EQ(GemvTuningFor(1, 3200, 8640, sms).k_split, 1);   // openllama-3b down
  EXPECT_EQ(GemvTuningFor(1, 9600, 3200, sms).k_split, 4);   // openllama-3b QKV
  EXPECT_EQ(GemvTuningFor(2, 32000, 3200, sms).k_split, 4);  // LM head
  EXPECT_EQ(GemvTuningFor(4, 9600, 3200, sms).k_split, 2);
  EXPECT_EQ(GemvTuningFor(1, 3200, 3200, sms).rows_per_warp, 1);
  EXPECT_EQ(GemvTuningFor(4, 3200, 3200, sms).rows_per_warp, 2);
  for (int rows : {1, 2, 4, 8}) {
    for (int out : {8, 768, 3200, 9600, 50257}) {
      for (int in : {8, 768, 3200, 8640}) {
        const GemvTuning t = GemvTuningFor(rows, out, in, sms);
        EXPECT_TRUE(t.k_split == 1 || t.k_split == 2 || t.k_split == 4);
        EXPECT_TRUE(t.rows_per_warp == 1 || t.rows_per_warp == 2);
        if (t.k_split > 1) {
          EXPECT_GE((in + 255) / 256, 2 * t.k_split);  // two steps per warp
        }
      }
    }
  }
}

// FP8 weights (16 codes a lane where K % 16 == 0), as measured on an H200 (132 multiprocessors):
// wide outputs are not split and take two rows a warp; narrow ones split as fp16's do, counting K
// in steps of 512 codes; a K that is not a multiple of 16 (8 codes a lane) follows fp16's rule.
TEST(GemvTest, Fp8TuningDoesNotSplitWideOutputs) {
  const int sms = 132;
  const GemvTuning qkv = GemvTuningFor(1, 6144, 4096, sms, true);  // llama3.1-8b QKV
  EXPECT_EQ(qkv.k_split, 1);
  EXPECT_EQ(qkv.rows_per_warp, 2);
  const GemvTuning gate_up = GemvTuningFor(1, 28672, 4096, sms, true);  // llama3.1-8b gate/up
  EXPECT_EQ(gate_up.k_split, 1);
  EXPECT_EQ(gate_up.rows_per_warp, 2);
  const GemvTuning lm_head = GemvTuningFor(2, 128256, 4096, sms, true);
  EXPECT_EQ(lm_head.k_split, 1);
  EXPECT_EQ(lm_head.rows_per_warp, 2);
  // gpt2's MLP down: 768 rows fill a quarter of the warps; 6 steps of 512 codes allow a split of 2.
  const GemvTuning down = GemvTuningFor(1, 768, 3072, sms, true);
  EXPECT_EQ(down.k_split, 2);
  EXPECT_EQ(down.rows_per_warp, 1);
  // The same shapes in fp16 split (the rule FP8 departs from).
  EXPECT_EQ(GemvTuningFor(1, 6144, 4096, sms).k_split, 4);
  EXPECT_EQ(GemvTuningFor(1, 6144, 4096, sms).rows_per_warp, 1);
  EXPECT_EQ(GemvTuningFor(1, 768, 3072, sms).k_split, 4);
  // 8 codes a lane (K % 16 != 0): fp16's choice.
  for (int out : {768, 6144, 28672}) {
    const GemvTuning a = GemvTuningFor(1, out, 4104, sms, true);
    const GemvTuning b = GemvTuningFor(1, out, 4104, sms, false);
    EXPECT_EQ(a.k_split, b.k_split) << out;
    EXPECT_EQ(a.rows_per_warp, b.rows_per_warp) << out;
  }
}

// Runs the device sampler on `logits` (rows, vocab) with one parameter set per row.
std::vector<int32_t> DeviceSample(const std::vector<float>& logits, int vocab,
                                  const std::vector<SamplingParams>& params,
                                  const std::vector<uint64_t>& index) {
  const int rows = static_cast<int>(params.size());
  std::vector<float> temp, top_p;
  std::vector<int32_t> top_k;
  std::vector<uint64_t> seed;
  for (const auto& p : params) {
    temp.push_back(p.temperature);
    top_p.push_back(p.top_p);
    top_k.push_back(p.top_k);
    seed.push_back(p.seed);
  }
  DeviceBuffer dl = UploadRaw(logits), dt = UploadRaw(temp), dp = UploadRaw(top_p),
               dk = UploadRaw(top_k), ds = UploadRaw(seed), di = UploadRaw(index), probs, out;
  EXPECT_TRUE(probs.Allocate(logits.size() * 4).ok());
  EXPECT_TRUE(out.Allocate(rows * 4).ok());
  SamplingArrays a{dt.as<float>(), dk.as<int32_t>(), dp.as<float>(), ds.as<uint64_t>(),
                   di.as<uint64_t>()};
  EXPECT_TRUE(
      LaunchSample(dl.as<float>(), probs.as<float>(), a, out.as<int32_t>(), rows, vocab, nullptr)
          .ok());
  std::vector<int32_t> tokens(rows);
  EXPECT_EQ(cudaMemcpy(tokens.data(), out.get(), rows * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  return tokens;
}

const std::vector<SamplingParams>& ParameterKinds() {
  static const std::vector<SamplingParams> kinds = {
      {0.0f, 0, 1.0f, 1},  {1.0f, 0, 1.0f, 2}, {0.7f, 40, 1.0f, 3}, {1.3f, 0, 0.9f, 4},
      {0.8f, 50, 0.8f, 5}, {2.0f, 1, 1.0f, 6}, {0.5f, 0, 0.05f, 7}, {1.0f, 200, 0.999f, 8},
  };
  return kinds;
}

// A small vocabulary: the host rule's fp32 running sums are far finer than any candidate's
// probability, so both sides must pick the very same token.
TEST(SamplingKernelTest, MatchesHostRuleForEveryParameterKind) {
  SKIP_WITHOUT_GPU();
  const int vocab = 256;
  const auto& kinds = ParameterKinds();
  for (int round = 0; round < 8; ++round) {
    std::vector<float> logits(kinds.size() * vocab);
    for (size_t r = 0; r < kinds.size(); ++r) {
      auto row = Random(vocab, 100 + round * 16 + r, 8.0f);
      std::copy(row.begin(), row.end(), logits.begin() + r * vocab);
    }
    std::vector<uint64_t> index(kinds.size(), round * 7 + 1);
    auto got = DeviceSample(logits, vocab, kinds, index);
    for (size_t r = 0; r < kinds.size(); ++r) {
      std::span<const float> row(logits.data() + r * vocab, vocab);
      EXPECT_EQ(got[r], SampleToken(row, kinds[r], index[r])) << "row " << r << " round " << round;
    }
  }
}

// A flat 32k distribution: the rule evaluated in double precision picks a candidate; the device
// (exact fixed-point sums) must pick it or, where the target falls within rounding of a boundary,
// its neighbour in sorted order.
TEST(SamplingKernelTest, LargeFlatVocabularyFollowsTheRuleInExactArithmetic) {
  SKIP_WITHOUT_GPU();
  const int vocab = 32000;
  const auto& kinds = ParameterKinds();
  for (int round = 0; round < 4; ++round) {
    std::vector<float> logits(kinds.size() * vocab);
    for (size_t r = 0; r < kinds.size(); ++r) {
      auto row = Random(vocab, 500 + round * 16 + r, 6.0f);
      std::copy(row.begin(), row.end(), logits.begin() + r * vocab);
    }
    std::vector<uint64_t> index(kinds.size(), round + 3);
    auto got = DeviceSample(logits, vocab, kinds, index);
    for (size_t r = 0; r < kinds.size(); ++r) {
      const SamplingParams& sp = kinds[r];
      const float* x = logits.data() + r * vocab;
      if (sp.temperature == 0.0f) {
        EXPECT_EQ(got[r], SampleToken(std::span<const float>(x, vocab), sp, index[r]));
        continue;
      }
      double mx = -1e300;
      for (int i = 0; i < vocab; ++i) mx = std::max(mx, double(x[i]) / sp.temperature);
      std::vector<double> p(vocab);
      double sum = 0;
      for (int i = 0; i < vocab; ++i) sum += (p[i] = std::exp(double(x[i]) / sp.temperature - mx));
      std::vector<int> order(vocab);
      for (int i = 0; i < vocab; ++i) order[i] = i;
      std::sort(order.begin(), order.end(),
                [&](int a, int b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
      const int keep_k = sp.top_k > 0 ? std::min(sp.top_k, vocab) : vocab;
      double mass = 0;
      for (int j = 0; j < keep_k; ++j) mass += p[order[j]];
      int keep = keep_k;
      double cum = 0;
      for (int j = 0; j < keep_k && sp.top_p < 1.0f; ++j) {
        cum += p[order[j]];
        if (cum >= sp.top_p * mass) {
          keep = j + 1;
          break;
        }
      }
      double total = 0;
      for (int j = 0; j < keep; ++j) total += p[order[j]];
      const double target = UniformFloat(sp.seed, index[r]) * total;
      int want = keep - 1;
      cum = 0;
      for (int j = 0; j < keep; ++j) {
        cum += p[order[j]];
        if (cum > target) {
          want = j;
          break;
        }
      }
      const int at =
          static_cast<int>(std::find(order.begin(), order.end(), got[r]) - order.begin());
      EXPECT_LE(std::abs(at - want), 1) << "row " << r << " round " << round << ": token " << got[r]
                                        << " is candidate " << at << ", want " << want;
      EXPECT_LT(at, keep) << "row " << r << " round " << round;
    }
  }
}

TEST(SamplingKernelTest, SameSeedSameTokenOnEveryRun) {
  SKIP_WITHOUT_GPU();
  const int vocab = 32000;
  std::vector<SamplingParams> params(6, SamplingParams{1.0f, 0, 1.0f, 99});
  std::vector<float> logits(params.size() * vocab);
  for (size_t r = 0; r < params.size(); ++r) {
    auto row = Random(vocab, 900, 6.0f);  // every row the same distribution and seed
    std::copy(row.begin(), row.end(), logits.begin() + r * vocab);
  }
  std::vector<uint64_t> index(params.size(), 5);
  auto first = DeviceSample(logits, vocab, params, index);
  for (int run = 0; run < 3; ++run) EXPECT_EQ(DeviceSample(logits, vocab, params, index), first);
  for (size_t r = 1; r < params.size(); ++r) EXPECT_EQ(first[r], first[0]);
}

TEST(SamplingKernelTest, EqualLogitsBreakTiesByLowerIndex) {
  SKIP_WITHOUT_GPU();
  const int vocab = 1000;
  std::vector<SamplingParams> params;
  std::vector<uint64_t> index;
  for (int i = 0; i < 16; ++i) {
    params.push_back({1.0f, i % 3 == 0 ? 10 : 0, i % 2 ? 0.5f : 1.0f, 42});
    index.push_back(i);
  }
  std::vector<float> logits(params.size() * vocab, 0.25f);
  auto got = DeviceSample(logits, vocab, params, index);
  for (size_t r = 0; r < params.size(); ++r) {
    std::span<const float> row(logits.data() + r * vocab, vocab);
    EXPECT_EQ(got[r], SampleToken(row, params[r], index[r])) << "row " << r;
  }
}

TEST(SamplingKernelTest, GreedyNeverPicksNanAndInfiniteLogitsFallBackToGreedy) {
  SKIP_WITHOUT_GPU();
  const int vocab = 64;
  std::vector<float> logits(4 * vocab, 0.0f);
  for (int i = 0; i < vocab; ++i) logits[i] = std::nanf("");  // row 0: all NaN -> 0
  logits[vocab + 3] = std::nanf("");                          // row 1: NaN, then max at 7
  logits[vocab + 7] = 2.0f;
  logits[vocab + 9] = 2.0f;
  logits[2 * vocab + 5] = INFINITY;  // row 2: +inf with temperature -> greedy 5
  for (int i = 0; i < vocab; ++i) logits[3 * vocab + i] = -INFINITY;  // row 3 -> 0
  std::vector<SamplingParams> params = {
      {0.0f, 0, 1.0f, 0}, {0.0f, 0, 1.0f, 0}, {1.0f, 0, 1.0f, 0}, {1.0f, 0, 1.0f, 0}};
  auto got = DeviceSample(logits, vocab, params, {0, 0, 0, 0});
  EXPECT_EQ(got, (std::vector<int32_t>{0, 7, 5, 0}));
}

// Greedy rows over a GPT-2-sized vocabulary, which a block reads in several batches of loads:
// the largest logit wins wherever it lies (first batch, last partial batch), the lower index on
// a tie across batches, and NaN never; rows of an odd width start at unaligned addresses.
TEST(SamplingKernelTest, GreedyArgmaxOverALargeVocabularyMatchesTheHostRule) {
  SKIP_WITHOUT_GPU();
  const int vocab = 50257;
  const std::vector<std::pair<int, int>> max_at = {
      {3, -1}, {50256, -1}, {40000, 20000}, {16383, 16384}, {49999, 12}};
  std::vector<float> logits;
  std::vector<SamplingParams> params;
  for (size_t r = 0; r < max_at.size(); ++r) {
    std::vector<float> row = Random(vocab, 500 + r, 3.0f);
    for (int i = 7; i < vocab; i += 997) row[i] = std::nanf("");
    row[max_at[r].first] = 5.0f;
    if (max_at[r].second >= 0) row[max_at[r].second] = 5.0f;
    logits.insert(logits.end(), row.begin(), row.end());
    params.push_back({0.0f, 0, 1.0f, 0});
  }
  auto got = DeviceSample(logits, vocab, params, std::vector<uint64_t>(max_at.size(), 0));
  for (size_t r = 0; r < max_at.size(); ++r) {
    std::span<const float> row(logits.data() + r * vocab, vocab);
    const int want =
        max_at[r].second >= 0 ? std::min(max_at[r].first, max_at[r].second) : max_at[r].first;
    EXPECT_EQ(got[r], want) << "row " << r;
    EXPECT_EQ(got[r], SampleToken(row, params[r], 0)) << "row " << r;
  }
}

// With --gtest_also_run_disabled_tests: the projections of an 8,192-row prefill of the
// llama3.1-8b shape through cublasGemmEx (what Matmul runs) and through each of cuBLASLt's first
// 16 heuristic candidates with a 32 MiB workspace, with their rates: whether choosing among them by
// measurement would beat cuBLAS's own choice.
TEST(GemmBenchmark, DISABLED_PrefillProjections) {
  SKIP_WITHOUT_GPU();
  const int rows = 8192;
  const std::vector<std::pair<int, int>> shapes = {
      {6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}};
  size_t max_elems = 0;
  for (auto [out, in] : shapes) {
    max_elems = std::max({max_elems, static_cast<size_t>(out) * in, static_cast<size_t>(rows) * in,
                          static_cast<size_t>(rows) * out});
  }
  DeviceBuffer w, x, y, workspace;
  ASSERT_TRUE(w.Allocate(max_elems * 2).ok());
  ASSERT_TRUE(x.Allocate(max_elems * 2).ok());
  ASSERT_TRUE(y.Allocate(max_elems * 2).ok());
  constexpr size_t kWorkspace = 32u << 20;
  ASSERT_TRUE(workspace.Allocate(kWorkspace).ok());
  ASSERT_EQ(cudaMemset(w.get(), 0x11, max_elems * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(x.get(), 0x22, max_elems * 2), cudaSuccess);
  cublasHandle_t blas = nullptr;
  cublasLtHandle_t lt = nullptr;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  cudaEvent_t start, stop;
  ASSERT_EQ(cudaEventCreate(&start), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&stop), cudaSuccess);
  // Mean microseconds of `reps` launches after two.
  auto time_us = [&](const std::function<bool()>& launch, int reps) {
    for (int i = 0; i < 2; ++i) EXPECT_TRUE(launch());
    EXPECT_EQ(cudaEventRecord(start), cudaSuccess);
    for (int i = 0; i < reps; ++i) EXPECT_TRUE(launch());
    EXPECT_EQ(cudaEventRecord(stop), cudaSuccess);
    EXPECT_EQ(cudaEventSynchronize(stop), cudaSuccess);
    float ms = 0.0f;
    EXPECT_EQ(cudaEventElapsedTime(&ms, start, stop), cudaSuccess);
    return ms * 1e3 / reps;
  };
  for (auto [out, in] : shapes) {
    const double flops = 2.0 * rows * out * in;
    const double base = time_us(
        [&] {
          return Gemm(blas, DType::kF16, x.get(), w.get(), y.get(), rows, out, in, 0.0f, false)
              .ok();
        },
        10);
    std::printf("gemm rows %d out %d in %d: cublasGemmEx %.1f us (%.0f TFLOP/s)\n", rows, out, in,
                base, flops / base * 1e-6);
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    ASSERT_EQ(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
              CUBLAS_STATUS_SUCCESS);
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    cublasLtMatrixLayoutCreate(&a, CUDA_R_16F, in, out, in);
    cublasLtMatrixLayoutCreate(&b, CUDA_R_16F, in, rows, in);
    cublasLtMatrixLayoutCreate(&c, CUDA_R_16F, out, rows, out);
    cublasLtMatmulPreference_t pref = nullptr;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                         &kWorkspace, sizeof(kWorkspace));
    std::vector<cublasLtMatmulHeuristicResult_t> found(16);
    int count = 0;
    ASSERT_EQ(cublasLtMatmulAlgoGetHeuristic(lt, desc, a, b, c, c, pref, 16, found.data(), &count),
              CUBLAS_STATUS_SUCCESS);
    const float alpha = 1.0f, beta = 0.0f;
    for (int i = 0; i < count; ++i) {
      const double us = time_us(
          [&] {
            return cublasLtMatmul(lt, desc, &alpha, w.get(), a, x.get(), b, &beta, y.get(), c,
                                  y.get(), c, &found[i].algo, workspace.get(), kWorkspace,
                                  nullptr) == CUBLAS_STATUS_SUCCESS;
          },
          10);
      std::printf("  lt #%d: %.1f us (%.0f TFLOP/s, %.3f of cublasGemmEx's time)\n", i, us,
                  flops / us * 1e-6, us / base);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(c);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatmulDescDestroy(desc);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cublasLtDestroy(lt);
  cublasDestroy(blas);
}

}  // namespace
}  // namespace tandem::cuda
