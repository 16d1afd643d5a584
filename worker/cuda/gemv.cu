// Decode projections for a few rows (M in {1, 2, 4, 8}): y (M, N) = x (M, K) · wᵀ with w (N, K)
// row-major, read once with 16-byte streaming loads. At M <= 8 the product is bound by the weight
// bytes, and cuBLAS's tiled kernels (plus their split-K reduction kernels) leave bandwidth unused.
//
// One warp computes R output rows over all M inputs: each lane takes 8 consecutive elements of
// K per 256-element step, U steps of weights loaded before the first use so that enough bytes are
// in flight; x (a few KB, shared by every warp) comes through L1. fp32 accumulation, a warp
// reduction, then the epilogue (bias, residual add, GELU, SwiGLU or fp32 logits) in registers.
//
// FP8 weights (GemvFp8, GemvQkvCacheFp8): the same kernel with E4M3 codes, converted to fp16
// pairs in registers (exact: E4M3 is a subset of fp16); each output row's sum is multiplied by the
// row's scale before the epilogue. Where K is a multiple of 16 a lane takes 16 codes per step in
// one 16-byte load (512-element steps: the loads of fp16 weights, half the steps); elsewhere 8 in
// an 8-byte load with twice the steps in flight, so that a warp keeps as many bytes outstanding.
//
#include <cuda_fp8.h>

#include "common/status_macros.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/device_util.cuh"
#include "worker/cuda/kernels.h"
#include "worker/cuda/kv_pages.h"
#include "worker/cuda/kv_view.cuh"

namespace tandem::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
// 256-element steps of K whose weights are in flight together per warp (2 KiB). 8 steps for one
// or two dot products per warp measured faster alone (tandem-bench --gemv_sweep) but slower in
// the decode step (openllama-3b batch 1 on an H100: 2.896 -> 2.931 ms).
constexpr int kUnroll = 4;

// Weights are read once per step: keep them out of L1, which x needs.
__device__ __forceinline__ uint4 LoadStreaming(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 LoadStreaming8(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
               : "=r"(v.x), "=r"(v.y)
               : "l"(p));
  return v;
}

// kE weights of one lane's step: a 16-byte vector of 8 fp16/bf16 or 16 E4M3 codes, or 8 bytes of
// 8 E4M3 codes.
template <typename W, int kE>
struct WeightVec {
  static_assert(kE == 8, "fp16/bf16 weights: 8 per lane and step");
  using type = uint4;
  static constexpr int kUnrollFactor = 1;
  __device__ __forceinline__ static type Load(const W* p) { return LoadStreaming(p); }
  __device__ __forceinline__ static type Zero() { return make_uint4(0, 0, 0, 0); }
};
template <>
struct WeightVec<__nv_fp8_e4m3, 8> {
  using type = uint2;
  static constexpr int kUnrollFactor = 2;  // half the bytes per step: twice the steps in flight
  __device__ __forceinline__ static type Load(const __nv_fp8_e4m3* p) { return LoadStreaming8(p); }
  __device__ __forceinline__ static type Zero() { return make_uint2(0, 0); }
};
template <>
struct WeightVec<__nv_fp8_e4m3, 16> {
  using type = uint4;
  static constexpr int kUnrollFactor = 1;
  __device__ __forceinline__ static type Load(const __nv_fp8_e4m3* p) { return LoadStreaming(p); }
  __device__ __forceinline__ static type Zero() { return make_uint4(0, 0, 0, 0); }
};

// 4 * N E4M3 codes (element i in byte i, little-endian) of N 32-bit words as floats.
template <int N>
__device__ __forceinline__ void UnpackFp8Words(const uint32_t (&u)[N], float (&f)[4 * N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float2 p = Fp8PairToFloat2(u[i] >> (16 * j));
      f[4 * i + 2 * j] = p.x;
      f[4 * i + 2 * j + 1] = p.y;
    }
  }
}
__device__ __forceinline__ void UnpackFp8(const uint2& v, float (&f)[8]) {
  const uint32_t u[2] = {v.x, v.y};
  UnpackFp8Words<2>(u, f);
}
__device__ __forceinline__ void UnpackFp8(const uint4& v, float (&f)[16]) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
  UnpackFp8Words<4>(u, f);
}

// 8 elements of a 16-byte vector as floats.
template <typename T>
__device__ __forceinline__ void Unpack(const uint4& v, float (&f)[8]) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __half>) {
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&u[i]));
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    } else {
      const float2 p = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u[i]));
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
}

__device__ __forceinline__ float GeluTanh(float x) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

// Everything a GEMV launch needs, passed by value.
struct GemvParams {
  const void* x;
  const void* w;
  const float* w_scales;  // FP8 weights: (rows of w) scale per row; null for fp16/bf16
  const void* bias;
  void* y;
  int n;               // output width (of each half for SwiGLU; q_dim + 2 kv_dim for kQkvCache)
  int k;               // input width
  int units;           // groups of R weight rows, one per `split` warps
  int split;           // warps that divide one unit's K between them (1, 2 or 4)
  QkvCacheArgs cache;  // kQkvCache only
  // kQkvCache into a paged cache (kv_pages.h) when table is set: cache.slots are table rows.
  PagedKv pages;
};

// Rows of w that unit `unit` reads: R consecutive rows; for SwiGLU the gate row j and the up row
// N + j; for kQkvCache the rotary pair (i, i + head_dim / 2) of one head of the fused QKV.
template <GemvEpilogue E, int R>
__device__ __forceinline__ int WeightRow(const GemvParams& p, int unit, int r) {
  if constexpr (E == GemvEpilogue::kSwiGlu) {
    return unit + r * p.n;
  } else if constexpr (E == GemvEpilogue::kQkvCache) {
    const int half = p.cache.head_dim / 2;
    return (unit / half) * p.cache.head_dim + unit % half + r * half;
  } else {
    return unit * R + r;
  }
}

// W: the weights' element type, T (fp16/bf16) or __nv_fp8_e4m3 (with p.w_scales); kE: weights
// per lane and step (8, or 16 for FP8 where K % 16 == 0).
template <typename T, typename W, int kE, int M, int R, GemvEpilogue E>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) GemvKernel(const GemvParams p) {
  constexpr bool kFp8 = std::is_same_v<W, __nv_fp8_e4m3>;
  using Vec = WeightVec<W, kE>;
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const W* __restrict__ w = static_cast<const W*>(p.w);
  const T* __restrict__ bias = static_cast<const T*>(p.bias);
  const int k = p.k, n = p.n, split = p.split;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // This warp's share of its unit's K: the 256-element steps part, part + split, ...
  const int part = warp % split;
  int unit = blockIdx.x * (kWarpsPerBlock / split) + warp / split;
  const bool active = unit < p.units;  // false for the last block's spare warps
  if (split == 1 && !active) return;
  unit = min(unit, p.units - 1);  // spare warps of a split unit still reach the barrier below
  // Rows past N (the last unit of an odd N with R = 2) read row N - 1 and are not stored.
  const int rows_total = E == GemvEpilogue::kSwiGlu ? 2 * n : n;
  const W* wrow[R];
  float wscale[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = min(WeightRow<E, R>(p, unit, r), rows_total - 1);
    wrow[r] = w + static_cast<size_t>(row) * k;
    wscale[r] = kFp8 ? p.w_scales[row] : 1.0f;
  }
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
  }
  constexpr int kStep = 32 * kE;
  const int step = kStep * split;  // from one of this warp's steps to its next
  constexpr int U = kUnroll * Vec::kUnrollFactor;
  const int stride = step * U;
  // Software pipeline: wv[u] holds the weights of step u of the current batch; once unpacked it
  // is refilled with step u of the next batch, so that U steps stay in flight while the current
  // ones are multiplied. The first batch is loaded before waiting for the kernel that writes x
  // (it does not read x), which hides this kernel's start behind the previous one.
  typename Vec::type wv[U][R];
  const int first = (part * 32 + lane) * kE;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int kk = first + u * step;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      wv[u][r] = kk < k ? Vec::Load(wrow[r] + kk) : Vec::Zero();
    }
  }
  AllowDependentLaunch();
  WaitForPrerequisites();
  const T* xrow[M];
#pragma unroll
  for (int m = 0; m < M; ++m) xrow[m] = x + static_cast<size_t>(m) * k;
  for (int base = first; base < k; base += stride) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kk = base + u * step;
      if (kk >= k) break;
      float wf[R][kE];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if constexpr (kFp8) {
          UnpackFp8(wv[u][r], wf[r]);
        } else {
          Unpack<W>(wv[u][r], wf[r]);
        }
      }
      const int next = kk + stride;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (next < k) wv[u][r] = Vec::Load(wrow[r] + next);
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int h = 0; h < kE / 8; ++h) {
          float xf[8];
          Unpack<T>(__ldg(reinterpret_cast<const uint4*>(xrow[m] + kk + 8 * h)), xf);
#pragma unroll
          for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[r][m] = fmaf(wf[r][8 * h + i], xf[i], acc[r][m]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = WarpSum(acc[r][m]);
  }
  if (split > 1) {
    // The unit's first warp adds the other warps' sums to its own, in warp order (the same
    // order for every launch of the shape).
    __shared__ float partial[kWarpsPerBlock][R][M];
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int m = 0; m < M; ++m) partial[warp][r][m] = acc[r][m];
      }
    }
    __syncthreads();
    if (part != 0) return;
    for (int j = 1; j < split; ++j) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] += partial[warp + j][r][m];
      }
    }
  }
  if (!active) return;
  if constexpr (kFp8) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][m] *= wscale[r];
    }
  }
  // Every lane holds every sum; lane (r', m) stores output (r', m) (one per lane).
  if constexpr (E == GemvEpilogue::kSwiGlu) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (lane != m) continue;
      // As Hugging Face: both projections rounded, silu(gate) rounded, then the product.
      const float gate = RoundTo<T>(acc[0][m]);
      const float up = RoundTo<T>(acc[1][m]);
      const float s = RoundTo<T>(gate / (1.0f + expf(-gate)));
      static_cast<T*>(p.y)[static_cast<size_t>(m) * n + unit] = FromF<T>(s * up);
    }
  } else if constexpr (E == GemvEpilogue::kQkvCache) {
    // The pair's two outputs with bias, rounded (what the projection stores), then what
    // LaunchQkvRopeCache does with them: rotated (q and k) and written to q or the cache.
    const QkvCacheArgs& c = p.cache;
    const int half = c.head_dim / 2, head = unit / half, i = unit % half;
    const int col = head * c.head_dim + i;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (lane != m) continue;
      float x1 = acc[0][m], x2 = acc[1][m];
      if (bias != nullptr) {
        x1 += ToF(bias[col]);
        x2 += ToF(bias[col + half]);
      }
      x1 = RoundTo<T>(x1);
      x2 = RoundTo<T>(x2);
      const int pos = c.positions[m], slot = c.slots[m];
      if (c.inv_freq != nullptr && head < c.num_heads + c.num_kv_heads) {
        RotateHalfPair<T>(x1, x2, pos, c.inv_freq[i]);
      }
      if (head < c.num_heads) {
        T* out = static_cast<T*>(c.q_out) + static_cast<size_t>(m) * c.num_heads * c.head_dim +
                 head * c.head_dim;
        out[i] = FromF<T>(x1);
        out[i + half] = FromF<T>(x2);
      } else {
        const bool is_k = head < c.num_heads + c.num_kv_heads;
        const int kv_head = head - c.num_heads - (is_k ? 0 : c.num_kv_heads);
        void* pool = is_k ? c.k_cache : c.v_cache;
        if (p.pages.table != nullptr) {
          // The paged cache, of the activations' type or of FP8 codes.
          const size_t at = p.pages.Offset(slot, kv_head, pos) + i;
          const float scale = is_k ? p.pages.k_scale : p.pages.v_scale;
          StoreKv<T>(pool, at, RoundTo<T>(x1), p.pages, scale);
          StoreKv<T>(pool, at + half, RoundTo<T>(x2), p.pages, scale);
        } else {
          T* out = static_cast<T*>(pool) +
                   KvCacheOffset(slot, kv_head, pos, c.num_kv_heads, c.seq_capacity, c.head_dim);
          out[i] = FromF<T>(x1);
          out[i + half] = FromF<T>(x2);
        }
      }
    }
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const int col = unit * R + r;
        if (lane != r * M + m || col >= n) continue;
        float v = acc[r][m];
        if (bias != nullptr) v += ToF(bias[col]);
        const size_t at = static_cast<size_t>(m) * n + col;
        if constexpr (E == GemvEpilogue::kF32) {
          static_cast<float*>(p.y)[at] = v;
        } else if constexpr (E == GemvEpilogue::kStore) {
          static_cast<T*>(p.y)[at] = FromF<T>(v);
        } else if constexpr (E == GemvEpilogue::kResidual) {
          // The projection's output is rounded before the residual add, as a Linear layer's is.
          T* out = static_cast<T*>(p.y);
          out[at] = FromF<T>(ToF(out[at]) + RoundTo<T>(v));
        } else {
          static_cast<T*>(p.y)[at] = FromF<T>(GeluTanh(RoundTo<T>(v)));
        }
      }
    }
  }
}

template <typename T, typename W, int kE, int M, int R, GemvEpilogue E>
cudaError_t Launch(GemvParams p, cudaStream_t stream, bool pdl) {
  if constexpr (E == GemvEpilogue::kSwiGlu) {
    p.units = p.n;
  } else if constexpr (E == GemvEpilogue::kQkvCache) {
    p.units = p.n / 2;
  } else {
    p.units = (p.n + R - 1) / R;
  }
  const int units_per_block = kWarpsPerBlock / p.split;
  const int blocks = (p.units + units_per_block - 1) / units_per_block;
  // With pdl: start before the previous kernel ends (see WaitForPrerequisites).
  return LaunchKernel(GemvKernel<T, W, kE, M, R, E>, dim3(blocks), dim3(kWarpsPerBlock * 32), 0,
                      stream, pdl, p);
}

// Rows per warp: two halve the x traffic through L1 per weight byte (always at M >= 4, and
// SwiGLU and kQkvCache read two rows by construction); one gives twice the warps at M <= 2.
template <typename T, typename W, int kE, GemvEpilogue E>
cudaError_t LaunchForRows(int m, int rows_per_warp, const GemvParams& p, cudaStream_t stream,
                          bool pdl) {
  constexpr bool kPaired = E == GemvEpilogue::kSwiGlu || E == GemvEpilogue::kQkvCache;
  constexpr int R1 = kPaired ? 2 : 1;
  const bool two = kPaired || rows_per_warp == 2;
  switch (m) {
    case 1:
      if constexpr (!kPaired) {
        if (two) return Launch<T, W, kE, 1, 2, E>(p, stream, pdl);
      }
      return Launch<T, W, kE, 1, R1, E>(p, stream, pdl);
    case 2:
      if constexpr (!kPaired) {
        if (two) return Launch<T, W, kE, 2, 2, E>(p, stream, pdl);
      }
      return Launch<T, W, kE, 2, R1, E>(p, stream, pdl);
    case 4:
      return Launch<T, W, kE, 4, 2, E>(p, stream, pdl);
    default:
      return Launch<T, W, kE, 8, 2, E>(p, stream, pdl);
  }
}

template <typename T, typename W, int kE = 8>
cudaError_t LaunchEpilogue(GemvEpilogue epilogue, int m, int rows_per_warp, const GemvParams& p,
                           cudaStream_t stream, bool pdl) {
  switch (epilogue) {
    case GemvEpilogue::kStore:
      return LaunchForRows<T, W, kE, GemvEpilogue::kStore>(m, rows_per_warp, p, stream, pdl);
    case GemvEpilogue::kResidual:
      return LaunchForRows<T, W, kE, GemvEpilogue::kResidual>(m, rows_per_warp, p, stream, pdl);
    case GemvEpilogue::kGelu:
      return LaunchForRows<T, W, kE, GemvEpilogue::kGelu>(m, rows_per_warp, p, stream, pdl);
    case GemvEpilogue::kSwiGlu:
      return LaunchForRows<T, W, kE, GemvEpilogue::kSwiGlu>(m, rows_per_warp, p, stream, pdl);
    case GemvEpilogue::kF32:
      return LaunchForRows<T, W, kE, GemvEpilogue::kF32>(m, rows_per_warp, p, stream, pdl);
    case GemvEpilogue::kQkvCache:
      return LaunchForRows<T, W, kE, GemvEpilogue::kQkvCache>(m, rows_per_warp, p, stream, pdl);
  }
  return cudaErrorInvalidValue;
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

bool GemvSupported(int rows, int in) {
  return (rows == 1 || rows == 2 || rows == 4 || rows == 8) && in > 0 && in % 8 == 0;
}

GemvTuning GemvTuningFor(int rows, int out, int in, int sm_count, bool fp8) {
  // From tandem-bench --gemv_sweep on an H100 (docs/performance.md). About 32 warps of these
  // kernels are resident per multiprocessor (registers), and which split wins depends on how the
  // warps fill those slots:
  //  - a narrow output with a long K (gpt2's MLP down projection: 768 rows of 3,072) is latency
  //    bound, a few warps walking K one load batch after another: 4 warps per row, all resident;
  //  - a wide output (QKV, gate/up, LM head: more rows than slots) runs in several waves anyway,
  //    and smaller warps even out the last one: split 4 (2 from 4 input rows on);
  //  - in between (openllama-3b's residual projections, 3,200 rows: one wave) a split would add
  //    a second, mostly empty wave: none.
  // Each warp keeps at least two steps of K (256 elements; 512 for FP8 codes 16 a lane).
  // FP8 weights (16 codes a lane), measured on an H200 (docs/results/fp8-gemv-h200/): a wide
  // output's row is half the bytes and a warp's pass over it half as long, so the last wave costs
  // little and a split only adds warps: none, with two rows per warp (the 8B shape's QKV 10.3 ->
  // 8.2 µs, its gate/up 36.2 -> 30.3).
  GemvTuning t;
  t.rows_per_warp = rows <= 2 ? 1 : 2;
  const int64_t slots = 32LL * sm_count;
  const bool wide_codes = fp8 && in % 16 == 0;
  if (wide_codes && out >= slots) t.rows_per_warp = 2;
  const int64_t units = (out + t.rows_per_warp - 1) / t.rows_per_warp;
  const int steps = (in + (wide_codes ? 511 : 255)) / (wide_codes ? 512 : 256);
  int split = 1;
  if (units * 4 <= slots) {
    split = 4;
  } else if (units >= slots && !wide_codes) {
    split = rows <= 2 ? 4 : 2;
  }
  while (split > 1 && steps < 2 * split) split /= 2;
  t.k_split = split;
  return t;
}

namespace {

// Multiprocessors of the current device, looked up once per device and thread.
int CurrentSmCount() {
  thread_local int device = -1, count = 0;
  int d = 0;
  if (cudaGetDevice(&d) != cudaSuccess) return 132;
  if (d != device) {
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, d) != cudaSuccess) {
      count = 132;
    }
    device = d;
  }
  return count;
}

absl::Status CheckGemvShape(int rows, int out, int in, const void* x, const void* w) {
  if (!GemvSupported(rows, in)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GEMV takes 1, 2, 4 or 8 rows and an input width that is a multiple of 8, got rows ", rows,
        ", in ", in));
  }
  if (out < 1) return absl::InvalidArgumentError(absl::StrCat("GEMV output width ", out, " < 1"));
  if (!Aligned16(x) || !Aligned16(w)) {
    return absl::InvalidArgumentError("GEMV needs 16-byte aligned x and w");
  }
  return absl::OkStatus();
}

// The tuning to launch with: `tuning`'s fields where set, the shape's choice elsewhere.
// FP8 codes per lane: 16 where the width and w's alignment allow, unless the tuning says 8.
absl::StatusOr<GemvTuning> ResolveTuning(GemvTuning tuning, int rows, int out, int in,
                                         const void* w, bool fp8) {
  const GemvTuning chosen = GemvTuningFor(rows, out, in, CurrentSmCount(), fp8 && Aligned16(w));
  if (tuning.rows_per_warp == 0) tuning.rows_per_warp = chosen.rows_per_warp;
  if (tuning.k_split == 0) tuning.k_split = chosen.k_split;
  if (tuning.rows_per_warp != 1 && tuning.rows_per_warp != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("GEMV rows per warp must be 1 or 2, got ", tuning.rows_per_warp));
  }
  if (tuning.k_split != 1 && tuning.k_split != 2 && tuning.k_split != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("GEMV K split must be 1, 2 or 4 warps, got ", tuning.k_split));
  }
  const bool wide = in % 16 == 0 && Aligned16(w);
  if (tuning.fp8_lane_codes == 0) tuning.fp8_lane_codes = wide ? 16 : 8;
  if (tuning.fp8_lane_codes != 8 && (tuning.fp8_lane_codes != 16 || !wide)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FP8 GEMV codes per lane must be 8, or 16 with an input width that is a multiple of 16 "
        "and 16-byte aligned weights, got ",
        tuning.fp8_lane_codes, " with in ", in));
  }
  return tuning;
}

// The product's part of a launch: y (out) = x (in) · wᵀ + bias with K divided between `split`
// warps; the epilogue's extras are set by the caller.
GemvParams ProductParams(const void* x, const void* w, const void* bias, void* y, int out, int in,
                         int split) {
  GemvParams p{};
  p.x = x;
  p.w = w;
  p.bias = bias;
  p.y = y;
  p.n = out;
  p.k = in;
  p.split = split;
  return p;
}

}  // namespace

namespace {

absl::Status CheckFp8Scales(const void* w, const float* w_scales) {
  if (w_scales == nullptr) return absl::InvalidArgumentError("FP8 GEMV needs the row scales");
  // 8-byte loads of codes: rows start at multiples of `in` (a multiple of 8) from w.
  if ((reinterpret_cast<uintptr_t>(w) & 7) != 0 ||
      (reinterpret_cast<uintptr_t>(w_scales) & 3) != 0) {
    return absl::InvalidArgumentError("FP8 GEMV needs 8-byte aligned codes and aligned scales");
  }
  return absl::OkStatus();
}

// Gemv and its FP8 form: w_scales null for fp16/bf16 weights.
absl::Status GemvAny(DType dtype, GemvEpilogue epilogue, const void* x, const void* w,
                     const float* w_scales, const void* bias, void* y, int rows, int out, int in,
                     cudaStream_t stream, GemvTuning tuning) {
  RETURN_IF_ERROR(CheckGemvShape(rows, out, in, x, w_scales != nullptr ? x : w));
  if (epilogue == GemvEpilogue::kQkvCache) {
    return absl::InvalidArgumentError("the QKV-into-cache GEMV is GemvQkvCache");
  }
  ASSIGN_OR_RETURN(const GemvTuning t,
                   ResolveTuning(tuning, rows, out, in, w, w_scales != nullptr));
  GemvParams p = ProductParams(x, w, bias, y, out, in, t.k_split);
  p.w_scales = w_scales;
  // On a stream of our own, always as a programmatic dependent launch.
  if (w_scales != nullptr) {
    TANDEM_DISPATCH_HALF(dtype, {
      CUDA_CHECK(t.fp8_lane_codes == 16 ? (LaunchEpilogue<T, __nv_fp8_e4m3, 16>(
                                              epilogue, rows, t.rows_per_warp, p, stream, true))
                                        : (LaunchEpilogue<T, __nv_fp8_e4m3, 8>(
                                              epilogue, rows, t.rows_per_warp, p, stream, true)));
    });
  } else {
    TANDEM_DISPATCH_HALF(dtype, {
      CUDA_CHECK((LaunchEpilogue<T, T>(epilogue, rows, t.rows_per_warp, p, stream, true)));
    });
  }
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

// GemvQkvCache and its FP8 form (w_scales null for fp16/bf16 weights), into the contiguous cache
// (pages.table null) or into pages.
absl::Status GemvQkvCacheAny(DType dtype, const void* x, const void* w, const float* w_scales,
                             const void* bias, const QkvCacheArgs& cache, const PagedKv& pages,
                             int rows, int in, cudaStream_t stream, GemvTuning tuning) {
  if (cache.head_dim < 2 || cache.head_dim % 2 != 0 || cache.num_heads < 1 ||
      cache.num_kv_heads < 1 || cache.seq_capacity < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QKV-into-cache GEMV needs an even head_dim and positive head counts and capacity, got "
        "head_dim ",
        cache.head_dim, ", heads ", cache.num_heads, ", kv heads ", cache.num_kv_heads,
        ", capacity ", cache.seq_capacity));
  }
  if (cache.q_out == nullptr || cache.k_cache == nullptr || cache.v_cache == nullptr ||
      cache.positions == nullptr || cache.slots == nullptr) {
    return absl::InvalidArgumentError(
        "QKV-into-cache GEMV needs q_out, both caches, positions and slots");
  }
  const int out = (cache.num_heads + 2 * cache.num_kv_heads) * cache.head_dim;
  RETURN_IF_ERROR(CheckGemvShape(rows, out, in, x, w_scales != nullptr ? x : w));
  ASSIGN_OR_RETURN(const GemvTuning t,
                   ResolveTuning(tuning, rows, out / 2, in, w, w_scales != nullptr));
  GemvParams p = ProductParams(x, w, bias, nullptr, out, in, t.k_split);
  p.w_scales = w_scales;
  p.cache = cache;
  p.pages = pages;
  if (w_scales != nullptr) {
    TANDEM_DISPATCH_HALF(dtype, {
      CUDA_CHECK(t.fp8_lane_codes == 16 ? (LaunchEpilogue<T, __nv_fp8_e4m3, 16>(
                                              GemvEpilogue::kQkvCache, rows, 2, p, stream, true))
                                        : (LaunchEpilogue<T, __nv_fp8_e4m3, 8>(
                                              GemvEpilogue::kQkvCache, rows, 2, p, stream, true)));
    });
  } else {
    TANDEM_DISPATCH_HALF(dtype, {
      CUDA_CHECK((LaunchEpilogue<T, T>(GemvEpilogue::kQkvCache, rows, 2, p, stream, true)));
    });
  }
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace

absl::Status Gemv(DType dtype, GemvEpilogue epilogue, const void* x, const void* w,
                  const void* bias, void* y, int rows, int out, int in, cudaStream_t stream,
                  GemvTuning tuning) {
  return GemvAny(dtype, epilogue, x, w, nullptr, bias, y, rows, out, in, stream, tuning);
}

absl::Status GemvFp8(DType dtype, GemvEpilogue epilogue, const void* x, const void* w,
                     const float* w_scales, const void* bias, void* y, int rows, int out, int in,
                     cudaStream_t stream, GemvTuning tuning) {
  RETURN_IF_ERROR(CheckFp8Scales(w, w_scales));
  return GemvAny(dtype, epilogue, x, w, w_scales, bias, y, rows, out, in, stream, tuning);
}

absl::Status GemvQkvCache(DType dtype, const void* x, const void* w, const void* bias,
                          const QkvCacheArgs& cache, int rows, int in, cudaStream_t stream,
                          GemvTuning tuning) {
  return GemvQkvCacheAny(dtype, x, w, nullptr, bias, cache, PagedKv{}, rows, in, stream, tuning);
}

absl::Status GemvQkvCacheFp8(DType dtype, const void* x, const void* w, const float* w_scales,
                             const void* bias, const QkvCacheArgs& cache, int rows, int in,
                             cudaStream_t stream, GemvTuning tuning) {
  RETURN_IF_ERROR(CheckFp8Scales(w, w_scales));
  return GemvQkvCacheAny(dtype, x, w, w_scales, bias, cache, PagedKv{}, rows, in, stream, tuning);
}

absl::Status GemvQkvCachePaged(DType dtype, const void* x, const void* w, const float* w_scales,
                               const void* bias, const QkvCacheArgs& cache, const KvPages& pages,
                               int rows, int in, cudaStream_t stream, GemvTuning tuning) {
  RETURN_IF_ERROR(CheckKvPages(pages, cache.head_dim, "QKV-into-pages GEMV"));
  if (w_scales != nullptr) RETURN_IF_ERROR(CheckFp8Scales(w, w_scales));
  QkvCacheArgs c = cache;
  c.k_cache = pages.k;
  c.v_cache = pages.v;
  c.seq_capacity = pages.page_size;  // unused: positions go through the table
  return GemvQkvCacheAny(dtype, x, w, w_scales, bias, c,
                         ToPagedKv(pages, cache.num_kv_heads, cache.head_dim), rows, in, stream,
                         tuning);
}

}  // namespace tandem::cuda
