// The paged KV-cache kernels (worker/cuda/kv_pages.h) against their contiguous counterparts on the
// same K and V: a contiguous cache of several slots, and the same positions scattered over
// shuffled pages of a pool. Table entries a kernel must not read (past a sequence's last position,
// wholly before its window) point at a page of NaNs, as do the pool's spare pages, so that a read
// through a wrong entry shows in the output. The launch checks run without a GPU; the rest is
// skipped where no GPU is present.
#include "worker/cuda/kv_pages.h"

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/rng.h"
#include "gtest/gtest.h"
#include "tests/worker/cuda/cuda_test_util.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/cuda_stage.h"
#include "worker/cuda/kernels.h"
#include "worker/cuda/prefill_attention.h"
#include "worker/cuda/prefill_attention_sm90.h"

namespace tandem::cuda {
namespace {

std::vector<uint16_t> RandomHalves(DType t, size_t n, uint64_t seed, float scale = 1.0f) {
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = (UniformFloat(seed, i) * 2.0f - 1.0f) * scale;
  std::vector<uint16_t> h(n);
  FromFloat(t, f.data(), n, h.data());
  return h;
}

uint16_t NanBits(DType t) { return t == DType::kF16 ? 0x7e00 : 0x7fc0; }

template <typename E>
DeviceBuffer Upload(const std::vector<E>& v) {
  DeviceBuffer b;
  EXPECT_TRUE(b.Allocate(std::max<size_t>(v.size() * sizeof(E), 16)).ok());
  EXPECT_EQ(cudaMemcpy(b.get(), v.data(), v.size() * sizeof(E), cudaMemcpyHostToDevice),
            cudaSuccess);
  return b;
}

std::vector<uint16_t> Download(const DeviceBuffer& b, size_t n) {
  std::vector<uint16_t> h(n);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(h.data(), b.get(), n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

// A contiguous cache (seqs, kv_heads, capacity, head_dim) and a pool of pages holding the same
// positions: sequence s's table row maps its capacity / page_size pages to shuffled page ids.
// Page 0 and the spare pages hold NaNs; entries outside [lo[s], hi[s]] (by page) point at page 0.
struct PagedCopy {
  int seqs, kv_heads, head_dim, capacity, page_size, stride, num_pages;
  std::vector<int32_t> table;  // (seqs, stride)

  PagedCopy(int seqs_, int kv_heads_, int head_dim_, int capacity_, int page_size_,
            const std::vector<int>& lo, const std::vector<int>& hi, uint64_t seed)
      : seqs(seqs_),
        kv_heads(kv_heads_),
        head_dim(head_dim_),
        capacity(capacity_),
        page_size(page_size_),
        stride(capacity_ / page_size_) {
    num_pages = 1 + seqs * stride + 3;  // the NaN page, every sequence's pages, spares
    std::vector<int32_t> ids(num_pages - 1);
    std::iota(ids.begin(), ids.end(), 1);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(static_cast<uint32_t>(seed)));
    table.assign(size_t(seqs) * stride, 0);
    for (int s = 0; s < seqs; ++s) {
      for (int j = 0; j < stride; ++j) {
        const bool used = (j + 1) * page_size > lo[s] && j * page_size <= hi[s];
        table[size_t(s) * stride + j] = used ? ids[size_t(s) * stride + j] : 0;
      }
    }
  }
  size_t ContiguousSize() const { return size_t(seqs) * kv_heads * capacity * head_dim; }
  size_t PoolSize() const { return size_t(num_pages) * kv_heads * page_size * head_dim; }
  size_t ContiguousAt(int s, int h, int p) const {
    return ((size_t(s) * kv_heads + h) * capacity + p) * head_dim;
  }
  // Where (s, h, p) is in the pool, or SIZE_MAX where its table entry is the NaN page.
  size_t PoolAt(int s, int h, int p) const {
    const int page = table[size_t(s) * stride + p / page_size];
    if (page == 0) return SIZE_MAX;
    return ((size_t(page) * kv_heads + h) * page_size + p % page_size) * head_dim;
  }
  std::vector<uint16_t> Scatter(const std::vector<uint16_t>& contiguous, uint16_t nan) const {
    std::vector<uint16_t> pool(PoolSize(), nan);
    ForEach([&](size_t c, size_t p) { pool[p] = contiguous[c]; });
    return pool;
  }
  // The contiguous cache `background` with every position the table maps taken from `pool`.
  std::vector<uint16_t> Gather(const std::vector<uint16_t>& pool,
                               std::vector<uint16_t> background) const {
    ForEach([&](size_t c, size_t p) { background[c] = pool[p]; });
    return background;
  }
  // f(contiguous index, pool index) for every element the table maps.
  template <typename F>
  void ForEach(F f) const {
    for (int s = 0; s < seqs; ++s) {
      for (int h = 0; h < kv_heads; ++h) {
        for (int p = 0; p < capacity; ++p) {
          const size_t at = PoolAt(s, h, p);
          if (at == SIZE_MAX) continue;
          for (int d = 0; d < head_dim; ++d) f(ContiguousAt(s, h, p) + d, at + d);
        }
      }
    }
  }
};

// Device copies of a contiguous cache and its paged copy.
struct DeviceCaches {
  DeviceBuffer k, v, k_pool, v_pool, table;
  KvPages pages;
  DeviceCaches(const PagedCopy& pc, const std::vector<uint16_t>& k_host,
               const std::vector<uint16_t>& v_host, uint16_t nan)
      : k(Upload(k_host)),
        v(Upload(v_host)),
        k_pool(Upload(pc.Scatter(k_host, nan))),
        v_pool(Upload(pc.Scatter(v_host, nan))),
        table(Upload(pc.table)) {
    pages.k = k_pool.get();
    pages.v = v_pool.get();
    pages.num_pages = pc.num_pages;
    pages.page_size = pc.page_size;
    pages.block_table = table.as<int32_t>();
    pages.table_stride = pc.stride;
  }
};

class KvPagesTest : public ::testing::TestWithParam<DType> {
 protected:
  DType t() const { return GetParam(); }
};

// Decode attention at positions that end on, before and after page boundaries, 4 query heads per
// kv head, with and without a window, in one split and in several; head_dim 64 and 128 (the
// register kernel, 100 with 8-byte loads) and 96 (the shared-memory one).
class DecodeAttentionPagesTest : public ::testing::TestWithParam<std::tuple<DType, int>> {};

INSTANTIATE_TEST_SUITE_P(Types, DecodeAttentionPagesTest,
                         ::testing::Combine(::testing::Values(DType::kF16, DType::kBF16),
                                            ::testing::Values(64, 96, 100, 128)));

TEST_P(DecodeAttentionPagesTest, EqualsContiguousBitForBit) {
  SKIP_WITHOUT_GPU();
  const DType type = std::get<0>(GetParam());
  auto t = [type] { return type; };
  const int kv_heads = 2, heads = 8, hd = std::get<1>(GetParam()), cap = 640;
  const std::vector<int32_t> pos = {0, 15, 16, 63, 64, 200, 511, 575};
  const int rows = static_cast<int>(pos.size());
  std::vector<int32_t> seq(rows);
  std::iota(seq.begin(), seq.end(), 0);
  const auto q = RandomHalves(t(), size_t(rows) * heads * hd, 1, 3.0f);
  DeviceBuffer dq = Upload(q), dpos = Upload(pos), dseq = Upload(seq);
  for (int ps : {4, 16, 32, 64, 128}) {
    for (int window : {0, 40}) {
      std::vector<int> lo(rows), hi(pos.begin(), pos.end());
      for (int r = 0; r < rows; ++r) lo[r] = window > 0 ? std::max(0, pos[r] - window + 1) : 0;
      const PagedCopy pc(rows, kv_heads, hd, cap, ps, lo, hi, 7 + ps);
      const auto k = RandomHalves(t(), pc.ContiguousSize(), 2);
      const auto v = RandomHalves(t(), pc.ContiguousSize(), 3);
      DeviceCaches dc(pc, k, v, NanBits(t()));
      for (int splits : {1, 3}) {
        SCOPED_TRACE(testing::Message()
                     << "page size " << ps << ", window " << window << ", " << splits << " splits");
        DeviceBuffer part, counters, out[2];
        ASSERT_TRUE(
            part.Allocate(AttentionPartialFloats(rows, heads, hd, splits) * sizeof(float)).ok());
        ASSERT_TRUE(counters.Allocate(size_t(rows) * kv_heads * 4).ok());
        ASSERT_EQ(cudaMemset(counters.get(), 0, counters.size()), cudaSuccess);
        for (DeviceBuffer& o : out) ASSERT_TRUE(o.Allocate(q.size() * 2).ok());
        const AttentionParams params{0.125f, window};
        ASSERT_TRUE(LaunchAttention(t(), dq.get(), dc.k.get(), dc.v.get(), dpos.as<int32_t>(),
                                    dseq.as<int32_t>(), part.as<float>(), out[0].get(), rows, heads,
                                    kv_heads, hd, cap, splits, params, nullptr,
                                    counters.as<uint32_t>())
                        .ok());
        ASSERT_TRUE(LaunchAttentionPaged(t(), dq.get(), dc.pages, dpos.as<int32_t>(),
                                         dseq.as<int32_t>(), part.as<float>(), out[1].get(), rows,
                                         heads, kv_heads, hd, splits, params, nullptr,
                                         counters.as<uint32_t>())
                        .ok());
        EXPECT_EQ(Download(out[1], q.size()), Download(out[0], q.size()));
      }
    }
  }
}

// Prefill attention over runs of rows: a prompt crossing many pages, a chunk after a cached prefix,
// short sequences sharing a 128-row tile, with and without a window. head_dim 96 and 100 run the
// mma.sync kernel for both layouts, 128 the warpgroup-MMA kernel on an H100 for both (bit for bit),
// except with pages of 4, which take the mma.sync kernel: within the rounding of the output.
TEST_P(KvPagesTest, PrefillAttentionEqualsContiguous) {
  SKIP_WITHOUT_GPU();
  struct Run {
    int seq, start, len;
  };
  const std::vector<Run> runs = {{0, 0, 300}, {1, 130, 70}, {2, 0, 5}, {3, 60, 9}, {4, 0, 1}};
  const int kv_heads = 2, heads = 8, cap = 384, seqs = 5;
  std::vector<int32_t> pos, seq;
  std::vector<int> last(seqs, 0);
  for (const Run& r : runs) {
    for (int i = 0; i < r.len; ++i) {
      pos.push_back(r.start + i);
      seq.push_back(r.seq);
    }
    last[r.seq] = r.start + r.len - 1;
  }
  const int rows = static_cast<int>(pos.size());
  DeviceBuffer dpos = Upload(pos), dseq = Upload(seq);
  for (int hd : {96, 100, 128}) {
    const auto q = RandomHalves(t(), size_t(rows) * heads * hd, 11, 3.0f);
    DeviceBuffer dq = Upload(q);
    for (int ps : {4, 16, 64, 128}) {
      for (int window : {0, 50}) {
        SCOPED_TRACE(testing::Message()
                     << "head_dim " << hd << ", page size " << ps << ", window " << window);
        std::vector<int> lo(seqs, 0);
        for (const Run& r : runs) lo[r.seq] = window > 0 ? std::max(0, r.start - window + 1) : 0;
        const PagedCopy pc(seqs, kv_heads, hd, cap, ps, lo, last, 19 + ps);
        const auto k = RandomHalves(t(), pc.ContiguousSize(), 12);
        const auto v = RandomHalves(t(), pc.ContiguousSize(), 13);
        DeviceCaches dc(pc, k, v, NanBits(t()));
        DeviceBuffer out[2];
        for (DeviceBuffer& o : out) ASSERT_TRUE(o.Allocate(q.size() * 2).ok());
        const AttentionParams params{1.0f / std::sqrt(float(hd)), window};
        ASSERT_TRUE(LaunchPrefillAttention(t(), dq.get(), dc.k.get(), dc.v.get(),
                                           dpos.as<int32_t>(), dseq.as<int32_t>(), out[0].get(),
                                           rows, heads, kv_heads, hd, cap, params, nullptr)
                        .ok());
        ASSERT_TRUE(LaunchPrefillAttentionPaged(t(), dq.get(), dc.pages, dpos.as<int32_t>(),
                                                dseq.as<int32_t>(), out[1].get(), rows, heads,
                                                kv_heads, hd, params, nullptr)
                        .ok());
        const auto want = Download(out[0], q.size()), got = Download(out[1], q.size());
        // The same kernel for both layouts: bit for bit.
        if (hd == 96 || ps >= kMinSm90PageSize) {
          EXPECT_EQ(got, want);
          continue;
        }
        std::vector<float> gf(q.size()), wf(q.size());
        ToFloat(t(), got.data(), got.size(), gf.data());
        ToFloat(t(), want.data(), want.size(), wf.data());
        const float tol = t() == DType::kF16 ? 2e-3f : 1.6e-2f;
        int bad = 0;
        for (size_t i = 0; i < gf.size(); ++i) {
          if (!(std::fabs(gf[i] - wf[i]) <= tol) && ++bad <= 5) {
            ADD_FAILURE() << "output " << i << ": paged " << gf[i] << ", contiguous " << wf[i];
          }
        }
        EXPECT_EQ(bad, 0);
      }
    }
  }
}

// The cache write of the QKV split (the few-rows kernel and, from 128 rows, the row kernel) and of
// the fused GEMV epilogue: q and every cache position the same as through slots.
TEST_P(KvPagesTest, CacheWritesEqualContiguousBitForBit) {
  SKIP_WITHOUT_GPU();
  const int heads = 4, kv_heads = 2, hd = 64, cap = 256, seqs = 3, in = 256;
  const int q_dim = heads * hd, kv_dim = kv_heads * hd, cols = q_dim + 2 * kv_dim;
  std::vector<float> inv_freq(hd / 2);
  for (int i = 0; i < hd / 2; ++i) inv_freq[i] = static_cast<float>(std::pow(5e5, -2.0 * i / hd));
  DeviceBuffer dfreq = Upload(inv_freq);
  const auto w = RandomHalves(t(), size_t(cols) * in, 20, 0.1f);
  const auto bias = RandomHalves(t(), cols, 21);
  DeviceBuffer dw = Upload(w), dbias = Upload(bias);
  for (int ps : {4, 16, 128}) {
    const PagedCopy pc(seqs, kv_heads, hd, cap, ps, {0, 0, 0}, {cap - 1, cap - 1, cap - 1}, ps);
    const auto background = RandomHalves(t(), pc.ContiguousSize(), 22);
    for (int rows : {1, 8, 200}) {
      SCOPED_TRACE(testing::Message() << "page size " << ps << ", " << rows << " rows");
      std::vector<int32_t> pos(rows), seq(rows);
      for (int r = 0; r < rows; ++r) {
        seq[r] = r % seqs;
        pos[r] = (r * 37 + 5) % cap;
      }
      if (rows == 200) {  // one position per (sequence, position): a prompt of each
        for (int r = 0; r < rows; ++r) pos[r] = r / seqs + 3;
      }
      DeviceBuffer dpos = Upload(pos), dseq = Upload(seq);
      const auto qkv = RandomHalves(t(), size_t(rows) * cols, 23);
      DeviceBuffer dqkv = Upload(qkv), q[2];
      for (DeviceBuffer& b : q) ASSERT_TRUE(b.Allocate(size_t(rows) * q_dim * 2).ok());
      auto compare = [&](DeviceCaches& dc, const char* what) {
        SCOPED_TRACE(what);
        EXPECT_EQ(Download(q[1], size_t(rows) * q_dim), Download(q[0], size_t(rows) * q_dim));
        const size_t n = pc.ContiguousSize();
        const auto k_want = Download(dc.k, n), v_want = Download(dc.v, n);
        EXPECT_EQ(pc.Gather(Download(dc.k_pool, pc.PoolSize()), k_want), k_want);
        EXPECT_EQ(pc.Gather(Download(dc.v_pool, pc.PoolSize()), v_want), v_want);
      };
      {
        DeviceCaches dc(pc, background, background, NanBits(t()));
        ASSERT_TRUE(LaunchQkvRopeCache(t(), dqkv.get(), dbias.get(), q[0].get(), dc.k.get(),
                                       dc.v.get(), dpos.as<int32_t>(), dseq.as<int32_t>(), rows,
                                       heads, kv_heads, hd, cap, dfreq.as<float>(), nullptr)
                        .ok());
        ASSERT_TRUE(LaunchQkvRopeCachePaged(t(), dqkv.get(), dbias.get(), q[1].get(), dc.pages,
                                            dpos.as<int32_t>(), dseq.as<int32_t>(), rows, heads,
                                            kv_heads, hd, dfreq.as<float>(), nullptr)
                        .ok());
        compare(dc, "QKV split");
      }
      if (rows > 8) continue;
      DeviceCaches dc(pc, background, background, NanBits(t()));
      const auto x = RandomHalves(t(), size_t(rows) * in, 24);
      DeviceBuffer dx = Upload(x);
      QkvCacheArgs a;
      a.q_out = q[0].get();
      a.k_cache = dc.k.get();
      a.v_cache = dc.v.get();
      a.positions = dpos.as<int32_t>();
      a.slots = dseq.as<int32_t>();
      a.num_heads = heads;
      a.num_kv_heads = kv_heads;
      a.head_dim = hd;
      a.seq_capacity = cap;
      a.inv_freq = dfreq.as<float>();
      ASSERT_TRUE(GemvQkvCache(t(), dx.get(), dw.get(), dbias.get(), a, rows, in, nullptr).ok());
      a.q_out = q[1].get();
      a.k_cache = a.v_cache = nullptr;
      ASSERT_TRUE(
          GemvQkvCachePaged(t(), dx.get(), dw.get(), nullptr, dbias.get(), a, dc.pages, rows, in, nullptr)
              .ok());
      compare(dc, "QKV GEMV");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, KvPagesTest, ::testing::Values(DType::kF16, DType::kBF16),
                         [](const auto& info) {
                           return info.param == DType::kF16 ? std::string("F16")
                                                            : std::string("BF16");
                         });

// A sequence's positions between its pages and a KV block, both ways, against the slot copy.
TEST(KvPagesCopyTest, BlockCopyEqualsContiguousBitForBit) {
  SKIP_WITHOUT_GPU();
  const int kv_heads = 3, hd = 64, cap = 256, seqs = 3, s = 1;
  for (int ps : {4, 32, 128}) {
    for (int positions : {1, 37, 256}) {
      SCOPED_TRACE(testing::Message() << "page size " << ps << ", " << positions << " positions");
      const PagedCopy pc(seqs, kv_heads, hd, cap, ps, {0, 0, 0}, {cap - 1, cap - 1, cap - 1},
                         3 + ps);
      const auto k = RandomHalves(DType::kF16, pc.ContiguousSize(), 30);
      const auto v = RandomHalves(DType::kF16, pc.ContiguousSize(), 31);
      DeviceCaches dc(pc, k, v, NanBits(DType::kF16));
      const size_t block_n = size_t(positions) * kv_heads * hd;
      DeviceBuffer bk[2], bv[2];
      for (int i : {0, 1}) {
        ASSERT_TRUE(bk[i].Allocate(block_n * 2).ok());
        ASSERT_TRUE(bv[i].Allocate(block_n * 2).ok());
      }
      ASSERT_TRUE(LaunchKvBlockCopy(dc.k.get(), dc.v.get(), s, bk[0].get(), bv[0].get(), positions,
                                    kv_heads, hd, cap, /*to_block=*/true, nullptr)
                      .ok());
      ASSERT_TRUE(LaunchKvBlockCopyPaged(dc.pages, s, bk[1].get(), bv[1].get(), positions, kv_heads,
                                         hd, /*to_block=*/true, nullptr)
                      .ok());
      EXPECT_EQ(Download(bk[1], block_n), Download(bk[0], block_n));
      EXPECT_EQ(Download(bv[1], block_n), Download(bv[0], block_n));

      DeviceBuffer in_k = Upload(RandomHalves(DType::kF16, block_n, 32));
      DeviceBuffer in_v = Upload(RandomHalves(DType::kF16, block_n, 33));
      ASSERT_TRUE(LaunchKvBlockCopy(dc.k.get(), dc.v.get(), s, in_k.get(), in_v.get(), positions,
                                    kv_heads, hd, cap, /*to_block=*/false, nullptr)
                      .ok());
      ASSERT_TRUE(LaunchKvBlockCopyPaged(dc.pages, s, in_k.get(), in_v.get(), positions, kv_heads,
                                         hd, /*to_block=*/false, nullptr)
                      .ok());
      const size_t n = pc.ContiguousSize();
      const auto k_want = Download(dc.k, n), v_want = Download(dc.v, n);
      EXPECT_EQ(pc.Gather(Download(dc.k_pool, pc.PoolSize()), k_want), k_want);
      EXPECT_EQ(pc.Gather(Download(dc.v_pool, pc.PoolSize()), v_want), v_want);
    }
  }
}

// FP8 pages (KvPages::fp8): E4M3 codes, one byte an element, of the values over the layer's scale.
uint8_t Code(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }
float CodeValue(uint8_t c) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(c, __NV_E4M3);
  return __half2float(__half(h));
}
constexpr uint8_t kNanCode = 0x7f;

// Random K or V as codes of values in [-range, range) over `scale`, and the same values as elements
// of t (code value times scale: exact for a power-of-two scale).
struct Fp8Cache {
  std::vector<uint8_t> codes;
  std::vector<uint16_t> values;
  Fp8Cache(DType t, size_t n, uint64_t seed, float scale, float range = 1.5f) : codes(n), values(n) {
    std::vector<float> f(n);
    for (size_t i = 0; i < n; ++i) {
      codes[i] = Code((UniformFloat(seed, i) * 2.0f - 1.0f) * range / scale);
      f[i] = CodeValue(codes[i]) * scale;
    }
    FromFloat(t, f.data(), n, values.data());
  }
};

std::vector<uint8_t> ScatterCodes(const PagedCopy& pc, const std::vector<uint8_t>& contiguous) {
  std::vector<uint8_t> pool(pc.PoolSize(), kNanCode);
  pc.ForEach([&](size_t c, size_t p) { pool[p] = contiguous[c]; });
  return pool;
}

std::vector<uint8_t> DownloadBytes(const DeviceBuffer& b, size_t n) {
  std::vector<uint8_t> h(n);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(h.data(), b.get(), n, cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

// Pools of codes on the device for a PagedCopy's table.
struct Fp8Pages {
  DeviceBuffer k_pool, v_pool, table;
  KvPages pages;
  Fp8Pages(const PagedCopy& pc, const std::vector<uint8_t>& k, const std::vector<uint8_t>& v,
           float k_scale, float v_scale)
      : k_pool(Upload(ScatterCodes(pc, k))),
        v_pool(Upload(ScatterCodes(pc, v))),
        table(Upload(pc.table)) {
    pages.k = k_pool.get();
    pages.v = v_pool.get();
    pages.num_pages = pc.num_pages;
    pages.page_size = pc.page_size;
    pages.block_table = table.as<int32_t>();
    pages.table_stride = pc.stride;
    pages.fp8 = true;
    pages.k_scale = k_scale;
    pages.v_scale = v_scale;
  }
};

// Decode attention over FP8 pages: with power-of-two scales, which commute with every rounding,
// bit for bit the attention over a contiguous cache of the codes' values (the same register
// kernel, the scales folded into the query and the output); with any scale, within fp16 rounding.
TEST_P(DecodeAttentionPagesTest, Fp8PagesEqualAttentionOverTheirValues) {
  SKIP_WITHOUT_GPU();
  const DType type = std::get<0>(GetParam());
  const int hd = std::get<1>(GetParam()), cap = 640;
  const std::vector<int32_t> pos = {0, 15, 16, 63, 64, 200, 511, 575};
  const int rows = static_cast<int>(pos.size());
  std::vector<int32_t> seq(rows);
  std::iota(seq.begin(), seq.end(), 0);
  DeviceBuffer dpos = Upload(pos), dseq = Upload(seq);
  // Groups of 4 (one iteration's codes in flight), and of 1, 2 and 8 (the next iteration's codes
  // loaded ahead).
  for (const auto& [heads, kv_heads] :
       {std::pair{8, 2}, std::pair{4, 4}, std::pair{8, 4}, std::pair{16, 2}}) {
    const auto q = RandomHalves(type, size_t(rows) * heads * hd, 41, 3.0f);
    DeviceBuffer dq = Upload(q);
    for (const auto& [ks, vs] : {std::pair{0.5f, 4.0f}, std::pair{0.3f, 1.7f}}) {
      for (int ps : {4, 16, 64}) {
        for (int window : {0, 40}) {
          std::vector<int> lo(rows), hi(pos.begin(), pos.end());
          for (int r = 0; r < rows; ++r) lo[r] = window > 0 ? std::max(0, pos[r] - window + 1) : 0;
          const PagedCopy pc(rows, kv_heads, hd, cap, ps, lo, hi, 17 + ps);
          const Fp8Cache k(type, pc.ContiguousSize(), 42, ks), v(type, pc.ContiguousSize(), 43, vs);
          Fp8Pages fp(pc, k.codes, v.codes, ks, vs);
          DeviceBuffer dk = Upload(k.values), dv = Upload(v.values);
          for (int splits : {1, 3}) {
            SCOPED_TRACE(testing::Message()
                         << heads << " heads over " << kv_heads << ", scales " << ks << "/" << vs
                         << ", page size " << ps << ", window " << window << ", " << splits
                         << " splits");
            DeviceBuffer part, counters, out[2];
            ASSERT_TRUE(
                part.Allocate(AttentionPartialFloats(rows, heads, hd, splits) * sizeof(float))
                    .ok());
            ASSERT_TRUE(counters.Allocate(size_t(rows) * kv_heads * 4).ok());
            ASSERT_EQ(cudaMemset(counters.get(), 0, counters.size()), cudaSuccess);
            for (DeviceBuffer& o : out) ASSERT_TRUE(o.Allocate(q.size() * 2).ok());
            const AttentionParams params{0.125f, window};
            ASSERT_TRUE(LaunchAttention(type, dq.get(), dk.get(), dv.get(), dpos.as<int32_t>(),
                                        dseq.as<int32_t>(), part.as<float>(), out[0].get(), rows,
                                        heads, kv_heads, hd, cap, splits, params, nullptr,
                                        counters.as<uint32_t>())
                            .ok());
            const absl::Status st = LaunchAttentionPaged(
                type, dq.get(), fp.pages, dpos.as<int32_t>(), dseq.as<int32_t>(), part.as<float>(),
                out[1].get(), rows, heads, kv_heads, hd, splits, params, nullptr,
                counters.as<uint32_t>());
            ASSERT_TRUE(st.ok()) << st;
            const auto want = Download(out[0], q.size()), got = Download(out[1], q.size());
            if (ks == 0.5f) {
              EXPECT_EQ(got, want);
              continue;
            }
            std::vector<float> gf(q.size()), wf(q.size());
            ToFloat(type, got.data(), got.size(), gf.data());
            ToFloat(type, want.data(), want.size(), wf.data());
            const float tol = type == DType::kF16 ? 4e-3f : 3e-2f;
            int bad = 0;
            for (size_t i = 0; i < gf.size(); ++i) {
              if (!(std::fabs(gf[i] - wf[i]) <= tol) && ++bad <= 5) {
                ADD_FAILURE() << "output " << i << ": FP8 pages " << gf[i] << ", values " << wf[i];
              }
            }
            EXPECT_EQ(bad, 0);
          }
        }
      }
    }
  }
}

// Prefill attention over FP8 pages (the mma.sync kernel, converting codes as it stages its tiles)
// against the same kernel over pages of the codes' values (pages of 4, which the mma.sync kernel
// takes on every GPU): bit for bit with power-of-two scales.
TEST_P(KvPagesTest, PrefillAttentionOverFp8PagesEqualsItsValues) {
  SKIP_WITHOUT_GPU();
  struct Run {
    int seq, start, len;
  };
  const std::vector<Run> runs = {{0, 0, 300}, {1, 130, 70}, {2, 0, 5}, {3, 60, 9}, {4, 0, 1}};
  const int kv_heads = 2, heads = 8, cap = 384, seqs = 5;
  std::vector<int32_t> pos, seq;
  std::vector<int> last(seqs, 0);
  for (const Run& r : runs) {
    for (int i = 0; i < r.len; ++i) {
      pos.push_back(r.start + i);
      seq.push_back(r.seq);
    }
    last[r.seq] = r.start + r.len - 1;
  }
  const int rows = static_cast<int>(pos.size());
  DeviceBuffer dpos = Upload(pos), dseq = Upload(seq);
  const float ks = 0.25f, vs = 2.0f;
  for (int hd : {64, 100, 128}) {
    const auto q = RandomHalves(t(), size_t(rows) * heads * hd, 51, 3.0f);
    DeviceBuffer dq = Upload(q);
    for (int ps : {4, 16, 64}) {
      for (int window : {0, 50}) {
        SCOPED_TRACE(testing::Message()
                     << "head_dim " << hd << ", page size " << ps << ", window " << window);
        std::vector<int> lo(seqs, 0);
        for (const Run& r : runs) lo[r.seq] = window > 0 ? std::max(0, r.start - window + 1) : 0;
        const PagedCopy pc(seqs, kv_heads, hd, cap, ps, lo, last, 29 + ps);
        const PagedCopy pc4(seqs, kv_heads, hd, cap, 4, lo, last, 31);
        const Fp8Cache k(t(), pc.ContiguousSize(), 52, ks), v(t(), pc.ContiguousSize(), 53, vs);
        Fp8Pages fp(pc, k.codes, v.codes, ks, vs);
        DeviceCaches values(pc4, k.values, v.values, NanBits(t()));
        DeviceBuffer out[2];
        for (DeviceBuffer& o : out) ASSERT_TRUE(o.Allocate(q.size() * 2).ok());
        const AttentionParams params{1.0f / std::sqrt(float(hd)), window};
        ASSERT_TRUE(LaunchPrefillAttentionPaged(t(), dq.get(), values.pages, dpos.as<int32_t>(),
                                                dseq.as<int32_t>(), out[0].get(), rows, heads,
                                                kv_heads, hd, params, nullptr)
                        .ok());
        const absl::Status st =
            LaunchPrefillAttentionPaged(t(), dq.get(), fp.pages, dpos.as<int32_t>(),
                                        dseq.as<int32_t>(), out[1].get(), rows, heads, kv_heads,
                                        hd, params, nullptr);
        ASSERT_TRUE(st.ok()) << st;
        EXPECT_EQ(Download(out[1], q.size()), Download(out[0], q.size()));
      }
    }
  }
}

// The cache writes into FP8 pages (the QKV split's two kernels and the fused GEMV's epilogue): each
// position's code is E4M3(value / scale) of the value the fp16/bf16 pages receive.
TEST_P(KvPagesTest, CacheWritesIntoFp8PagesAreTheCodesOfTheValues) {
  SKIP_WITHOUT_GPU();
  const int heads = 4, kv_heads = 2, hd = 64, cap = 256, seqs = 3, in = 256;
  const int q_dim = heads * hd, kv_dim = kv_heads * hd, cols = q_dim + 2 * kv_dim;
  const float ks = 0.3f, vs = 1.7f;
  std::vector<float> inv_freq(hd / 2);
  for (int i = 0; i < hd / 2; ++i) inv_freq[i] = static_cast<float>(std::pow(5e5, -2.0 * i / hd));
  DeviceBuffer dfreq = Upload(inv_freq);
  const auto w = RandomHalves(t(), size_t(cols) * in, 60, 0.1f);
  const auto bias = RandomHalves(t(), cols, 61);
  DeviceBuffer dw = Upload(w), dbias = Upload(bias);
  for (int ps : {4, 16}) {
    const PagedCopy pc(seqs, kv_heads, hd, cap, ps, {0, 0, 0}, {cap - 1, cap - 1, cap - 1}, ps);
    const auto background = RandomHalves(t(), pc.ContiguousSize(), 62);
    const std::vector<uint8_t> zero_codes(pc.ContiguousSize(), 0);
    for (int rows : {1, 8, 200}) {
      SCOPED_TRACE(testing::Message() << "page size " << ps << ", " << rows << " rows");
      std::vector<int32_t> pos(rows), seq(rows);
      for (int r = 0; r < rows; ++r) {
        seq[r] = r % seqs;
        pos[r] = rows == 200 ? r / seqs + 3 : (r * 37 + 5) % cap;
      }
      DeviceBuffer dpos = Upload(pos), dseq = Upload(seq);
      const auto qkv = RandomHalves(t(), size_t(rows) * cols, 63);
      DeviceBuffer dqkv = Upload(qkv), q[2];
      for (DeviceBuffer& b : q) ASSERT_TRUE(b.Allocate(size_t(rows) * q_dim * 2).ok());
      // Every written position of the value pages, as codes, equals the FP8 pages' byte.
      auto compare = [&](DeviceCaches& dc, Fp8Pages& fp, const char* what) {
        SCOPED_TRACE(what);
        EXPECT_EQ(Download(q[1], size_t(rows) * q_dim), Download(q[0], size_t(rows) * q_dim));
        const auto k_vals = Download(dc.k_pool, pc.PoolSize());
        const auto v_vals = Download(dc.v_pool, pc.PoolSize());
        const auto k_codes = DownloadBytes(fp.k_pool, pc.PoolSize());
        const auto v_codes = DownloadBytes(fp.v_pool, pc.PoolSize());
        std::vector<float> kf(k_vals.size()), vf(v_vals.size());
        ToFloat(t(), k_vals.data(), k_vals.size(), kf.data());
        ToFloat(t(), v_vals.data(), v_vals.size(), vf.data());
        int written = 0, bad = 0;
        for (int r = 0; r < rows; ++r) {
          for (int h = 0; h < kv_heads; ++h) {
            const size_t at = pc.PoolAt(seq[r], h, pos[r]);
            for (int d = 0; d < hd; ++d, ++written) {
              if (k_codes[at + d] != Code(kf[at + d] / ks) && ++bad <= 5) {
                ADD_FAILURE() << "K row " << r << " head " << h << " dim " << d;
              }
              if (v_codes[at + d] != Code(vf[at + d] / vs) && ++bad <= 5) {
                ADD_FAILURE() << "V row " << r << " head " << h << " dim " << d;
              }
            }
          }
        }
        EXPECT_EQ(bad, 0) << "of " << written;
      };
      {
        DeviceCaches dc(pc, background, background, NanBits(t()));
        Fp8Pages fp(pc, zero_codes, zero_codes, ks, vs);
        ASSERT_TRUE(LaunchQkvRopeCachePaged(t(), dqkv.get(), dbias.get(), q[0].get(), dc.pages,
                                            dpos.as<int32_t>(), dseq.as<int32_t>(), rows, heads,
                                            kv_heads, hd, dfreq.as<float>(), nullptr)
                        .ok());
        ASSERT_TRUE(LaunchQkvRopeCachePaged(t(), dqkv.get(), dbias.get(), q[1].get(), fp.pages,
                                            dpos.as<int32_t>(), dseq.as<int32_t>(), rows, heads,
                                            kv_heads, hd, dfreq.as<float>(), nullptr)
                        .ok());
        compare(dc, fp, "QKV split");
      }
      if (rows > 8) continue;
      DeviceCaches dc(pc, background, background, NanBits(t()));
      Fp8Pages fp(pc, zero_codes, zero_codes, ks, vs);
      DeviceBuffer dx = Upload(RandomHalves(t(), size_t(rows) * in, 64));
      QkvCacheArgs a;
      a.q_out = q[0].get();
      a.positions = dpos.as<int32_t>();
      a.slots = dseq.as<int32_t>();
      a.num_heads = heads;
      a.num_kv_heads = kv_heads;
      a.head_dim = hd;
      a.seq_capacity = cap;
      a.inv_freq = dfreq.as<float>();
      ASSERT_TRUE(GemvQkvCachePaged(t(), dx.get(), dw.get(), nullptr, dbias.get(), a, dc.pages,
                                    rows, in, nullptr)
                      .ok());
      a.q_out = q[1].get();
      ASSERT_TRUE(GemvQkvCachePaged(t(), dx.get(), dw.get(), nullptr, dbias.get(), a, fp.pages,
                                    rows, in, nullptr)
                      .ok());
      compare(dc, fp, "QKV GEMV");
    }
  }
}

// A sequence's FP8 pages to a KV block and back: the codes, position by position, unchanged.
TEST(KvPagesCopyTest, Fp8BlockCopyMovesTheCodes) {
  SKIP_WITHOUT_GPU();
  const int kv_heads = 3, hd = 100, cap = 256, seqs = 3, s = 2;
  for (int ps : {4, 32}) {
    for (int positions : {1, 37, 256}) {
      SCOPED_TRACE(testing::Message() << "page size " << ps << ", " << positions << " positions");
      const PagedCopy pc(seqs, kv_heads, hd, cap, ps, {0, 0, 0}, {cap - 1, cap - 1, cap - 1}, ps);
      const Fp8Cache k(DType::kF16, pc.ContiguousSize(), 70, 0.5f);
      const Fp8Cache v(DType::kF16, pc.ContiguousSize(), 71, 0.5f);
      Fp8Pages fp(pc, k.codes, v.codes, 0.5f, 0.5f);
      const size_t block_n = size_t(positions) * kv_heads * hd;
      std::vector<uint8_t> k_want(block_n), v_want(block_n);
      for (int p = 0; p < positions; ++p) {
        for (int h = 0; h < kv_heads; ++h) {
          for (int d = 0; d < hd; ++d) {
            const size_t b = (size_t(p) * kv_heads + h) * hd + d;
            k_want[b] = k.codes[pc.ContiguousAt(s, h, p) + d];
            v_want[b] = v.codes[pc.ContiguousAt(s, h, p) + d];
          }
        }
      }
      DeviceBuffer bk, bv;
      ASSERT_TRUE(bk.Allocate(block_n).ok());
      ASSERT_TRUE(bv.Allocate(block_n).ok());
      ASSERT_TRUE(LaunchKvBlockCopyPaged(fp.pages, s, bk.get(), bv.get(), positions, kv_heads, hd,
                                         /*to_block=*/true, nullptr)
                      .ok());
      EXPECT_EQ(DownloadBytes(bk, block_n), k_want);
      EXPECT_EQ(DownloadBytes(bv, block_n), v_want);
      // Back into sequence 0's pages: its positions then hold sequence s's codes.
      ASSERT_TRUE(LaunchKvBlockCopyPaged(fp.pages, 0, bk.get(), bv.get(), positions, kv_heads, hd,
                                         /*to_block=*/false, nullptr)
                      .ok());
      const auto pool = DownloadBytes(fp.k_pool, pc.PoolSize());
      int bad = 0;
      for (int p = 0; p < positions; ++p) {
        for (int h = 0; h < kv_heads; ++h) {
          for (int d = 0; d < hd; ++d) {
            bad += pool[pc.PoolAt(0, h, p) + d] != k.codes[pc.ContiguousAt(s, h, p) + d];
          }
        }
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

// The launch checks, which need no GPU: they fail before anything is enqueued.
TEST(KvPagesCheckTest, RejectsPagesTheKernelsCannotAddress) {
  alignas(16) static uint16_t pool[64];
  static const int32_t table[1] = {0};
  KvPages ok{pool, pool, 1, 16, table, 1};
  EXPECT_TRUE(CheckKvPages(ok, 128, "test").ok());
  for (int ps : {0, 2, 24, 48}) {
    KvPages p = ok;
    p.page_size = ps;
    const absl::Status s = CheckKvPages(p, 128, "test");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << ps;
    EXPECT_NE(s.message().find("power of two"), std::string::npos) << s;
  }
  KvPages no_table = ok;
  no_table.block_table = nullptr;
  EXPECT_FALSE(CheckKvPages(no_table, 128, "test").ok());
  KvPages unaligned = ok;
  unaligned.v = pool + 1;
  EXPECT_FALSE(CheckKvPages(unaligned, 128, "test").ok());
  KvPages no_stride = ok;
  no_stride.table_stride = 0;
  EXPECT_FALSE(CheckKvPages(no_stride, 128, "test").ok());
  EXPECT_FALSE(CheckKvPages(ok, 98, "test").ok()) << "head_dim not a multiple of 4";
  EXPECT_TRUE(CheckKvPages(ok, 100, "test").ok()) << "OpenLLaMA-3B's head_dim, a multiple of 4";
  // Decode attention takes head_dim % 8 != 0 in its register kernel's shapes only.
  EXPECT_TRUE(PagedDecodeAttentionTakes(100, 1));
  EXPECT_TRUE(PagedDecodeAttentionTakes(100, 8));
  EXPECT_FALSE(PagedDecodeAttentionTakes(100, 16));
  EXPECT_FALSE(PagedDecodeAttentionTakes(132, 1));
  EXPECT_TRUE(PagedDecodeAttentionTakes(256, 16));
  // FP8 codes: the register kernel's shapes.
  EXPECT_TRUE(Fp8PagedAttentionTakes(128, 8));
  EXPECT_TRUE(Fp8PagedAttentionTakes(100, 1));
  EXPECT_FALSE(Fp8PagedAttentionTakes(256, 1));
  EXPECT_FALSE(Fp8PagedAttentionTakes(128, 16));
  KvPages codes = ok;
  codes.fp8 = true;
  EXPECT_TRUE(CheckKvPages(codes, 128, "test").ok());
  for (float scale : {0.0f, -1.0f, INFINITY, NAN}) {
    KvPages bad_scale = codes;
    bad_scale.v_scale = scale;
    const absl::Status st = CheckKvPages(bad_scale, 128, "test");
    EXPECT_NE(st.message().find("FP8 KV scales"), std::string::npos) << scale << ": " << st;
  }
  const AttentionParams fp8_params{0.1f, 0};
  const absl::Status wide =
      LaunchAttentionPaged(DType::kF16, pool, codes, table, table, nullptr, pool, 1, 1, 1, 256, 1,
                           fp8_params, nullptr, reinterpret_cast<uint32_t*>(pool));
  EXPECT_NE(wide.message().find("FP8 codes"), std::string::npos) << wide;

  KvPages bad = ok;
  bad.page_size = 48;
  const AttentionParams params{0.1f, 0};
  const absl::Status attention =
      LaunchAttentionPaged(DType::kF16, pool, bad, table, table, nullptr, pool, 1, 1, 1, 128, 1,
                           params, nullptr, nullptr);
  EXPECT_NE(attention.message().find("page size 48"), std::string::npos) << attention;
  EXPECT_FALSE(LaunchPrefillAttentionPaged(DType::kF16, pool, bad, table, table, pool, 1, 1, 1, 128,
                                           params, nullptr)
                   .ok());
  EXPECT_FALSE(LaunchQkvRopeCachePaged(DType::kF16, pool, nullptr, pool, bad, table, table, 1, 1, 1,
                                       128, nullptr, nullptr)
                   .ok());
  EXPECT_FALSE(
      LaunchKvBlockCopyPaged(bad, 0, pool, pool, 1, 1, 128, /*to_block=*/true, nullptr).ok());
  KvPages short_table = ok;
  EXPECT_FALSE(
      LaunchKvBlockCopyPaged(short_table, 0, pool, pool, 17, 1, 128, /*to_block=*/true, nullptr)
          .ok())
      << "17 positions exceed one page of 16";
}

}  // namespace
}  // namespace tandem::cuda
