// Token sampling on the device, by the rule of worker/sampling.h: greedy argmax (lowest index on
// ties, NaN never picked), or softmax(logits / T) -> top-k -> top-p -> inverse-CDF draw with
// u = UniformFloat(seed, sample_index). The rule walks candidates sorted by probability; instead
// of sorting the vocabulary, each "first candidate in sorted order where a count or a cumulative
// sum crosses a threshold" is found by a radix descent over the probabilities' bits (positive
// floats order as their bit patterns), then among equal probabilities by index. Running sums
// are fixed point (probability * 2^48 in 64-bit integers), so they are exact and independent of
// the order of the block's additions: the same seed gives the same token on every run. (The
// host rule's sequential fp32 sums carry rounding of their own; over a flat 32k-entry
// distribution the two may pick neighbouring candidates.)
#include <cfloat>
#include <cstdint>

#include "common/rng.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/device_util.cuh"
#include "worker/cuda/kernels.h"

namespace tandem::cuda {
namespace {

constexpr int kThreads = 1024;

// `a` comes before `b` as the argmax: larger, lower index on ties, NaN last.
__device__ __forceinline__ bool ArgmaxBefore(float av, int ai, float bv, int bi) {
  const bool an = isnan(av), bn = isnan(bv);
  if (an != bn) return bn;
  if (an) return ai < bi;
  return av > bv || (av == bv && ai < bi);
}

// Elements a thread loads before comparing any: one row of logits takes a round trip or two to
// memory instead of one per element (the order of comparisons does not matter, ArgmaxBefore is
// a total order).
constexpr int kArgmaxBatch = 16;

__device__ int BlockArgmax(const float* x, int n) {
  __shared__ float sv[32];
  __shared__ int si[32];
  float bv = NAN;
  int bi = INT32_MAX;
  for (int base = threadIdx.x; base < n; base += blockDim.x * kArgmaxBatch) {
    float v[kArgmaxBatch];
#pragma unroll
    for (int u = 0; u < kArgmaxBatch; ++u) {
      const int i = base + u * blockDim.x;
      v[u] = i < n ? x[i] : NAN;
    }
#pragma unroll
    for (int u = 0; u < kArgmaxBatch; ++u) {
      const int i = base + u * blockDim.x;
      if (i < n && ArgmaxBefore(v[u], i, bv, bi)) {
        bv = v[u];
        bi = i;
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ArgmaxBefore(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) {
    sv[warp] = bv;
    si[warp] = bi;
  }
  __syncthreads();
  if (warp == 0) {
    bv = lane < (blockDim.x >> 5) ? sv[lane] : NAN;
    bi = lane < (blockDim.x >> 5) ? si[lane] : INT32_MAX;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ArgmaxBefore(ov, oi, bv, bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if (lane == 0) si[0] = bi;
  }
  __syncthreads();
  const int r = si[0];
  __syncthreads();
  return r;
}

// A candidate and what precedes it in sorted order.
using Fixed = unsigned long long;
constexpr float kFixedOne = 281474976710656.0f;  // 2^48

__device__ __forceinline__ Fixed ToFixed(float p) { return __float2ull_rd(p * kFixedOne); }

struct Pick {
  bool found;
  uint32_t key;      // bits of its probability
  int index;
  Fixed sum_before;  // probability of every candidate before it
};

// Sorted order: probability descending, then index ascending.
__device__ __forceinline__ bool RankAfter(const Pick& a, const Pick& b) {
  return a.key < b.key || (a.key == b.key && a.index > b.index);
}

struct SelectShared {
  int cnt[256];
  Fixed sum[256];
  int warp_cnt[32];
  uint32_t prefix;
  int acc_cnt;
  Fixed acc_sum;
  int tie_count;
  int tie_rank;  // which tie (0-based, index order) is the answer
  Fixed tie_sum_before;
  int found_index;
  bool found;
};

// The m-th (0-based) index i in increasing order with key(p[i]) == key.
__device__ int NthTie(const float* p, int n, uint32_t key, int m, SelectShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int base = 0;
  if (threadIdx.x == 0) sh.found_index = -1;
  __syncthreads();
  for (int c0 = 0; c0 < n; c0 += blockDim.x) {
    const int i = c0 + threadIdx.x;
    const bool flag = i < n && __float_as_uint(p[i]) == key;
    const unsigned ballot = __ballot_sync(0xffffffffu, flag);
    if (lane == 0) sh.warp_cnt[warp] = __popc(ballot);
    __syncthreads();
    int before = base;
    int total = 0;
    for (int w = 0; w < nwarps; ++w) {
      if (w < warp) before += sh.warp_cnt[w];
      total += sh.warp_cnt[w];
    }
    before += __popc(ballot & ((1u << lane) - 1u));
    if (flag && before == m) sh.found_index = i;
    __syncthreads();
    base += total;
    if (sh.found_index >= 0) break;
    __syncthreads();
  }
  const int r = sh.found_index;
  __syncthreads();
  return r;
}

// The first candidate in sorted order at which the running count exceeds `rank` (by_count), or
// at which the running probability sum reaches `target` (>= target, or > target when strict).
__device__ Pick Select(const float* p, int n, bool by_count, int rank, Fixed target, bool strict,
                       SelectShared& sh) {
  if (threadIdx.x == 0) {
    sh.prefix = 0;
    sh.acc_cnt = 0;
    sh.acc_sum = 0;
    sh.found = true;
  }
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) {
      sh.cnt[b] = 0;
      sh.sum[b] = 0;
    }
    __syncthreads();
    const uint32_t prefix = sh.prefix;
    const uint32_t high_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const float v = p[i];
      const uint32_t k = __float_as_uint(v);
      if ((k & high_mask) == (prefix & high_mask)) {
        const int b = (k >> shift) & 255;
        atomicAdd(&sh.cnt[b], 1);
        atomicAdd(&sh.sum[b], ToFixed(v));  // counts need the sum before the pick too
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int chosen = -1;
      for (int b = 255; b >= 0; --b) {
        if (sh.cnt[b] == 0) continue;
        const bool crosses =
            by_count ? sh.acc_cnt + sh.cnt[b] > rank
                     : (strict ? sh.acc_sum + sh.sum[b] > target : sh.acc_sum + sh.sum[b] >= target);
        if (crosses) {
          chosen = b;
          break;
        }
        sh.acc_cnt += sh.cnt[b];
        sh.acc_sum += sh.sum[b];
      }
      if (chosen < 0) {
        sh.found = false;
      } else {
        sh.prefix |= static_cast<uint32_t>(chosen) << shift;
        if (shift == 0) sh.tie_count = sh.cnt[chosen];
      }
    }
    __syncthreads();
    if (!sh.found) return Pick{false, 0, 0, 0};
  }
  // Every candidate of key sh.prefix is a tie; sum_before of the t-th is acc_sum + t * p.
  if (threadIdx.x == 0) {
    const Fixed pv = ToFixed(__uint_as_float(sh.prefix));
    if (by_count) {
      sh.tie_rank = rank - sh.acc_cnt;
      sh.tie_sum_before = sh.acc_sum + pv * sh.tie_rank;
    } else {
      // The first tie t (0-based) with acc + (t + 1) * pv crossing the target.
      int t = 0;
      if (pv > 0) {
        const Fixed need = target > sh.acc_sum ? target - sh.acc_sum : 0;  // (t + 1) * pv vs need
        Fixed q = strict ? need / pv + 1 : (need + pv - 1) / pv;
        if (q < 1) q = 1;
        t = static_cast<int>(min(q - 1, static_cast<Fixed>(sh.tie_count - 1)));
      } else {
        t = sh.tie_count - 1;
      }
      sh.tie_rank = t;
      sh.tie_sum_before = sh.acc_sum + pv * t;
    }
  }
  __syncthreads();
  const uint32_t key = sh.prefix;
  const int tie_rank = sh.tie_rank;
  const Fixed sum_before = sh.tie_sum_before;
  const int index = NthTie(p, n, key, tie_rank, sh);
  return Pick{index >= 0, key, index, sum_before};
}

// One block per row.
__global__ void __launch_bounds__(kThreads)
SampleKernel(const float* __restrict__ logits, float* __restrict__ probs, SamplingArrays params,
             int32_t* __restrict__ tokens_out, int vocab) {
  __shared__ float scratch[32];
  __shared__ SelectShared sh;
  AllowDependentLaunch();
  WaitForPrerequisites();  // the logits are the previous kernel's output
  const int r = blockIdx.x;
  const float* x = logits + static_cast<size_t>(r) * vocab;
  const float temperature = params.temperature[r];
  if (temperature == 0.0f) {
    const int t = BlockArgmax(x, vocab);
    if (threadIdx.x == 0) tokens_out[r] = t;
    return;
  }
  float* p = probs + static_cast<size_t>(r) * vocab;
  // a. softmax of logits / temperature in fp32; NaN counts as -inf.
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = isnan(x[i]) ? -INFINITY : x[i] / temperature;
    mx = fmaxf(mx, v);
  }
  mx = BlockMax(mx, scratch);
  if (!isfinite(mx)) {
    const int t = BlockArgmax(x, vocab);
    if (threadIdx.x == 0) tokens_out[r] = t;
    return;
  }
  float sum = 0.0f;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = isnan(x[i]) ? -INFINITY : x[i] / temperature;
    const float e = expf(v - mx);
    p[i] = e;
    sum += e;
  }
  sum = BlockSum(sum, scratch);
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) p[i] = p[i] / sum;
  __syncthreads();

  // c. the last candidate that top-k keeps.
  const int top_k = params.top_k[r];
  const int keep_k = top_k > 0 && top_k < vocab ? top_k : vocab;
  Pick last = Select(p, vocab, true, keep_k - 1, 0, false, sh);
  Fixed total = last.sum_before + ToFixed(__uint_as_float(last.key));
  // d. top-p: the first candidate where the running sum reaches top_p of the top-k mass.
  const float top_p = params.top_p[r];
  if (top_p < 1.0f) {
    const Fixed threshold = static_cast<Fixed>(static_cast<double>(top_p) * total);
    const Pick c = Select(p, vocab, false, 0, threshold, false, sh);
    if (c.found && !RankAfter(c, last)) {
      last = c;
      total = c.sum_before + ToFixed(__uint_as_float(c.key));
    }
  }
  // e. inverse-CDF draw over the kept candidates: target = u * total exactly, u = bits / 2^24
  // as UniformFloat.
  const Fixed u24 = RandomBits(params.seed[r], params.sample_index[r]) >> 40;
  const Fixed target = (__umul64hi(u24, total) << 40) | ((u24 * total) >> 24);
  Pick d = Select(p, vocab, false, 0, target, true, sh);
  if (!d.found || RankAfter(d, last)) d = last;
  if (threadIdx.x == 0) tokens_out[r] = d.index;
}

}  // namespace

absl::Status LaunchSample(const float* logits, float* probs, SamplingArrays params,
                          int32_t* tokens_out, int rows, int vocab, cudaStream_t stream, bool pdl) {
  if (rows == 0) return absl::OkStatus();
  CUDA_CHECK(LaunchKernel(SampleKernel, dim3(rows), dim3(kThreads), 0, stream, pdl, logits, probs,
                          params, tokens_out, vocab));
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace tandem::cuda
