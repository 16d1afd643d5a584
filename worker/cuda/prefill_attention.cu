// Prefill attention on tensor cores: many query rows per sequence attend causally to the KV-cache
// (the cached prefix and the rows themselves, which LaunchQkvRopeCache has already written), in the
// manner of FlashAttention-2. A block takes 128 consecutive query rows of one head; each of its 4
// warps owns 32 rows (two m16 tiles, so that every K and V fragment read from shared memory feeds
// two products: shared-memory bandwidth, not the tensor cores, bounds a warp of 16 rows on an
// H100). K and V tiles of 64 keys stream through shared memory with cp.async, two stages deep;
// scores S = Q·Kᵀ and the output O += P·V are mma.sync m16n8k16 products (fp16/bf16 inputs, fp32
// accumulation) with an online softmax in between, so scores never leave registers.
//
// Rows are the forward pass's rows: each has its own slot and position. A run of rows with one
// slot and consecutive positions is a segment (one sequence's chunk); a block whose 128 rows span
// several segments runs its key loop once per segment, each time writing only that segment's rows.
// head_dim is padded to a multiple of 16 in shared memory with zeros. Hopper with head_dim 64 and
// 128 takes prefill_attention_sm90.cu instead (warpgroup MMA and TMA), for the paged cache too with
// pages of 8 positions or more. Elsewhere the paged cache (kv_pages.h) takes this kernel, each key
// row's address found through the block table (kv_view.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <climits>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/device_util.cuh"
#include "worker/cuda/kv_pages.h"
#include "worker/cuda/kv_view.cuh"
#include "worker/cuda/prefill_attention.h"
#include "worker/cuda/prefill_attention_sm90.h"

namespace tandem::cuda {
namespace {

constexpr int kRows = 128;  // query rows per block
constexpr int kKeys = 64;   // keys per shared-memory tile
constexpr int kWarps = 4;   // kWarpRows query rows each
constexpr int kWarpRows = kRows / kWarps;
constexpr int kMt = kWarpRows / 16;  // m16 tiles per warp
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;

// Padded head_dim for a head_dim (a multiple of 16), 0 when none is compiled.
__host__ __device__ constexpr int PaddedDim(int head_dim) {
  return head_dim <= 64    ? 64
         : head_dim <= 80  ? 80
         : head_dim <= 96  ? 96
         : head_dim <= 112 ? 112
         : head_dim <= 128 ? 128
                           : 0;
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int kBytes>
__device__ __forceinline__ void CpAsync(void* dst, const void* src) {
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SmemAddr(dst)), "l"(src));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(SmemAddr(dst)), "l"(src),
                 "n"(kBytes));
  }
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}

// d (16x8 fp32) += a (16x16, row) · b (16x8, col).
template <typename T>
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// A thread's share of copying rows of head_dim elements as kVec-byte pieces: pieces
// threadIdx.x, + kThreads, ... of the rows' per_row each, walked without a division per piece
// (the divisions by a head_dim known only at run time cost more than the copies).
struct RowWalk {
  int per_row;   // pieces per row
  int row0, c0;  // this thread's first piece
  int drow, dc;  // kThreads pieces on: drow rows and dc pieces
  __device__ RowWalk(int head_dim, int elems_per_piece) {
    per_row = head_dim / elems_per_piece;
    row0 = threadIdx.x / per_row;
    c0 = threadIdx.x % per_row;
    drow = kThreads / per_row;
    dc = kThreads % per_row;
  }
};

// Copies kN rows of head_dim elements (global row stride `src_stride` elements) into shared rows
// of kStride elements with kVec-byte cp.async copies; rows >= valid are left alone.
template <typename T, int kStride, int kVec, int kN>
__device__ __forceinline__ void LoadRows(T* dst, const T* src, size_t src_stride, int valid,
                                         const RowWalk& w) {
  constexpr int kElems = kVec / 2;
  int row = w.row0, c = w.c0;
  while (row < kN) {
    if (row < valid) {
      CpAsync<kVec>(dst + row * kStride + c * kElems, src + row * src_stride + c * kElems);
    }
    row += w.drow;
    c += w.dc;
    if (c >= w.per_row) {
      c -= w.per_row;
      ++row;
    }
  }
}

// LoadRows from the paged cache (kv_pages.h): key row `row` of the tile at t0 is position t0 + row
// of table row `seq`, clamped to [lo, hi] (the keys the segment sees), so that the rows the mask
// hides read a page the table holds rather than one past its end or before the window.
template <typename T, int kStride, int kVec, int kN, typename Kv>
__device__ __forceinline__ void LoadPagedRows(T* dst, const T* pool, const Kv& kv, int seq, int kvh,
                                              int t0, int lo, int hi, const RowWalk& w) {
  constexpr int kElems = kVec / 2;
  int row = w.row0, c = w.c0;
  while (row < kN) {
    const int pos = min(max(t0 + row, lo), hi);
    CpAsync<kVec>(dst + row * kStride + c * kElems, pool + kv.Offset(seq, kvh, pos) + c * kElems);
    row += w.drow;
    c += w.dc;
    if (c >= w.per_row) {
      c -= w.per_row;
      ++row;
    }
  }
}

// LoadPagedRows from pages of FP8 codes (kv_pages.h): each piece's kVec / 2 codes loaded and
// stored as kVec / 2 elements of T (exact: E4M3 is a subset of fp16 and bf16), through registers
// rather than cp.async; the caller's barrier after the cp.async wait publishes them alike.
template <typename T, int kStride, int kVec, int kN, typename Kv>
__device__ __forceinline__ void LoadPagedCodeRows(T* dst, const uint8_t* pool, const Kv& kv,
                                                  int seq, int kvh, int t0, int lo, int hi,
                                                  const RowWalk& w) {
  constexpr int kElems = kVec / 2;
  using Codes = std::conditional_t<kElems == 8, uint2, uint32_t>;
  static_assert(kElems == 8 || kElems == 4, "pieces of 8 or 4 codes");
  int row = w.row0, c = w.c0;
  while (row < kN) {
    const int pos = min(max(t0 + row, lo), hi);
    const Codes codes =
        *reinterpret_cast<const Codes*>(pool + kv.Offset(seq, kvh, pos) + c * kElems);
    const uint32_t* words = reinterpret_cast<const uint32_t*>(&codes);
    alignas(16) T out[kElems];
#pragma unroll
    for (int i = 0; i < kElems / 2; ++i) {
      const float2 f = Fp8PairToFloat2(words[i / 2] >> (16 * (i % 2)));
      out[2 * i] = FromF<T>(f.x);
      out[2 * i + 1] = FromF<T>(f.y);
    }
    if constexpr (kElems == 8) {
      *reinterpret_cast<uint4*>(dst + row * kStride + c * kElems) =
          *reinterpret_cast<const uint4*>(out);
    } else {
      *reinterpret_cast<uint2*>(dst + row * kStride + c * kElems) =
          *reinterpret_cast<const uint2*>(out);
    }
    row += w.drow;
    c += w.dc;
    if (c >= w.per_row) {
      c -= w.per_row;
      ++row;
    }
  }
}

// grid (num_heads, ceil(rows / kRows)); kD: padded head_dim; kVec: bytes per cp.async; Kv: the
// cache layout (kv_view.cuh), slots being table rows for pages. kCodes: the pages hold FP8 codes
// (PagedKv only): scores take the layer's K scale and outputs its V scale.
template <typename T, int kD, int kVec, typename Kv, bool kCodes = false>
__global__ void __launch_bounds__(kThreads)
    PrefillAttentionKernel(const T* __restrict__ q, const void* __restrict__ k_pool,
                           const void* __restrict__ v_pool, const int32_t* __restrict__ positions,
                           const int32_t* __restrict__ slots, T* __restrict__ out, int rows,
                           int num_heads, int num_kv_heads, int head_dim, Kv kv, float scale,
                           int window) {
  const T* __restrict__ k_cache = static_cast<const T*>(k_pool);
  const T* __restrict__ v_cache = static_cast<const T*>(v_pool);
  constexpr int kStride = kD + 8;  // 16-byte row padding: ldmatrix rows fall in distinct banks
  constexpr int kTileElems = kKeys * kStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);  // (kRows, kStride)
  T* kv_s = q_s + kRows * kStride;          // 2 stages of K then V, (kKeys, kStride) each
  __shared__ int pos_s[kRows], slot_s[kRows];
  __shared__ uint32_t starts[kRows / 32];

  AllowDependentLaunch();
  const int h = blockIdx.x;
  // Later row tiles see more keys: they start first.
  const int row0 = (gridDim.y - 1 - blockIdx.y) * kRows;
  const int n_rows = min(kRows, rows - row0);
  const int kvh = h / (num_heads / num_kv_heads);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, tq = lane & 3;  // mma fragment row group and column pair

  // Zero every padding column and the rows past the last, so that the products see zeros.
  for (int i = threadIdx.x; i < kRows + 4 * kKeys; i += kThreads) {
    T* row = q_s + i * kStride;
    const bool q_row_missing = i < kRows && i >= n_rows;
    for (int c = q_row_missing ? 0 : head_dim; c < kStride; ++c) row[c] = FromF<T>(0.0f);
  }
  WaitForPrerequisites();  // q and the cache rows come from the previous kernel
  for (int i = threadIdx.x; i < kRows; i += kThreads) {
    pos_s[i] = i < n_rows ? positions[row0 + i] : -1;
    slot_s[i] = i < n_rows ? slots[row0 + i] : -1;
  }
  const size_t q_stride = static_cast<size_t>(num_heads) * head_dim;
  const RowWalk walk(head_dim, kVec / 2);
  LoadRows<T, kStride, kVec, kRows>(q_s, q + row0 * q_stride + static_cast<size_t>(h) * head_dim,
                                    q_stride, n_rows, walk);
  CpAsyncCommit();
  __syncthreads();  // pos_s and slot_s
  static_assert(kThreads >= kRows);
  MarkSegmentStarts<kRows>(pos_s, slot_s, n_rows, starts);
  CpAsyncWait<0>();
  __syncthreads();

  const float scale2 = scale * kv.KScale() * kLog2e;  // scores in log2 units
  // This thread's rows: m-tile mt (16 rows) of the warp's kMt, fragment rows g and g + 8.
  int my_row[kMt][2];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
    my_row[mt][0] = warp * kWarpRows + mt * 16 + g;
    my_row[mt][1] = my_row[mt][0] + 8;
  }
  // Where this lane's ldmatrix reads its Q rows of m-tile 0 (m-tile mt: 16 * mt rows on).
  const T* q_frag =
      q_s + (warp * kWarpRows + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + (lane >> 4) * 8;

  // Segments of the tile, one after the other.
  for (int seg0 = 0; seg0 < n_rows;) {
    const int slot = slot_s[seg0];
    const int seg1 = min(NextSegmentStart<kRows>(starts, seg0), n_rows);
    const int first_pos = pos_s[seg0], last_pos = pos_s[seg1 - 1];
    const int key_lo = window > 0 ? max(0, first_pos - window + 1) : 0;
    const int tile_lo = key_lo / kKeys * kKeys;
    const int n_tiles = (last_pos - tile_lo) / kKeys + 1;

    // This thread's rows: position (keys <= pos visible) and first visible key; -1 / 0 for rows
    // outside the segment.
    int row_pos[kMt][2], row_lo[kMt][2];
    // This warp's rows in the segment: the keys they may see (from warp_lo to warp_hi), and the
    // keys all of them see (from all_lo to all_hi), where tiles need no mask.
    int warp_hi = -1, warp_lo = INT_MAX, all_hi = INT_MAX, all_lo = INT_MIN;
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = my_row[mt][i];
        const bool in = r >= seg0 && r < seg1;
        row_pos[mt][i] = in ? pos_s[r] : -1;
        row_lo[mt][i] = in && window > 0 ? pos_s[r] - window + 1 : 0;
        if (!in) continue;
        warp_hi = max(warp_hi, row_pos[mt][i]);
        warp_lo = min(warp_lo, row_lo[mt][i]);
        all_hi = min(all_hi, row_pos[mt][i]);
        all_lo = max(all_lo, row_lo[mt][i]);
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      warp_hi = max(warp_hi, __shfl_xor_sync(0xffffffffu, warp_hi, o));
      warp_lo = min(warp_lo, __shfl_xor_sync(0xffffffffu, warp_lo, o));
      all_hi = min(all_hi, __shfl_xor_sync(0xffffffffu, all_hi, o));
      all_lo = max(all_lo, __shfl_xor_sync(0xffffffffu, all_lo, o));
    }

    float o_acc[kMt][kD / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
      for (int nb = 0; nb < kD / 8; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o_acc[mt][nb][e] = 0.0f;
      }
    }
    float m[kMt][2], l[kMt][2];
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
      m[mt][0] = m[mt][1] = -INFINITY;
      l[mt][0] = l[mt][1] = 0.0f;
    }

    const size_t head_base = Kv::kPaged ? 0 : kv.Offset(slot, kvh, 0);
    auto load_tile = [&](int it) {
      const int t0 = tile_lo + it * kKeys;
      T* ks = kv_s + (it & 1) * 2 * kTileElems;
      if constexpr (kCodes) {
        LoadPagedCodeRows<T, kStride, kVec, kKeys>(ks, static_cast<const uint8_t*>(k_pool), kv,
                                                   slot, kvh, t0, key_lo, last_pos, walk);
        LoadPagedCodeRows<T, kStride, kVec, kKeys>(ks + kTileElems,
                                                   static_cast<const uint8_t*>(v_pool), kv, slot,
                                                   kvh, t0, key_lo, last_pos, walk);
      } else if constexpr (Kv::kPaged) {
        LoadPagedRows<T, kStride, kVec, kKeys>(ks, k_cache, kv, slot, kvh, t0, key_lo, last_pos,
                                               walk);
        LoadPagedRows<T, kStride, kVec, kKeys>(ks + kTileElems, v_cache, kv, slot, kvh, t0, key_lo,
                                               last_pos, walk);
      } else {
        const size_t off = head_base + static_cast<size_t>(t0) * head_dim;
        LoadRows<T, kStride, kVec, kKeys>(ks, k_cache + off, head_dim, kKeys, walk);
        LoadRows<T, kStride, kVec, kKeys>(ks + kTileElems, v_cache + off, head_dim, kKeys, walk);
      }
      CpAsyncCommit();
    };
    load_tile(0);
    for (int it = 0; it < n_tiles; ++it) {
      if (it + 1 < n_tiles) {
        load_tile(it + 1);
        CpAsyncWait<1>();
      } else {
        CpAsyncWait<0>();
      }
      __syncthreads();
      const int t0 = tile_lo + it * kKeys;
      const T* ks = kv_s + (it & 1) * 2 * kTileElems;
      const T* vs = ks + kTileElems;
      if (warp_hi >= t0 && warp_lo < t0 + kKeys) {
        // S (kMt x 16 rows x 64 keys) = Q · Kᵀ: each K fragment serves every m-tile; the Q
        // fragments are read from shared memory again per tile (registers hold O and S).
        float s[kMt][kKeys / 8][4];
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
          for (int nb = 0; nb < kKeys / 8; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nb][e] = 0.0f;
          }
        }
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
          uint32_t qa[kMt][4];
#pragma unroll
          for (int mt = 0; mt < kMt; ++mt) LdMatrixX4(qa[mt], q_frag + mt * 16 * kStride + kk * 16);
#pragma unroll
          for (int nb = 0; nb < kKeys / 8; nb += 2) {
            uint32_t b[4];
            const int key = nb * 8 + (lane & 7) + (lane >> 4) * 8;
            const int c = kk * 16 + ((lane >> 3) & 1) * 8;
            LdMatrixX4(b, ks + key * kStride + c);
#pragma unroll
            for (int mt = 0; mt < kMt; ++mt) {
              Mma<T>(s[mt][nb], qa[mt], b[0], b[1]);
              Mma<T>(s[mt][nb + 1], qa[mt], b[2], b[3]);
            }
          }
        }
        // Mask (only where some key of the tile is hidden from some row of the warp), then the
        // online softmax of each row; S turns into P in place.
        const bool unmasked = t0 + kKeys - 1 <= all_hi && t0 >= all_lo;
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {
          float mx[2] = {-INFINITY, -INFINITY};
          if (unmasked) {
#pragma unroll
            for (int nb = 0; nb < kKeys / 8; ++nb) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                s[mt][nb][e] *= scale2;
                mx[e >> 1] = fmaxf(mx[e >> 1], s[mt][nb][e]);
              }
            }
          } else {
#pragma unroll
            for (int nb = 0; nb < kKeys / 8; ++nb) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int i = e >> 1, key = t0 + nb * 8 + tq * 2 + (e & 1);
                const bool visible = key <= row_pos[mt][i] && key >= row_lo[mt][i];
                s[mt][nb][e] = visible ? s[mt][nb][e] * scale2 : -INFINITY;
                mx[i] = fmaxf(mx[i], s[mt][nb][e]);
              }
            }
          }
          float corr[2], base[2];
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            const float m_new = fmaxf(m[mt][i], mx[i]);
            base[i] = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing visible yet
            corr[i] = exp2f(m[mt][i] - base[i]);
            m[mt][i] = m_new;
            l[mt][i] *= corr[i];
          }
#pragma unroll
          for (int nb = 0; nb < kD / 8; ++nb) {
            o_acc[mt][nb][0] *= corr[0];
            o_acc[mt][nb][1] *= corr[0];
            o_acc[mt][nb][2] *= corr[1];
            o_acc[mt][nb][3] *= corr[1];
          }
#pragma unroll
          for (int nb = 0; nb < kKeys / 8; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nb][e] = exp2f(s[mt][nb][e] - base[e >> 1]);
            l[mt][0] += s[mt][nb][0] + s[mt][nb][1];
            l[mt][1] += s[mt][nb][2] + s[mt][nb][3];
          }
        }
        // O += P · V: per 16 keys, P of every m-tile as A fragments; each V fragment serves all.
#pragma unroll
        for (int kk = 0; kk < kKeys / 16; ++kk) {
          uint32_t pa[kMt][4];
#pragma unroll
          for (int mt = 0; mt < kMt; ++mt) {
            pa[mt][0] = Pack<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
            pa[mt][1] = Pack<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
            pa[mt][2] = Pack<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
            pa[mt][3] = Pack<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
          }
#pragma unroll
          for (int nb = 0; nb < kD / 8; nb += 2) {
            uint32_t b[4];
            const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            const int c = nb * 8 + (lane >> 4) * 8;
            LdMatrixX4Trans(b, vs + key * kStride + c);
#pragma unroll
            for (int mt = 0; mt < kMt; ++mt) {
              Mma<T>(o_acc[mt][nb], pa[mt], b[0], b[1]);
              Mma<T>(o_acc[mt][nb + 1], pa[mt], b[2], b[3]);
            }
          }
        }
      }
      __syncthreads();  // the stage is free for the load two tiles on
    }

    // Row sums over the quad, then this segment's rows out.
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float li = l[mt][i];
        li += __shfl_xor_sync(0xffffffffu, li, 1);
        li += __shfl_xor_sync(0xffffffffu, li, 2);
        if (row_pos[mt][i] < 0) continue;
        const float inv = kCodes ? kv.VScale() / li : 1.0f / li;
        T* o = out + (row0 + my_row[mt][i]) * q_stride + static_cast<size_t>(h) * head_dim;
#pragma unroll
        for (int nb = 0; nb < kD / 8; ++nb) {
          const int c = nb * 8 + tq * 2;
          if (c < head_dim) {
            *reinterpret_cast<uint32_t*>(o + c) =
                Pack<T>(o_acc[mt][nb][2 * i] * inv, o_acc[mt][nb][2 * i + 1] * inv);
          }
        }
      }
    }
    seg0 = seg1;
  }
}

template <typename T, int kD, int kVec, typename Kv>
absl::Status Launch(const void* q, const void* k_cache, const void* v_cache,
                    const int32_t* positions, const int32_t* slots, void* out, int rows,
                    int num_heads, int num_kv_heads, int head_dim, Kv kv,
                    const AttentionParams& params, cudaStream_t stream, bool pdl) {
  constexpr size_t kSmem = (kRows + 4 * kKeys) * (kD + 8) * sizeof(T);  // Q, and K and V twice
  auto run = [&](auto* kernel) -> absl::Status {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kSmem)));
    const dim3 grid(num_heads, (rows + kRows - 1) / kRows);
    CUDA_CHECK(LaunchKernel(kernel, grid, dim3(kThreads), kSmem, stream, pdl,
                            static_cast<const T*>(q), k_cache, v_cache, positions, slots,
                            static_cast<T*>(out), rows, num_heads, num_kv_heads, head_dim, kv,
                            params.scale, params.window));
    CUDA_CHECK_LAUNCH();
    return absl::OkStatus();
  };
  if constexpr (Kv::kPaged) {
    if (kv.fp8) return run(PrefillAttentionKernel<T, kD, kVec, Kv, true>);
  }
  return run(PrefillAttentionKernel<T, kD, kVec, Kv>);
}

// The mma.sync kernel compiled for head_dim's padded size.
template <typename Kv>
absl::Status LaunchMmaSync(DType dtype, const void* q, const void* k_cache, const void* v_cache,
                           const int32_t* positions, const int32_t* slots, void* out, int rows,
                           int num_heads, int num_kv_heads, int head_dim, Kv kv,
                           const AttentionParams& params, cudaStream_t stream, bool pdl) {
  const int d = PaddedDim(head_dim);
  TANDEM_DISPATCH_HALF(dtype, {
    switch (d) {
      case 64:
        return Launch<T, 64, 16>(q, k_cache, v_cache, positions, slots, out, rows, num_heads,
                                 num_kv_heads, head_dim, kv, params, stream, pdl);
      case 80:
        return Launch<T, 80, 16>(q, k_cache, v_cache, positions, slots, out, rows, num_heads,
                                 num_kv_heads, head_dim, kv, params, stream, pdl);
      case 96:
        return Launch<T, 96, 16>(q, k_cache, v_cache, positions, slots, out, rows, num_heads,
                                 num_kv_heads, head_dim, kv, params, stream, pdl);
      case 112:
        if (head_dim % 8 == 0) {
          return Launch<T, 112, 16>(q, k_cache, v_cache, positions, slots, out, rows, num_heads,
                                    num_kv_heads, head_dim, kv, params, stream, pdl);
        }
        return Launch<T, 112, 8>(q, k_cache, v_cache, positions, slots, out, rows, num_heads,
                                 num_kv_heads, head_dim, kv, params, stream, pdl);
      default:
        return Launch<T, 128, 16>(q, k_cache, v_cache, positions, slots, out, rows, num_heads,
                                  num_kv_heads, head_dim, kv, params, stream, pdl);
    }
  });
  return absl::OkStatus();
}

// The checks both layouts share; `capacity` is the slot's capacity, or 0 for pages.
absl::Status CheckPrefill(int num_heads, int num_kv_heads, int head_dim, int capacity,
                          const AttentionParams& params) {
  if (!PrefillAttentionSupported(head_dim) || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 ||
      capacity % kKeys != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill attention: unsupported shape (head_dim ", head_dim,
                     " must be a multiple of 8 up to 128, or 100 or 108; heads ", num_heads,
                     " a multiple of kv heads ", num_kv_heads, "; seq capacity ", capacity,
                     " a multiple of ", kKeys, ")"));
  }
  if (params.window < 0 || !(params.scale > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("prefill attention: window ", params.window,
                                                   " must be >= 0 and scale ", params.scale,
                                                   " positive"));
  }
  return absl::OkStatus();
}

}  // namespace

bool PrefillAttentionSupported(int head_dim) {
  const int d = PaddedDim(head_dim);
  return head_dim > 0 && d > 0 && (head_dim % 8 == 0 || (d == 112 && head_dim % 4 == 0));
}

absl::Status LaunchPrefillAttention(DType dtype, const void* q, const void* k_cache,
                                    const void* v_cache, const int32_t* positions,
                                    const int32_t* slots, void* out, int rows, int num_heads,
                                    int num_kv_heads, int head_dim, int seq_capacity,
                                    const AttentionParams& params, cudaStream_t stream, bool pdl) {
  if (rows == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckPrefill(num_heads, num_kv_heads, head_dim, seq_capacity, params));
  if (PrefillAttentionSm90Usable(head_dim, q, k_cache, v_cache)) {
    return LaunchPrefillAttentionSm90(dtype, q, k_cache, v_cache, positions, slots, out, rows,
                                      num_heads, num_kv_heads, head_dim, seq_capacity, params,
                                      stream, pdl);
  }
  return LaunchMmaSync(dtype, q, k_cache, v_cache, positions, slots, out, rows, num_heads,
                       num_kv_heads, head_dim, SlotKv{num_kv_heads, seq_capacity, head_dim},
                       params, stream, pdl);
}

absl::Status LaunchPrefillAttentionPaged(DType dtype, const void* q, const KvPages& pages,
                                         const int32_t* positions, const int32_t* seqs, void* out,
                                         int rows, int num_heads, int num_kv_heads, int head_dim,
                                         const AttentionParams& params, cudaStream_t stream,
                                         bool pdl) {
  if (rows == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckKvPages(pages, head_dim, "paged prefill attention"));
  RETURN_IF_ERROR(CheckPrefill(num_heads, num_kv_heads, head_dim, 0, params));
  // FP8 codes: the mma.sync kernel, which converts them as it stages the tiles.
  if (!pages.fp8 && pages.page_size >= kMinSm90PageSize &&
      PrefillAttentionSm90Usable(head_dim, q, pages.k, pages.v)) {
    return LaunchPrefillAttentionSm90Paged(dtype, q, pages, positions, seqs, out, rows, num_heads,
                                           num_kv_heads, head_dim, params, stream, pdl);
  }
  return LaunchMmaSync(dtype, q, pages.k, pages.v, positions, seqs, out, rows, num_heads,
                       num_kv_heads, head_dim, ToPagedKv(pages, num_kv_heads, head_dim), params,
                       stream, pdl);
}

}  // namespace tandem::cuda
