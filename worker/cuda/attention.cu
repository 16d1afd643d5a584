// Causal attention over the KV-cache, for prefill and decode alike: each row (one query token)
// attends to keys [0, position] of its slot. Grouped-query heads share one block per kv head, and
// the keys are split over `splits` blocks (flash-decoding), whose partial softmax states the last
// block of each (row, kv head) combines. Cache layout (slots, kv_heads, seq_capacity, head_dim): a
// head's keys are one contiguous run. The paged cache (kv_pages.h) takes the same kernels with each
// key found through the block table (kv_view.cuh).
//
// Two kernels. Where head_dim is at most 128 and a multiple of 4, and a kv head serves at most 8
// query heads (every preset), AttentionLanesKernel keeps everything in registers: a group of 8,
// 16 or 32 lanes holds one key's K and V (8 or 4 elements per lane), the block's lane groups take
// interleaved keys several at a time, and their softmax states meet in shared memory once at the
// end. Otherwise AttentionPartialKernel stages 64-key tiles of K and V in shared memory, which
// costs it shared-memory bandwidth: it reads the cache at ~1.1 TB/s at long contexts.
#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/device_util.cuh"
#include "worker/cuda/kernels.h"
#include "worker/cuda/kv_pages.h"
#include "worker/cuda/kv_view.cuh"

namespace tandem::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kTile = 64;  // keys per shared-memory tile; split boundaries are multiples of it
constexpr int kMaxOut = kMaxAttentionGroupWidth / kThreads;  // accumulators per thread
// 16-byte loads of K and of V in flight per thread: many where the grid is small (decode at small
// batches, where each block waits out the memory latency of its tiles); otherwise the plain loop
// (batch 64 decode was 10% slower and prefill 3-10% with these batches).
constexpr int kLoadBatchFew = 8;
// Pages a 64-key tile spans at most: tiles start on multiples of kTile, so pages of
// kMinKvPageSize or more hold whole tiles' parts.
constexpr int kTilePages = kTile / kMinKvPageSize;
constexpr int kMaxRowsForLoadBatch = 8;

// Shared-memory row stride (elements) of a K/V tile: head_dim padded so that threads reading
// consecutive rows with 4-byte (2-element) loads fall in distinct banks (stride / 2 odd).
__host__ __device__ inline int TileStride(int head_dim) {
  return (head_dim / 2) % 2 == 0 ? head_dim + 2 : head_dim;
}

// Output element d of head h, row r, from the partial states of its `splits` splits (in split
// order, so that the result does not depend on which block computes it). L2 loads: the partials
// may have been written by other blocks of the running kernel.
__device__ __forceinline__ float CombineSplits(const float* part_acc, const float2* part_ml, int r,
                                               int h, int d, int num_heads, int head_dim,
                                               int splits) {
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) {
    m = fmaxf(m, __ldcg(&part_ml[(static_cast<size_t>(r) * splits + s) * num_heads + h]).x);
  }
  float num = 0.0f, den = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const size_t idx = (static_cast<size_t>(r) * splits + s) * num_heads + h;
    const float2 ml = __ldcg(&part_ml[idx]);
    if (ml.x == -INFINITY) continue;  // an empty split wrote no accumulators
    const float w = __expf(ml.x - m);
    num += w * __ldcg(&part_acc[idx * head_dim + d]);
    den += w * ml.y;
  }
  return num / den;
}

// After a block has written its partials: counts it for (r, kvh); the last of the `splits` blocks
// writes the combined output of the group's heads and resets the counter for the next launch.
template <typename T>
__device__ void FinishSplits(const float* part_acc, const float2* part_ml, T* out,
                             uint32_t* counters, int r, int kvh, int num_heads, int num_kv_heads,
                             int head_dim, int splits) {
  __shared__ bool last;
  __threadfence();  // this block's partials are visible before it is counted
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t* c = counters + static_cast<size_t>(r) * num_kv_heads + kvh;
    last = atomicAdd(c, 1u) == static_cast<uint32_t>(splits - 1);
    if (last) *c = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();  // the other blocks' partials are read after their count
  const int group = num_heads / num_kv_heads, width = group * head_dim;
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    const int h = kvh * group + i / head_dim, d = i % head_dim;
    out[(static_cast<size_t>(r) * num_heads + h) * head_dim + d] =
        FromF<T>(CombineSplits(part_acc, part_ml, r, h, d, num_heads, head_dim, splits));
  }
}

// The keys of one split of a row whose context is ctx positions: keys [lo, ctx) are visible
// (window > 0: the last `window`); the splits cover them from the 64-key tile that holds lo, each
// a whole number of tiles, so that tiles stay aligned. [begin, end) may start before lo (in the
// first split) and is empty for a split past the context.
struct SplitKeys {
  int lo, begin, end;
};
__device__ __forceinline__ SplitKeys SplitKeysOf(int ctx, int window, int split, int splits) {
  const int lo = window > 0 ? max(0, ctx - window) : 0;
  const int first = lo / kTile * kTile;
  int chunk = (ctx - first + splits - 1) / splits;
  chunk = (chunk + kTile - 1) / kTile * kTile;
  const int begin = first + split * chunk;
  return {lo, begin, min(ctx, begin + chunk)};
}

// A split with no keys: its heads' partial states empty (no accumulators written), counted as
// any other split's (FinishSplits).
template <typename T>
__device__ void FinishEmptySplit(const float* part_acc, float2* part_ml, T* out, uint32_t* counters,
                                 int r, int kvh, int num_heads, int num_kv_heads, int head_dim,
                                 int splits, size_t part_row) {
  const int group = num_heads / num_kv_heads;
  for (int g = threadIdx.x; g < group; g += blockDim.x) part_ml[part_row + g] = {-INFINITY, 0.0f};
  FinishSplits(part_acc, part_ml, out, counters, r, kvh, num_heads, num_kv_heads, head_dim, splits);
}

// grid (num_kv_heads, rows, splits). partials per (row, split, head): head_dim accumulators, then
// in a separate array (max, sum).
//
// With one split the block divides by its own sum into `out` and no partials are written;
// otherwise every block publishes its partials, counts itself in counters[r * num_kv_heads + kvh]
// (zero on entry; the last block resets it), and the last block of a (row, kv head) combines the
// splits into `out`.
template <typename T, int kLoadBatch, typename Kv>
__global__ void __launch_bounds__(kThreads)
    AttentionPartialKernel(const T* __restrict__ q, const T* __restrict__ k_cache,
                           const T* __restrict__ v_cache, const int32_t* __restrict__ positions,
                           const int32_t* __restrict__ slots, float* __restrict__ part_acc,
                           float2* __restrict__ part_ml, T* __restrict__ out,
                           uint32_t* __restrict__ counters, int num_heads, int num_kv_heads,
                           int head_dim, Kv kv, float scale, int window) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  AllowDependentLaunch();  // the out-projection may start prefetching its weights
  const int kvh = blockIdx.x, r = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int group = num_heads / num_kv_heads;
  const int width = group * head_dim;  // outputs of this block
  // Only the first tile of the first split holds keys to mask (those before lo).
  const SplitKeys keys = SplitKeysOf(positions[r] + 1, window, split, splits);
  const int lo = keys.lo, begin = keys.begin, end = keys.end;
  WaitForPrerequisites();  // q and this row's cache entry come from the previous kernel

  const size_t part_row = (static_cast<size_t>(r) * splits + split) * num_heads + kvh * group;
  if (begin >= end) {
    FinishEmptySplit(part_acc, part_ml, out, counters, r, kvh, num_heads, num_kv_heads, head_dim,
                     splits, part_row);
    return;
  }

  const int stride = TileStride(head_dim);
  float* q_s = reinterpret_cast<float*>(smem_raw);  // (group, head_dim)
  float* p_s = q_s + width;                         // (group, kTile)
  float* m_s = p_s + group * kTile;                 // (group) running max
  float* l_s = m_s + group;                         // (group) running sum
  float* c_s = l_s + group;                         // (group) rescale of this tile
  T* k_s = reinterpret_cast<T*>(c_s + group + (4 - (3 * group) % 4) % 4);  // (kTile, stride)
  T* v_s = k_s + kTile * stride;

  const T* qr = q + static_cast<size_t>(r) * num_heads * head_dim + kvh * width;
  for (int i = threadIdx.x; i < width; i += blockDim.x) q_s[i] = ToF(qr[i]) * scale;
  for (int g = threadIdx.x; g < group; g += blockDim.x) {
    m_s[g] = -INFINITY;
    l_s[g] = 0.0f;
  }
  const int seq = slots[r];
  const size_t head_base = Kv::kPaged ? 0 : kv.Offset(seq, kvh, 0);
  const T* kh = k_cache + head_base;
  const T* vh = v_cache + head_base;
  // Paged: the page ids of a tile's keys, read from the table once per tile into shared memory
  // (page_s[buf], indexed from the tile's first page) rather than once per 16-byte load, and one
  // tile ahead, so that the table's latency hides behind the tile before.
  int* page_s = reinterpret_cast<int*>(v_s + kTile * stride);  // (2, kTilePages)
  // The table entry this thread reads for tile t0 (its entries of keys [max(t0, lo), end)), or
  // -1; its index in the tile's pages goes to `at`.
  auto tile_page = [&](int t0, int& at) -> int {
    at = -1;
    if constexpr (Kv::kPaged) {
      if (t0 >= end) return -1;
      const int last = min(t0 + kTile, end) - 1;
      const int i = (max(t0, lo) >> kv.page_shift) + static_cast<int>(threadIdx.x);
      if (i > (last >> kv.page_shift)) return -1;
      at = i - (t0 >> kv.page_shift);
      return __ldg(kv.table + static_cast<size_t>(seq) * kv.table_stride + i);
    }
    return -1;
  };
  if constexpr (Kv::kPaged) {
    int at;
    const int page = tile_page(begin, at);
    if (at >= 0) page_s[at] = page;
    __syncthreads();
  }
  // The 16-byte vectors vi of a tile's K and V: one contiguous run from the slot's head; in pages,
  // the vector's key (head_dim % 8 == 0: a vector is part of one key) found through the tile's
  // page ids, keys before the window (masked below) read as the window's first so that pages out
  // of the window need not be in the table.
  int buf = 0;
  auto load_kv = [&](int t0, int vi, Vec8<T>& kv8, Vec8<T>& vv8) {
    if constexpr (Kv::kPaged) {
      const int flat = vi * 8, row = flat / head_dim;
      const int pos = max(t0 + row, lo);
      const int page = page_s[buf * kTilePages + (pos >> kv.page_shift) - (t0 >> kv.page_shift)];
      const size_t at = kv.InPage(page, kvh, pos) + (flat - row * head_dim);
      kv8 = *reinterpret_cast<const Vec8<T>*>(k_cache + at);
      vv8 = *reinterpret_cast<const Vec8<T>*>(v_cache + at);
    } else {
      kv8 = reinterpret_cast<const Vec8<T>*>(kh + static_cast<size_t>(t0) * head_dim)[vi];
      vv8 = reinterpret_cast<const Vec8<T>*>(vh + static_cast<size_t>(t0) * head_dim)[vi];
    }
  };

  float acc[kMaxOut];
#pragma unroll
  for (int k = 0; k < kMaxOut; ++k) acc[k] = 0.0f;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int t0 = begin; t0 < end; t0 += kTile) {
    const int n = min(kTile, end - t0);
    // K and V tiles: n * head_dim contiguous elements each, 8 per 16-byte load (t0 * head_dim is
    // a multiple of 8 because t0 is a multiple of kTile).
    const int total = n * head_dim, nvec = total / 8;
    int next_at;
    const int next_page = tile_page(t0 + kTile, next_at);  // in flight during this tile's loads
    if constexpr (kLoadBatch > 1) {
      // kLoadBatch loads of each in flight per thread before any is stored, so that a tile costs
      // one memory latency, not one per load.
      for (int v0 = threadIdx.x; v0 < nvec; v0 += kLoadBatch * kThreads) {
        Vec8<T> kv[kLoadBatch], vv[kLoadBatch];
#pragma unroll
        for (int b = 0; b < kLoadBatch; ++b) {
          const int vi = v0 + b * kThreads;
          if (vi < nvec) load_kv(t0, vi, kv[b], vv[b]);
        }
#pragma unroll
        for (int b = 0; b < kLoadBatch; ++b) {
          const int vi = v0 + b * kThreads;
          if (vi < nvec) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              const int flat = vi * 8 + e, row = flat / head_dim, col = flat % head_dim;
              k_s[row * stride + col] = kv[b].v[e];
              v_s[row * stride + col] = vv[b].v[e];
            }
          }
        }
      }
    } else {
      for (int vi = threadIdx.x; vi < nvec; vi += blockDim.x) {
        Vec8<T> k8, v8;
        load_kv(t0, vi, k8, v8);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int flat = vi * 8 + e, row = flat / head_dim, col = flat % head_dim;
          k_s[row * stride + col] = k8.v[e];
          v_s[row * stride + col] = v8.v[e];
        }
      }
    }
    // Only where head_dim % 8 != 0, which pages take through AttentionLanesKernel only.
    for (int flat = nvec * 8 + threadIdx.x; !Kv::kPaged && flat < total; flat += blockDim.x) {
      const int row = flat / head_dim, col = flat % head_dim;
      k_s[row * stride + col] = kh[static_cast<size_t>(t0) * head_dim + flat];
      v_s[row * stride + col] = vh[static_cast<size_t>(t0) * head_dim + flat];
    }
    // The next tile's page ids: nothing reads page_s[buf ^ 1] before the syncs below.
    if (next_at >= 0) page_s[(buf ^ 1) * kTilePages + next_at] = next_page;
    __syncthreads();
    // Scores: one (head, key) pair per thread.
    for (int pi = threadIdx.x; pi < group * n; pi += blockDim.x) {
      const int g = pi / n, j = pi % n;
      const float* qg = q_s + g * head_dim;
      const T* kr = k_s + j * stride;
      float s = 0.0f;
      for (int d = 0; d < head_dim; d += 2) {
        s += qg[d] * ToF(kr[d]) + qg[d + 1] * ToF(kr[d + 1]);
      }
      p_s[g * kTile + j] = t0 + j < lo ? -INFINITY : s;  // before the window
    }
    __syncthreads();
    // Online softmax per head: one warp per head.
    for (int g = warp; g < group; g += nwarps) {
      float mx = -INFINITY;
      for (int j = lane; j < n; j += 32) mx = fmaxf(mx, p_s[g * kTile + j]);
      mx = WarpMax(mx);
      const float m_new = fmaxf(m_s[g], mx);
      float sum = 0.0f;
      for (int j = lane; j < n; j += 32) {
        const float e = __expf(p_s[g * kTile + j] - m_new);
        p_s[g * kTile + j] = e;
        sum += e;
      }
      sum = WarpSum(sum);
      if (lane == 0) {
        const float corr = __expf(m_s[g] - m_new);  // 0 on the first tile (m = -inf)
        l_s[g] = l_s[g] * corr + sum;
        m_s[g] = m_new;
        c_s[g] = corr;
      }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kMaxOut; ++k) {
      const int o = threadIdx.x + k * kThreads;
      if (o < width) {
        const int g = o / head_dim, d = o % head_dim;
        const float* pg = p_s + g * kTile;
        float a = acc[k] * c_s[g];
        for (int j = 0; j < n; ++j) a += pg[j] * ToF(v_s[j * stride + d]);
        acc[k] = a;
      }
    }
    buf ^= 1;
    __syncthreads();
  }
  if (splits == 1) {
    // The combine of a single split: its accumulators over its own sum.
    T* o = out + static_cast<size_t>(r) * num_heads * head_dim + kvh * width;
#pragma unroll
    for (int k = 0; k < kMaxOut; ++k) {
      const int i = threadIdx.x + k * kThreads;
      if (i < width) o[i] = FromF<T>(acc[k] / l_s[i / head_dim]);
    }
    return;
  }
  float* pa = part_acc + part_row * head_dim;
#pragma unroll
  for (int k = 0; k < kMaxOut; ++k) {
    const int o = threadIdx.x + k * kThreads;
    if (o < width) pa[o] = acc[k];
  }
  for (int g = threadIdx.x; g < group; g += blockDim.x) part_ml[part_row + g] = {m_s[g], l_s[g]};
  FinishSplits(part_acc, part_ml, out, counters, r, kvh, num_heads, num_kv_heads, head_dim, splits);
}

// Keys in flight per lane group and iteration of AttentionLanesKernel: fewer for the widest
// groups, whose query and accumulators take twice the registers.
template <int kGroup>
inline constexpr int kLanesUnroll = kGroup >= 8 ? 2 : 4;
// Blocks of AttentionLanesKernel resident per SM at least (so at most 128 registers a thread, 255
// for the widest groups): at batch 64 of the 8B shape its 512 blocks then run in one wave on an
// H100's or H200's 132 SMs, not in two.
template <int kGroup>
inline constexpr int kLanesBlocksPerSm = kGroup >= 8 ? 2 : 4;

// kVec elements of the cache in one load: of a 2-byte type (8 or 16 bytes), or FP8 codes (4 or 8).
template <typename C, int kVec>
struct alignas(kVec * sizeof(C)) KeyVec {
  C v[kVec];
};

template <typename C>
inline constexpr bool kCodes = std::is_same_v<C, __nv_fp8_e4m3>;

// FP8 codes as 32-bit words (4 codes each, element i in byte i % 4 of word i / 4), so that a
// vector takes kVec / 4 registers rather than a register per code.
template <int kVec>
struct alignas(kVec) KeyVec<__nv_fp8_e4m3, kVec> {
  static_assert(kVec % 4 == 0, "whole words of codes");
  uint32_t w[kVec / 4];
};

// A vector of zeros (keys past the end).
template <typename C, int kVec>
__device__ __forceinline__ KeyVec<C, kVec> ZeroKeys() {
  KeyVec<C, kVec> v;
  if constexpr (kCodes<C>) {
#pragma unroll
    for (int i = 0; i < kVec / 4; ++i) v.w[i] = 0;
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) v.v[e] = FromF<C>(0.0f);
  }
  return v;
}

// Elements e and e + 1 of a vector as floats (FP8 codes through fp16, exact).
template <typename C, int kVec>
__device__ __forceinline__ float2 PairToF(const KeyVec<C, kVec>& v, int e) {
  if constexpr (kCodes<C>) {
    return Fp8PairToFloat2(v.w[e / 4] >> (8 * (e % 4)));
  } else {
    return make_float2(ToF(v.v[e]), ToF(v.v[e + 1]));
  }
}

// A vector's elements as floats.
template <typename C, int kVec>
__device__ __forceinline__ void KeysToF(const KeyVec<C, kVec>& v, float (&f)[kVec]) {
#pragma unroll
  for (int e = 0; e < kVec; e += 2) {
    const float2 p = PairToF(v, e);
    f[e] = p.x;
    f[e + 1] = p.y;
  }
}

// grid (num_kv_heads, rows, splits), kThreads threads, as AttentionPartialKernel and with the same
// partials, for head_dim <= kLanes * kVec (a multiple of kVec) and group <= kGroup query heads
// per kv head (the heads past group are computed on zeros and never stored). Lane group lg
// (kLanes lanes, kVec dimensions each; lanes past head_dim idle) takes kUnroll consecutive keys
// per iteration, from k0 + lg * kUnroll (the block's iteration covers kStep keys from k0), their K
// and V loads issued together and found from one address (one page). A group keeps a running
// (max, sum, accumulators) per head; its score of a key is its lanes' partial dots summed by
// shuffles, so every lane of a group holds the same softmax state.
//
// C: the cache's element type, T or FP8 codes (__nv_fp8_e4m3, pages only): the query is multiplied
// by the layer's K scale with the softmax scale, and the output by its V scale.
template <typename T, typename C, int kLanes, int kVec, int kGroup, typename Kv>
__global__ void __launch_bounds__(kThreads, kLanesBlocksPerSm<kGroup>)
    AttentionLanesKernel(const T* __restrict__ q, const C* __restrict__ k_cache,
                         const C* __restrict__ v_cache, const int32_t* __restrict__ positions,
                         const int32_t* __restrict__ slots, float* __restrict__ part_acc,
                         float2* __restrict__ part_ml, T* __restrict__ out,
                         uint32_t* __restrict__ counters, int num_heads, int num_kv_heads,
                         int head_dim, Kv kv, float scale, int window) {
  using Vec = KeyVec<C, kVec>;
  const int group = num_heads / num_kv_heads;
  constexpr int kDims = kLanes * kVec;  // head_dim at most
  constexpr int kLaneGroups = kThreads / kLanes, kUnroll = kLanesUnroll<kGroup>;
  constexpr int kStep = kLaneGroups * kUnroll;
  __shared__ __align__(16) float acc_s[kLaneGroups][kGroup * kDims];
  __shared__ float2 ml_s[kLaneGroups][kGroup];
  AllowDependentLaunch();  // the out-projection may start prefetching its weights
  const int kvh = blockIdx.x, r = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  // AttentionPartialKernel's splits, each begun at lo at the earliest: keys before the window are
  // never read.
  const SplitKeys keys = SplitKeysOf(positions[r] + 1, window, split, splits);
  const int begin = max(keys.lo, keys.begin), end = keys.end;
  WaitForPrerequisites();  // q and this row's cache entry come from the previous kernel

  const size_t part_row = (static_cast<size_t>(r) * splits + split) * num_heads + kvh * group;
  if (begin >= end) {
    FinishEmptySplit(part_acc, part_ml, out, counters, r, kvh, num_heads, num_kv_heads, head_dim,
                     splits, part_row);
    return;
  }
  const int lg = threadIdx.x / kLanes, li = threadIdx.x % kLanes;
  const bool lane_on = li * kVec < head_dim;
  const T* qr = q + static_cast<size_t>(r) * num_heads * head_dim + kvh * group * head_dim;
  float qf[kGroup][kVec];
  const float q_scale = scale * kv.KScale();
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    KeyVec<T, kVec> v;
    if (lane_on && g < group) {
      v = reinterpret_cast<const KeyVec<T, kVec>*>(qr + g * head_dim)[li];
    } else {
      v = ZeroKeys<T, kVec>();
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) qf[g][e] = ToF(v.v[e]) * q_scale;
  }
  float m[kGroup], l[kGroup], acc[kGroup][kVec];
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[g][e] = 0.0f;
  }
  const int seq = slots[r];
  const size_t head_base = Kv::kPaged ? 0 : kv.Offset(seq, kvh, 0);
  // Paged: the table entries of an iteration's keys [k0, k0 + kStep), one per lane of each warp
  // (entry (k0 >> page_shift) + lane; kStep / kMinKvPageSize + 1 <= 32 of them), read one
  // iteration ahead so that their latency hides behind the K and V loads; a key's page is then a
  // shuffle from the lane that read it. Entries past the end are not read.
  static_assert(kStep / kMinKvPageSize + 1 <= 32, "an iteration's pages fit a warp");
  const int lane = threadIdx.x & 31;
  auto read_pages = [&](int k0) -> int {
    if constexpr (Kv::kPaged) {
      const int first_page = k0 >> kv.page_shift;
      const int last_page = (min(k0 + kStep, end) - 1) >> kv.page_shift;
      if (k0 < end && first_page + lane <= last_page) {
        return __ldg(kv.table + static_cast<size_t>(seq) * kv.table_stride + first_page + lane);
      }
    }
    return 0;
  };
  // Iterations from the kUnroll-aligned key at or before begin: a group's kUnroll keys then lie in
  // one page (kUnroll divides every page size) and the page of the first is that of all; keys
  // before begin are masked, never read.
  static_assert(kMinKvPageSize % kUnroll == 0, "a group's keys of an iteration share a page");
  const int kb = begin & ~(kUnroll - 1);
  auto valid = [&](int pos) { return pos >= begin && pos < end; };
  // The K and V vectors of the iteration at k0 into kk and vv (pages: the table entries of that
  // iteration in `pages`); keys outside [begin, end) are zeros, not read.
  auto load = [&](int k0, int pages, Vec(&kk)[kUnroll], Vec(&vv)[kUnroll]) {
    const int pos0 = k0 + lg * kUnroll;
    size_t at0;
    if constexpr (Kv::kPaged) {
      const int page =
          __shfl_sync(0xffffffffu, pages, min((pos0 >> kv.page_shift) - (k0 >> kv.page_shift), 31));
      at0 = kv.InPage(page, kvh, pos0);
    } else {
      at0 = head_base + static_cast<size_t>(pos0) * head_dim;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (valid(pos0 + u) && lane_on) {
        const size_t at = at0 + static_cast<size_t>(u) * head_dim;
        kk[u] = reinterpret_cast<const Vec*>(k_cache + at)[li];
        vv[u] = reinterpret_cast<const Vec*>(v_cache + at)[li];
      } else {
        kk[u] = vv[u] = ZeroKeys<C, kVec>();
      }
    }
  };
  // FP8 codes are loaded one iteration ahead: their vectors take half the registers of fp16's, and
  // half the bytes would otherwise be in flight per iteration. Measured on an H200 (batch 64,
  // 8,192 positions, tandem-paged-attention-bench): groups of 8 1,844 -> 1,454 µs, 1 and 2 within
  // the run-to-run noise; not for groups of 4, whose kernel is at its 128 registers already (the
  // second iteration's codes spilled).
  constexpr bool kAhead = kCodes<C> && kGroup != 4;
  // The next iteration's K and V vectors where they are loaded ahead; nothing otherwise.
  struct NotAhead {};
  using AheadVecs = std::conditional_t<kAhead, Vec[kUnroll], NotAhead>;
  AheadVecs next_k, next_v;
  int pages_now = read_pages(kb);
  if constexpr (kAhead) {
    load(kb, pages_now, next_k, next_v);
    pages_now = read_pages(kb + kStep);
  }
  for (int k0 = kb; k0 < end; k0 += kStep) {
    const int pos0 = k0 + lg * kUnroll;
    Vec kk[kUnroll], vv[kUnroll];
    if constexpr (kAhead) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        kk[u] = next_k[u];
        vv[u] = next_v[u];
      }
      load(k0 + kStep, pages_now, next_k, next_v);
    } else {
      load(k0, pages_now, kk, vv);
    }
    pages_now = read_pages(k0 + (kAhead ? 2 : 1) * kStep);
    // Scores: this lane's kVec dimensions, then the group's sum (every lane of the warp shuffles,
    // whichever keys are past the end).
    float s[kGroup][kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float kf[kVec];
      KeysToF(kk[u], kf);
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < kVec; ++e) d += qf[g][e] * kf[e];
        s[g][u] = d;
      }
    }
#pragma unroll
    for (int o = kLanes / 2; o > 0; o >>= 1) {
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) s[g][u] += __shfl_xor_sync(0xffffffffu, s[g][u], o);
      }
    }
    // Online softmax over this iteration's keys of the group, one rescale per iteration.
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (valid(pos0 + u)) mx = fmaxf(mx, s[g][u]);
      }
      if (mx == -INFINITY) continue;         // no key of this group yet
      const float corr = __expf(m[g] - mx);  // 0 while m is -inf
      m[g] = mx;
      float p[kUnroll], sum = 0.0f;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        p[u] = valid(pos0 + u) ? __expf(s[g][u] - mx) : 0.0f;
        sum += p[u];
      }
      l[g] = l[g] * corr + sum;
#pragma unroll
      for (int e = 0; e < kVec; e += 2) {
        float a0 = acc[g][e] * corr, a1 = acc[g][e + 1] * corr;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const float2 v2 = PairToF(vv[u], e);
          a0 += p[u] * v2.x;
          a1 += p[u] * v2.y;
        }
        acc[g][e] = a0;
        acc[g][e + 1] = a1;
      }
    }
  }
  // The lane groups' states combined: out = sum_lg e^(m_lg - M) acc_lg / sum_lg e^(m_lg - M) l_lg.
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    float4* dst = reinterpret_cast<float4*>(&acc_s[lg][g * kDims + li * kVec]);
#pragma unroll
    for (int e = 0; e < kVec; e += 4) {
      dst[e / 4] = make_float4(acc[g][e], acc[g][e + 1], acc[g][e + 2], acc[g][e + 3]);
    }
    if (li == 0) ml_s[lg][g] = {m[g], l[g]};
  }
  __syncthreads();
  const int width = group * head_dim;
  T* o_row = out + static_cast<size_t>(r) * num_heads * head_dim + kvh * width;
  float* pa = part_acc + part_row * head_dim;
  for (int o = threadIdx.x; o < width; o += kThreads) {
    const int g = o / head_dim, d = o - g * head_dim;
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kLaneGroups; ++j) mx = fmaxf(mx, ml_s[j][g].x);
    float num = 0.0f, den = 0.0f;
#pragma unroll
    for (int j = 0; j < kLaneGroups; ++j) {
      const float2 ml = ml_s[j][g];
      if (ml.x == -INFINITY) continue;  // a group that saw no key
      const float w = __expf(ml.x - mx);
      num += w * acc_s[j][g * kDims + d];
      den += w * ml.y;
    }
    if constexpr (kCodes<C>) num *= kv.VScale();
    if (splits == 1) {
      o_row[o] = FromF<T>(num / den);
    } else {
      pa[o] = num;
      if (d == 0) part_ml[part_row + g] = {mx, den};
    }
  }
  if (splits == 1) return;
  FinishSplits(part_acc, part_ml, out, counters, r, kvh, num_heads, num_kv_heads, head_dim, splits);
}

size_t PartialAccFloats(int rows, int num_heads, int head_dim, int splits) {
  return static_cast<size_t>(rows) * splits * num_heads * head_dim;
}

}  // namespace

int AttentionSplits(int rows, int num_kv_heads, int max_context, int sm_count) {
  const int64_t blocks = std::max<int64_t>(1, static_cast<int64_t>(rows) * num_kv_heads);
  const int64_t fill = (2 * static_cast<int64_t>(sm_count) + blocks - 1) / blocks;
  const int64_t most = std::min<int64_t>({fill, kMaxAttentionSplits, max_context / kTile});
  return static_cast<int>(std::max<int64_t>(1, most));
}

bool AttentionLanesKernelTakes(int head_dim, int group) {
  // Lane groups of 8, 16 or 32 lanes hold up to 128 dimensions in vectors of 8 (or 4) elements;
  // the kernel is built for groups of 1, 2, 4 and 8.
  return head_dim > 0 && head_dim <= 128 && head_dim % 4 == 0 && group >= 1 && group <= 8;
}

size_t AttentionPartialFloats(int rows, int num_heads, int head_dim, int splits) {
  return static_cast<size_t>(rows) * splits * num_heads * (head_dim + 2);
}

namespace {

template <typename T, typename C, int kLanes, int kVec, typename Kv>
absl::Status LaunchLanesOf(const void* q, const void* k_cache, const void* v_cache,
                           const int32_t* positions, const int32_t* slots, float* part_acc,
                           float2* part_ml, void* out, int num_heads, int num_kv_heads,
                           int head_dim, Kv kv, const AttentionParams& params, dim3 grid,
                           cudaStream_t stream, uint32_t* counters, bool pdl) {
  auto launch = [&](auto kernel) {
    return LaunchKernel(kernel, grid, dim3(kThreads), 0, stream, pdl, static_cast<const T*>(q),
                        static_cast<const C*>(k_cache), static_cast<const C*>(v_cache), positions,
                        slots, part_acc, part_ml, static_cast<T*>(out), counters, num_heads,
                        num_kv_heads, head_dim, kv, params.scale, params.window);
  };
  // Built for groups of 1, 2, 4 and 8; 3 runs as 4, 5 to 7 as 8.
  const int group = num_heads / num_kv_heads;
  if (group == 1) {
    CUDA_CHECK(launch(AttentionLanesKernel<T, C, kLanes, kVec, 1, Kv>));
  } else if (group == 2) {
    CUDA_CHECK(launch(AttentionLanesKernel<T, C, kLanes, kVec, 2, Kv>));
  } else if (group <= 4) {
    CUDA_CHECK(launch(AttentionLanesKernel<T, C, kLanes, kVec, 4, Kv>));
  } else {
    CUDA_CHECK(launch(AttentionLanesKernel<T, C, kLanes, kVec, 8, Kv>));
  }
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

// AttentionLanesKernel for a shape AttentionLanesKernelTakes: the fewest lanes per key that hold
// head_dim, with 16-byte loads where head_dim % 8 == 0.
template <typename T, typename C, typename Kv>
absl::Status LaunchLanes(const void* q, const void* k_cache, const void* v_cache,
                         const int32_t* positions, const int32_t* slots, float* part_acc,
                         float2* part_ml, void* out, int num_heads, int num_kv_heads, int head_dim,
                         Kv kv, const AttentionParams& params, dim3 grid, cudaStream_t stream,
                         uint32_t* counters, bool pdl) {
  if (head_dim % 8 == 0 && head_dim <= 64) {
    return LaunchLanesOf<T, C, 8, 8>(q, k_cache, v_cache, positions, slots, part_acc, part_ml, out,
                                     num_heads, num_kv_heads, head_dim, kv, params, grid, stream,
                                     counters, pdl);
  }
  if (head_dim % 8 == 0) {
    return LaunchLanesOf<T, C, 16, 8>(q, k_cache, v_cache, positions, slots, part_acc, part_ml, out,
                                      num_heads, num_kv_heads, head_dim, kv, params, grid, stream,
                                      counters, pdl);
  }
  return LaunchLanesOf<T, C, 32, 4>(q, k_cache, v_cache, positions, slots, part_acc, part_ml, out,
                                    num_heads, num_kv_heads, head_dim, kv, params, grid, stream,
                                    counters, pdl);
}

template <typename Kv>
absl::Status Launch(DType dtype, const void* q, const void* k_cache, const void* v_cache,
                    const int32_t* positions, const int32_t* slots, float* partials, void* out,
                    int rows, int num_heads, int num_kv_heads, int head_dim, Kv kv, int splits,
                    const AttentionParams& params, cudaStream_t stream, uint32_t* counters,
                    bool pdl) {
  float* part_acc = partials;
  float2* part_ml =
      reinterpret_cast<float2*>(partials + PartialAccFloats(rows, num_heads, head_dim, splits));
  const int group = num_heads / num_kv_heads;
  const size_t smem = (group * head_dim + group * kTile + 3 * group + 4) * sizeof(float) +
                      2 * kTile * TileStride(head_dim) * 2 + 2 * kTilePages * sizeof(int);
  dim3 grid(num_kv_heads, rows, splits);
  if constexpr (Kv::kPaged) {
    if (kv.fp8) {
      // FP8 codes: the register kernel only (LaunchAttentionPaged checked the shape).
      TANDEM_DISPATCH_HALF(dtype, {
        RETURN_IF_ERROR((LaunchLanes<T, __nv_fp8_e4m3>(
            q, k_cache, v_cache, positions, slots, part_acc, part_ml, out, num_heads, num_kv_heads,
            head_dim, kv, params, grid, stream, counters, pdl)));
      });
      return absl::OkStatus();
    }
  }
  if (AttentionLanesKernelTakes(head_dim, group)) {
    TANDEM_DISPATCH_HALF(dtype, {
      RETURN_IF_ERROR((LaunchLanes<T, T>(q, k_cache, v_cache, positions, slots, part_acc, part_ml,
                                         out, num_heads, num_kv_heads, head_dim, kv, params, grid,
                                         stream, counters, pdl)));
    });
    return absl::OkStatus();
  }
  TANDEM_DISPATCH_HALF(dtype, {
    auto* kernel = rows <= kMaxRowsForLoadBatch ? AttentionPartialKernel<T, kLoadBatchFew, Kv>
                                                : AttentionPartialKernel<T, 1, Kv>;
    if (smem > 48 * 1024) {
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
    }
    CUDA_CHECK(LaunchKernel(kernel, grid, dim3(kThreads), smem, stream, pdl,
                            static_cast<const T*>(q), static_cast<const T*>(k_cache),
                            static_cast<const T*>(v_cache), positions, slots, part_acc, part_ml,
                            static_cast<T*>(out), counters, num_heads, num_kv_heads, head_dim, kv,
                            params.scale, params.window));
  });
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

// The checks both layouts share; `capacity` is the slot's capacity, or 0 for pages.
absl::Status CheckAttention(int num_heads, int num_kv_heads, int head_dim, int capacity, int splits,
                            const AttentionParams& params, const uint32_t* counters) {
  const int group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
  if (group < 1 || group * num_kv_heads != num_heads ||
      group * head_dim > kMaxAttentionGroupWidth || head_dim % 2 != 0 ||
      capacity % kKvSeqAlign != 0 || splits < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention: unsupported shape (heads ", num_heads, " a multiple of kv heads ",
                     num_kv_heads, "; heads per kv head ", group, " x head_dim ", head_dim,
                     " must be <= ", kMaxAttentionGroupWidth, ", head_dim even, seq capacity ",
                     capacity, " a multiple of ", kKvSeqAlign, ", splits ", splits, " >= 1)"));
  }
  if (params.window < 0 || !(params.scale > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("attention: window ", params.window,
                                                   " must be >= 0 and scale ", params.scale,
                                                   " positive"));
  }
  if (counters == nullptr) {
    return absl::InvalidArgumentError(
        "attention: counters is null; pass rows * num_kv_heads zeroed uint32 counters (the "
        "kernel leaves them zero for the next launch)");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchAttention(DType dtype, const void* q, const void* k_cache, const void* v_cache,
                             const int32_t* positions, const int32_t* slots, float* partials,
                             void* out, int rows, int num_heads, int num_kv_heads, int head_dim,
                             int seq_capacity, int splits, const AttentionParams& params,
                             cudaStream_t stream, uint32_t* counters, bool pdl) {
  if (rows == 0) return absl::OkStatus();
  RETURN_IF_ERROR(
      CheckAttention(num_heads, num_kv_heads, head_dim, seq_capacity, splits, params, counters));
  return Launch(dtype, q, k_cache, v_cache, positions, slots, partials, out, rows, num_heads,
                num_kv_heads, head_dim, SlotKv{num_kv_heads, seq_capacity, head_dim}, splits,
                params, stream, counters, pdl);
}

absl::Status LaunchAttentionPaged(DType dtype, const void* q, const KvPages& pages,
                                  const int32_t* positions, const int32_t* seqs, float* partials,
                                  void* out, int rows, int num_heads, int num_kv_heads,
                                  int head_dim, int splits, const AttentionParams& params,
                                  cudaStream_t stream, uint32_t* counters, bool pdl) {
  if (rows == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckKvPages(pages, head_dim, "paged attention"));
  RETURN_IF_ERROR(CheckAttention(num_heads, num_kv_heads, head_dim, 0, splits, params, counters));
  if (pages.fp8 && !AttentionLanesKernelTakes(head_dim, num_heads / num_kv_heads)) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged attention over FP8 codes takes head_dim up to 128 (a multiple of 4) "
                     "with at most 8 query heads per kv head, got head_dim ",
                     head_dim, " and ", num_heads / num_kv_heads));
  }
  if (!PagedDecodeAttentionTakes(head_dim, num_heads / num_kv_heads)) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged attention: head_dim ", head_dim,
                     " is not a multiple of 8, which pages take only "
                     "up to 128 with at most 8 query heads per kv head (",
                     num_heads / num_kv_heads, ")"));
  }
  return Launch(dtype, q, pages.k, pages.v, positions, seqs, partials, out, rows, num_heads,
                num_kv_heads, head_dim, ToPagedKv(pages, num_kv_heads, head_dim), splits, params,
                stream, counters, pdl);
}

}  // namespace tandem::cuda
