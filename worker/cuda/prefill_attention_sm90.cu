// Prefill attention for Hopper (sm_90a) with warpgroup MMA, head_dim 64 and 128: the same rows,
// segments and KV-cache layout as prefill_attention.cu, in the manner of FlashAttention-3.
//
// A block takes 128 consecutive query rows of one head and has three roles: warpgroups 0 and 1
// (consumers) own 64 query rows each, and warpgroup 2 (the producer, one thread of it; the others
// give their registers to the consumers with setmaxnreg) loads. The producer brings Q once and then
// K and V tiles of 128 keys into a three-stage ring with TMA (cp.async.bulk.tensor, 128-byte
// swizzle, completion counted in bytes on an mbarrier per stage and operand). A consumer
// computes S = Q·Kᵀ (wgmma m64n128k16, Q and K from shared memory through matrix descriptors),
// masks (only tiles that some row of the warpgroup does not wholly see), runs the online softmax in
// fp32 registers, adds P·V into O (wgmma m64nDk16 with P from registers, V from shared memory read
// transposed),
// and hands the stage back through its "empty" mbarrier. Within a warpgroup, S of the next tile and
// P·V of this one are issued together, and the softmax of the next tile runs while P·V does; the
// two warpgroups take turns at issuing (named barriers), so that one's softmax overlaps the other's
// products. Segments (runs of one slot at consecutive positions) are walked by every role in the
// same order, so that the ring's stages and phases agree.
//
// The paged cache (kv_pages.h) takes the same kernel: only the producer differs, loading each tile
// as 128 / page_size boxes of one page each (pages of 8 positions or more, so that every box starts
// on a 1024-byte swizzle atom and the tile's layout in shared memory is the contiguous one's).
//
// Compiled for sm_90a only (wgmma and setmaxnreg need the architecture-specific target);
// LaunchPrefillAttention calls it where the device is of compute capability 9.0.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/device_util.cuh"
#include "worker/cuda/prefill_attention_sm90.h"

namespace tandem::cuda {
namespace {

constexpr int kMaxD = 128;     // largest head_dim (64 and 128 are compiled)
constexpr int kRows = 128;     // query rows per block
constexpr int kWgRows = 64;    // query rows per consumer warpgroup
constexpr int kKeys = 128;     // keys per K/V tile
constexpr int kStages = 3;     // K/V ring depth
constexpr int kHalfCols = 64;  // head_dim columns per 128-byte swizzled half of a tile
constexpr int kConsumerWarps = 8;
constexpr int kThreads = kConsumerWarps * 32 + 128;  // two consumer warpgroups and the producer's
// Registers per thread: the producer warpgroup gives most of its share to the consumers, which
// hold S, P and O (64 + 32 + 64 per thread) at once.
constexpr int kProducerRegisters = 24;
constexpr int kConsumerRegisters = 240;
constexpr float kLog2e = 1.4426950408889634f;

// Shared-memory layout (bytes from a 1024-byte aligned base; every tile is two halves of
// (rows, 64 columns) with 128-byte rows, as the TMA box writes them).
constexpr int kHalfBytes = 128 * kHalfCols * 2;  // 128 rows (or keys) of one half: 16 KB
constexpr int kQOffset = 0;
constexpr int kStageOffset = 2 * kHalfBytes;  // K then V of stage 0, then of stage 1
constexpr int kStageBytes = 4 * kHalfBytes;
constexpr int kTileBytes = 2 * kHalfBytes;  // room for one K (or V) tile of head_dim 128
constexpr int kBarrierOffset = kStageOffset + kStages * kStageBytes;
constexpr int kBarrierBytes = 8 * (1 + 3 * kStages);  // Q's, then K, V and empty per stage
constexpr int kStartsOffset = kBarrierOffset + kBarrierBytes;  // the segment starts' 4 words
constexpr int kSmemBytes = kStartsOffset + 16 + 1024;           // and alignment slack

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarriers ----
__device__ __forceinline__ void BarrierInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void BarrierExpectBytes(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void BarrierArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void BarrierWait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}

// ---- TMA: a (64 columns, 128 rows) box into shared memory, bytes counted on `bar` ----
__device__ __forceinline__ void TmaLoad2d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], [%4];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void TmaLoad3d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                          int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4}], [%5];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// ---- warpgroup MMA ----
// Shared-memory matrix descriptor with 128-byte swizzle: start address, leading and stride byte
// offsets (all in 16-byte units).
__device__ __forceinline__ uint64_t Descriptor(uint32_t addr, uint32_t lead, uint32_t stride) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | static_cast<uint64_t>(lead >> 4) << 16 |
         static_cast<uint64_t>(stride >> 4) << 32 | 1ull << 62;
}
__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending committed groups of this warpgroup's MMAs are still running.
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving reads or writes of the accumulators across an asynchronous MMA.
template <int kN>
__device__ __forceinline__ void FenceAccumulators(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define TANDEM_ACC8(i)                                                                        \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define TANDEM_ACC64                                                                 \
  TANDEM_ACC8(0), TANDEM_ACC8(8), TANDEM_ACC8(16), TANDEM_ACC8(24), TANDEM_ACC8(32), \
      TANDEM_ACC8(40), TANDEM_ACC8(48), TANDEM_ACC8(56)
#define TANDEM_ACC32 TANDEM_ACC8(0), TANDEM_ACC8(8), TANDEM_ACC8(16), TANDEM_ACC8(24)
#define TANDEM_ACC32_LIST                                                                   \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23," \
  "%24,%25,%26,%27,%28,%29,%30,%31}"
#define TANDEM_ACC_LIST                                                                      \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"  \
  "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45," \
  "%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
// d (64 x 128, fp32) (+)= A (64 x 16, shared, K-major) · B (16 x 128, shared, K-major).
#define TANDEM_WGMMA_SS(TY)                                                        \
  asm volatile(                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                 \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " TANDEM_ACC_LIST \
      ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                            \
      : TANDEM_ACC64                                                               \
      : "l"(a), "l"(b), "r"(accumulate))
// d (64 x 128, fp32) += A (64 x 16, registers) · B (16 x 128, shared, N-major: read transposed).
#define TANDEM_WGMMA_RS(TY)                                                        \
  asm volatile(                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                 \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " TANDEM_ACC_LIST \
      ", {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"                                 \
      : TANDEM_ACC64                                                               \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))

// d (64 x 64, fp32) += A (64 x 16, registers) · B (16 x 64, shared, N-major: read transposed).
#define TANDEM_WGMMA_RS64(TY)                                                       \
  asm volatile(                                                                     \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                  \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " TANDEM_ACC32_LIST \
      ", {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"                                  \
      : TANDEM_ACC32                                                                \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))

template <typename T>
__device__ __forceinline__ void WgmmaSS(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  if constexpr (std::is_same_v<T, __half>) {
    TANDEM_WGMMA_SS("f16");
  } else {
    TANDEM_WGMMA_SS("bf16");
  }
}
template <typename T>
__device__ __forceinline__ void WgmmaRS(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (std::is_same_v<T, __half>) {
    TANDEM_WGMMA_RS("f16");
  } else {
    TANDEM_WGMMA_RS("bf16");
  }
}
template <typename T>
__device__ __forceinline__ void WgmmaRS(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (std::is_same_v<T, __half>) {
    TANDEM_WGMMA_RS64("f16");
  } else {
    TANDEM_WGMMA_RS64("bf16");
  }
}

// One segment of the block's rows (one slot, consecutive positions) and its K/V tiles.
struct Segment {
  int row0, row1;  // block rows [row0, row1)
  int slot;
  int tile_lo;  // first key of the first tile
  int n_tiles;
  int key_lo, key_hi;  // the keys some row of the segment sees
};

__device__ __forceinline__ Segment NextSegment(int row0, int n_rows, const int* pos_s,
                                               const int* slot_s, const uint32_t* starts,
                                               int window) {
  Segment s;
  s.row0 = row0;
  s.slot = slot_s[row0];
  const int r = min(NextSegmentStart<kRows>(starts, row0), n_rows);
  s.row1 = r;
  const int first_pos = pos_s[row0], last_pos = pos_s[r - 1];
  const int key_lo = window > 0 ? max(0, first_pos - window + 1) : 0;
  s.tile_lo = key_lo / kKeys * kKeys;
  s.n_tiles = (last_pos - s.tile_lo) / kKeys + 1;
  s.key_lo = key_lo;
  s.key_hi = last_pos;
  return s;
}

struct Ring {
  uint32_t k_full, v_full, empty;  // barrier addresses of stage 0 (stage s: + 8 * s)
  int n = 0;                       // tiles through the ring so far
  __device__ int stage() const { return n % kStages; }
  __device__ uint32_t parity() const { return (n / kStages) & 1; }
};

// Where the paged cache's tiles come from: table null for the contiguous cache.
struct PageTable {
  const int32_t* table;  // (sequences, stride) page ids; a segment's slot is its table row
  int stride;
  int page_shift;  // page size 1 << page_shift, >= 8
};

// One K or V tile half from pages: boxes of min(page size, kKeys) keys, each from the page of its
// first key, a key outside [key_lo, key_hi] (masked by the consumers) taken from the page of the
// nearest visible key so that only the table entries of visible keys are read.
__device__ __forceinline__ void LoadPagedHalf(uint32_t dst, const CUtensorMap* map, int half,
                                              int t0, const Segment& seg, int kvh,
                                              int num_kv_heads, const PageTable& pt,
                                              uint32_t bar) {
  const int page_size = 1 << pt.page_shift;
  const int box = min(page_size, kKeys);
  const int32_t* row = pt.table + static_cast<size_t>(seg.slot) * pt.stride;
  for (int j = 0; j < kKeys; j += box) {
    const int key = min(max(t0 + j, seg.key_lo), seg.key_hi);
    const int page = __ldg(row + (key >> pt.page_shift));
    TmaLoad3d(dst + j * kHalfCols * 2, map, half * kHalfCols, (t0 + j) & (page_size - 1),
              page * num_kv_heads + kvh, bar);
  }
}

// The producer's one thread: Q once, then every segment's K and V tiles, in 64-column halves.
template <int kD>
__device__ void Produce(const CUtensorMap* q_map, const CUtensorMap* k_map,
                        const CUtensorMap* v_map, uint32_t smem, uint32_t q_full, Ring ring,
                        int row0, int n_rows, int h, int kvh, int num_kv_heads, const int* pos_s,
                        const int* slot_s, const uint32_t* starts, int window,
                        const PageTable& pt) {
  constexpr int kHalves = kD / kHalfCols;
  BarrierExpectBytes(q_full, kHalves * kHalfBytes);
  for (int half = 0; half < kHalves; ++half) {
    TmaLoad2d(smem + kQOffset + half * kHalfBytes, q_map, h * kD + half * kHalfCols, row0, q_full);
  }
  for (int r = 0; r < n_rows;) {
    const Segment seg = NextSegment(r, n_rows, pos_s, slot_s, starts, window);
    const int head = seg.slot * num_kv_heads + kvh;
    for (int it = 0; it < seg.n_tiles; ++it, ++ring.n) {
      const int st = ring.stage();
      BarrierWait(ring.empty + 8 * st, ring.parity() ^ 1);
      const uint32_t k_s = smem + kStageOffset + st * kStageBytes, v_s = k_s + kTileBytes;
      const int t0 = seg.tile_lo + it * kKeys;
      BarrierExpectBytes(ring.k_full + 8 * st, kHalves * kHalfBytes);
      for (int half = 0; half < kHalves; ++half) {
        if (pt.table != nullptr) {
          LoadPagedHalf(k_s + half * kHalfBytes, k_map, half, t0, seg, kvh, num_kv_heads, pt,
                        ring.k_full + 8 * st);
        } else {
          TmaLoad3d(k_s + half * kHalfBytes, k_map, half * kHalfCols, t0, head,
                    ring.k_full + 8 * st);
        }
      }
      BarrierExpectBytes(ring.v_full + 8 * st, kHalves * kHalfBytes);
      for (int half = 0; half < kHalves; ++half) {
        if (pt.table != nullptr) {
          LoadPagedHalf(v_s + half * kHalfBytes, v_map, half, t0, seg, kvh, num_kv_heads, pt,
                        ring.v_full + 8 * st);
        } else {
          TmaLoad3d(v_s + half * kHalfBytes, v_map, half * kHalfCols, t0, head,
                    ring.v_full + 8 * st);
        }
      }
    }
    r = seg.row1;
  }
}

// A consumer thread's state over one segment: its two rows (fragment rows g and g + 8 of its
// warp's 16), the online-softmax running max and sum, and O.
template <int kD>
struct RowState {
  int pos[2], lo[2];  // visible keys [lo, pos]; pos -1 for a row outside the segment
  float m[2], l[2];
  float o[kD / 2];
};

__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Scores of keys a row may not see (outside [lo, pos]) to -infinity, on a tile at key t0.
template <int kD>
__device__ __forceinline__ void Mask(float (&s)[64], const RowState<kD>& rs, int t0, int tq) {
#pragma unroll
  for (int nb = 0; nb < kKeys / 8; ++nb) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = e >> 1, key = t0 + nb * 8 + tq * 2 + (e & 1);
      if (key > rs.pos[i] || key < rs.lo[i]) s[nb * 4 + e] = -INFINITY;
    }
  }
}

// S (64 x 128 keys, fp32, unscaled) of the tile at key t0 into probabilities in place, relative
// to the new running max: masks what `rs` may not see (unless the whole tile is visible),
// updates m (unscaled) and l, and returns in `corr` the factor that takes O from the old max to
// the new one.
template <int kD>
__device__ __forceinline__ void Softmax(float (&s)[64], RowState<kD>& rs, int t0, bool unmasked,
                                        float scale2, int tq, float (&corr)[2]) {
  if (!unmasked) Mask(s, rs, t0, tq);
  // Row maxima and sums over 8 partial results each, so that the reductions are not one chain of
  // dependent instructions.
  constexpr int kParts = 8;
  float part[2][kParts];
#pragma unroll
  for (int k = 0; k < kParts; ++k) part[0][k] = part[1][k] = -INFINITY;
#pragma unroll
  for (int j = 0; j < 64; ++j) {
    float& m = part[(j >> 1) & 1][((j >> 2) * 2 + (j & 1)) % kParts];
    m = fmaxf(m, s[j]);
  }
  float mx[2], base[2];  // base: the new max in log2 units
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int w = kParts / 2; w > 0; w /= 2) {
#pragma unroll
      for (int k = 0; k < w; ++k) part[i][k] = fmaxf(part[i][k], part[i][k + w]);
    }
    mx[i] = fmaxf(rs.m[i], part[i][0]);
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    base[i] = mx[i] == -INFINITY ? 0.0f : mx[i] * scale2;  // a row with nothing visible yet
    corr[i] = Exp2(rs.m[i] * scale2 - base[i]);
    rs.m[i] = mx[i];
  }
#pragma unroll
  for (int k = 0; k < kParts; ++k) part[0][k] = part[1][k] = 0.0f;
#pragma unroll
  for (int j = 0; j < 64; ++j) {
    const int i = (j >> 1) & 1;
    s[j] = Exp2(fmaf(s[j], scale2, -base[i]));
    part[i][((j >> 2) * 2 + (j & 1)) % kParts] += s[j];
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int w = kParts / 2; w > 0; w /= 2) {
#pragma unroll
      for (int k = 0; k < w; ++k) part[i][k] += part[i][k + w];
    }
    rs.l[i] = rs.l[i] * corr[i] + part[i][0];
  }
}

template <typename T>
__device__ __forceinline__ void ToOperand(const float (&s)[64], uint32_t (&p)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) p[i] = Pack<T>(s[2 * i], s[2 * i + 1]);
}

template <int kN>
__device__ __forceinline__ void Rescale(float (&o)[kN], const float (&corr)[2]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) o[i] *= corr[(i >> 1) & 1];
}

// The keys that rows of a warpgroup see within a segment, and the stage ring as it walks tiles.
struct WarpgroupTiles {
  uint32_t smem;
  Ring ring;
  int tile_lo;
  int all_lo, all_hi;  // keys every row of the warpgroup in the segment sees
  float scale2;
  int tq;

  __device__ uint32_t k_tile(int n) const {
    return smem + kStageOffset + (n % kStages) * kStageBytes;
  }
  __device__ int key0(int it) const { return tile_lo + it * kKeys; }
  __device__ bool unmasked(int it) const {
    return key0(it) + kKeys - 1 <= all_hi && key0(it) >= all_lo;
  }
  // Issues S = Q·Kᵀ of ring tile n for warpgroup `wg` (not waited for).
  template <typename T, int kD>
  __device__ void IssueScores(float (&s)[64], int n, int wg) const {
    const uint32_t k_s = k_tile(n);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t col = (kk / 4) * kHalfBytes + (kk % 4) * 32;
      const uint64_t a = Descriptor(smem + kQOffset + wg * kWgRows * 128 + col, 16, 1024);
      WgmmaSS<T>(s, a, Descriptor(k_s + col, 16, 1024), kk);
    }
    WgmmaCommit();
  }
  // Issues O += P·V of ring tile n (not waited for).
  template <typename T, int kN>
  __device__ void IssueValues(float (&o)[kN], const uint32_t (&p)[32], int n) const {
    const uint32_t v_s = k_tile(n) + kTileBytes;
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint32_t a[4] = {p[kk * 4], p[kk * 4 + 1], p[kk * 4 + 2], p[kk * 4 + 3]};
      WgmmaRS<T>(o, a, Descriptor(v_s + kk * 16 * 128, kHalfBytes, 1024));
    }
    WgmmaCommit();
  }
  __device__ uint32_t parity(int n) const { return (n / kStages) & 1; }
  __device__ void WaitK(int n) const { BarrierWait(ring.k_full + 8 * (n % kStages), parity(n)); }
  __device__ void WaitV(int n) const { BarrierWait(ring.v_full + 8 * (n % kStages), parity(n)); }
  __device__ void Release(int n) const {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) BarrierArrive(ring.empty + 8 * (n % kStages));
  }
  // A tile this warpgroup does not need: waited for and handed back.
  __device__ void Skip(int n) const {
    WaitK(n);
    WaitV(n);
    Release(n);
  }
};

// Turns of the two consumer warpgroups at issuing MMAs (named barriers 1 and 2, 256 threads), so
// that one's softmax runs while the other's products do. Only where both walk the same tiles of a
// segment, so that their turns pair up.
struct Turns {
  bool on;
  int wg;
  __device__ void Begin() const {
    if (on && wg == 1) asm volatile("bar.arrive 1, 256;\n" ::: "memory");  // warpgroup 0 first
  }
  __device__ void Take() const {
    if (on) asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory");
  }
  // Hands the turn to the other warpgroup; warpgroup 1's last turn is handed to no one.
  __device__ void Pass(bool last) const {
    if (on && !(last && wg == 1)) asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - wg) : "memory");
  }
};

// The warpgroup's tiles [a, b) of a segment (ring tile n0 + it for tile it): S of tile it + 1 is
// computed while P·V of tile it runs, and its softmax while P·V finishes.
template <typename T, int kD>
__device__ __forceinline__ void AttendTiles(const WarpgroupTiles& w, RowState<kD>& rs, int wg,
                                            int n0, int a, int b, Turns turns) {
  float s[64], corr[2];
  uint32_t p[32];
  turns.Begin();
  w.WaitK(n0 + a);
  turns.Take();
  w.IssueScores<T, kD>(s, n0 + a, wg);
  turns.Pass(false);
  WgmmaWait<0>();
  FenceAccumulators(s);
  Softmax(s, rs, w.key0(a), w.unmasked(a), w.scale2, w.tq, corr);
  ToOperand<T>(s, p);
  for (int it = a; it + 1 < b; ++it) {
    const int n = n0 + it;
    w.WaitK(n + 1);
    w.WaitV(n);
    turns.Take();
    w.IssueScores<T, kD>(s, n + 1, wg);
    w.IssueValues<T, kD / 2>(rs.o, p, n);
    turns.Pass(false);
    WgmmaWait<1>();
    FenceAccumulators(s);
    Softmax(s, rs, w.key0(it + 1), w.unmasked(it + 1), w.scale2, w.tq, corr);
    WgmmaWait<0>();
    FenceAccumulators(rs.o);
    w.Release(n);
    Rescale(rs.o, corr);
    ToOperand<T>(s, p);
  }
  w.WaitV(n0 + b - 1);
  turns.Take();
  w.IssueValues<T, kD / 2>(rs.o, p, n0 + b - 1);
  turns.Pass(true);
  WgmmaWait<0>();
  FenceAccumulators(rs.o);
  w.Release(n0 + b - 1);
}

// A warpgroup's rows within a segment (at consecutive positions): the tiles [a, b) that hold keys
// some of them see, and the keys [all_lo, all_hi] that all of them see.
struct WarpgroupRange {
  int a = 0, b = 0;
  int all_lo = 0, all_hi = -1;
};

__device__ __forceinline__ WarpgroupRange RangeOf(const Segment& seg, int wg, const int* pos_s,
                                                  int window) {
  WarpgroupRange r;
  const int first = max(seg.row0, wg * kWgRows), last = min(seg.row1, (wg + 1) * kWgRows) - 1;
  if (first > last) return r;
  const int hi = pos_s[last], lo = window > 0 ? pos_s[first] - window + 1 : 0;
  r.a = max(0, (lo - seg.tile_lo) / kKeys);
  r.b = min(seg.n_tiles, (hi - seg.tile_lo) / kKeys + 1);
  r.all_lo = window > 0 ? pos_s[last] - window + 1 : 0;
  r.all_hi = pos_s[first];
  return r;
}

// One consumer warpgroup (`wg`, 64 rows) over every segment of the block.
template <typename T, int kD>
__device__ void Consume(uint32_t smem, uint32_t q_full, Ring ring, int wg, int row0, int n_rows,
                        int h, T* out, size_t q_stride, const int* pos_s, const int* slot_s,
                        const uint32_t* starts,
                        float scale2, int window) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int g = lane >> 2, tq = lane & 3;
  const int my_row[2] = {wg * kWgRows + warp * 16 + g, wg * kWgRows + warp * 16 + g + 8};
  BarrierWait(q_full, 0);

  for (int r = 0; r < n_rows;) {
    const Segment seg = NextSegment(r, n_rows, pos_s, slot_s, starts, window);
    r = seg.row1;
    const WarpgroupRange mine = RangeOf(seg, wg, pos_s, window);
    const WarpgroupRange other = RangeOf(seg, 1 - wg, pos_s, window);
    const int a = mine.a, b = mine.b;
    const WarpgroupTiles w{smem, ring, seg.tile_lo, mine.all_lo, mine.all_hi, scale2, tq};
    RowState<kD> rs;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const bool in = my_row[i] >= seg.row0 && my_row[i] < seg.row1;
      rs.pos[i] = in ? pos_s[my_row[i]] : -1;
      rs.lo[i] = in && window > 0 ? pos_s[my_row[i]] - window + 1 : 0;
      rs.m[i] = -INFINITY;
      rs.l[i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) rs.o[i] = 0.0f;

    for (int it = 0; it < a; ++it) w.Skip(ring.n + it);
    if (a < b) AttendTiles<T, kD>(w, rs, wg, ring.n, a, b, Turns{a == other.a && b == other.b, wg});
    for (int it = max(a, b); it < seg.n_tiles; ++it) w.Skip(ring.n + it);
    ring.n += seg.n_tiles;

    // Row sums over the quad, then this segment's rows out.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float li = rs.l[i];
      li += __shfl_xor_sync(0xffffffffu, li, 1);
      li += __shfl_xor_sync(0xffffffffu, li, 2);
      if (rs.pos[i] < 0) continue;
      const float inv = 1.0f / li;
      T* o = out + (row0 + my_row[i]) * q_stride + static_cast<size_t>(h) * kD;
#pragma unroll
      for (int nb = 0; nb < kD / 8; ++nb) {
        *reinterpret_cast<uint32_t*>(o + nb * 8 + tq * 2) =
            Pack<T>(rs.o[nb * 4 + 2 * i] * inv, rs.o[nb * 4 + 2 * i + 1] * inv);
      }
    }
  }
}

// grid (num_heads, ceil(rows / kRows)), kThreads threads; kD: head_dim.
template <typename T, int kD>
__global__ void __launch_bounds__(kThreads, 1)
    PrefillAttentionSm90Kernel(const __grid_constant__ CUtensorMap q_map,
                               const __grid_constant__ CUtensorMap k_map,
                               const __grid_constant__ CUtensorMap v_map,
                               const int32_t* __restrict__ positions,
                               const int32_t* __restrict__ slots, T* __restrict__ out, int rows,
                               int num_heads, int num_kv_heads, float scale, int window,
                               PageTable pages) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Static shared memory stays at 1 KB: with the dynamic part aligned to 1 KB after it, more
  // would pass the 227 KB a block may have.
  __shared__ int pos_s[kRows], slot_s[kRows];
  const uint32_t smem = (SmemAddr(smem_raw) + 1023) & ~1023u;
  const uint32_t q_full = smem + kBarrierOffset;
  uint32_t* starts = reinterpret_cast<uint32_t*>(smem_raw + (smem - SmemAddr(smem_raw)) +
                                                 kStartsOffset);
  Ring ring;
  ring.k_full = q_full + 8;
  ring.v_full = ring.k_full + 8 * kStages;
  ring.empty = ring.v_full + 8 * kStages;

  AllowDependentLaunch();
  const int h = blockIdx.x;
  // Later row tiles see more keys: they start first.
  const int row0 = (gridDim.y - 1 - blockIdx.y) * kRows;
  const int n_rows = min(kRows, rows - row0);
  const int kvh = h / (num_heads / num_kv_heads);
  if (threadIdx.x == 0) {
    BarrierInit(q_full, 1);
    for (int st = 0; st < kStages; ++st) {
      BarrierInit(ring.k_full + 8 * st, 1);
      BarrierInit(ring.v_full + 8 * st, 1);
      BarrierInit(ring.empty + 8 * st, kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  WaitForPrerequisites();  // q and the cache rows come from the previous kernel
  for (int i = threadIdx.x; i < kRows; i += kThreads) {
    pos_s[i] = i < n_rows ? positions[row0 + i] : -1;
    slot_s[i] = i < n_rows ? slots[row0 + i] : -1;
  }
  __syncthreads();
  static_assert(kThreads >= kRows);
  MarkSegmentStarts<kRows>(pos_s, slot_s, n_rows, starts);
  __syncthreads();

  const int warp = threadIdx.x >> 5;
  if (warp >= kConsumerWarps) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegisters));
    if (threadIdx.x == kConsumerWarps * 32) {
      Produce<kD>(&q_map, &k_map, &v_map, smem, q_full, ring, row0, n_rows, h, kvh, num_kv_heads,
                  pos_s, slot_s, starts, window, pages);
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegisters));
    Consume<T, kD>(smem, q_full, ring, warp / 4, row0, n_rows, h, out,
                   static_cast<size_t>(num_heads) * kD, pos_s, slot_s, starts, scale * kLog2e,
                   window);
  }
#endif
}

// cuTensorMapEncodeTiled from the driver, found through the runtime (no link against libcuda).
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn EncodeTiled() {
  static const EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<EncodeTiledFn>(nullptr);
    }
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

// A tensor map of `rank` dimensions (innermost first; strides in bytes of dimensions 1 on) read in
// boxes of 64 columns x box_rows rows (x 1) with the 128-byte swizzle; rows past a dimension read
// as 0.
absl::Status MakeMap(CUtensorMap* map, DType dtype, const void* base, int rank,
                     const cuuint64_t* dims, const cuuint64_t* strides, const char* what,
                     cuuint32_t box_rows = 128) {
  const cuuint32_t box[3] = {kHalfCols, box_rows, 1}, unit[3] = {1, 1, 1};
  const CUresult r = EncodeTiled()(
      map,
      dtype == DType::kF16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
      rank, const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("prefill attention: cannot describe ", what,
                                            " for TMA (cuTensorMapEncodeTiled error ", r, ")"));
  }
  return absl::OkStatus();
}

// `pages` null: the contiguous cache of `seq_capacity` positions per slot; otherwise the pools
// k_cache and v_cache of pages->num_pages pages, `slots` being table rows.
template <typename T, int kD>
absl::Status Launch(DType dtype, const void* q, const void* k_cache, const void* v_cache,
                    const int32_t* positions, const int32_t* slots, void* out, int rows,
                    int num_heads, int num_kv_heads, int seq_capacity, const KvPages* pages,
                    const AttentionParams& params, cudaStream_t stream, bool pdl) {
  CUtensorMap q_map, k_map, v_map;
  const cuuint64_t q_dims[2] = {static_cast<cuuint64_t>(num_heads) * kD,
                                static_cast<cuuint64_t>(rows)};
  const cuuint64_t q_strides[1] = {static_cast<cuuint64_t>(num_heads) * kD * sizeof(T)};
  RETURN_IF_ERROR(MakeMap(&q_map, dtype, q, 2, q_dims, q_strides, "the queries"));
  PageTable pt{nullptr, 0, 0};
  if (pages == nullptr) {
    // The cache as (head_dim, seq_capacity, slot * kv_heads + kv_head): a tile reaching past a
    // head's capacity reads zeros. The slot count is not known here; the last dimension is only
    // an upper bound for the coordinates the kernel uses.
    const cuuint64_t c_dims[3] = {kD, static_cast<cuuint64_t>(seq_capacity), 1u << 24};
    const cuuint64_t c_strides[2] = {kD * sizeof(T),
                                     static_cast<cuuint64_t>(seq_capacity) * kD * sizeof(T)};
    RETURN_IF_ERROR(MakeMap(&k_map, dtype, k_cache, 3, c_dims, c_strides, "the key cache"));
    RETURN_IF_ERROR(MakeMap(&v_map, dtype, v_cache, 3, c_dims, c_strides, "the value cache"));
  } else {
    // The pools as (head_dim, page_size, page * kv_heads + kv_head), read a page (or 128 keys of
    // one) per box.
    const int ps = pages->page_size;
    const cuuint64_t c_dims[3] = {kD, static_cast<cuuint64_t>(ps),
                                  static_cast<cuuint64_t>(pages->num_pages) * num_kv_heads};
    const cuuint64_t c_strides[2] = {kD * sizeof(T), static_cast<cuuint64_t>(ps) * kD * sizeof(T)};
    const cuuint32_t box_rows = static_cast<cuuint32_t>(std::min(ps, kKeys));
    RETURN_IF_ERROR(
        MakeMap(&k_map, dtype, k_cache, 3, c_dims, c_strides, "the key pages", box_rows));
    RETURN_IF_ERROR(
        MakeMap(&v_map, dtype, v_cache, 3, c_dims, c_strides, "the value pages", box_rows));
    int shift = 0;
    while ((1 << shift) < ps) ++shift;
    pt = PageTable{pages->block_table, pages->table_stride, shift};
  }
  auto* kernel = PrefillAttentionSm90Kernel<T, kD>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const dim3 grid(num_heads, (rows + kRows - 1) / kRows);
  CUDA_CHECK(LaunchKernel(kernel, grid, dim3(kThreads), kSmemBytes, stream, pdl, q_map, k_map,
                          v_map, positions, slots, static_cast<T*>(out), rows, num_heads,
                          num_kv_heads, params.scale, params.window, pt));
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool PrefillAttentionSm90Usable(int head_dim, const void* q, const void* k_cache,
                                const void* v_cache) {
  if ((head_dim != 64 && head_dim != kMaxD) || !Aligned16(q) || !Aligned16(k_cache) ||
      !Aligned16(v_cache))
    return false;
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0 && EncodeTiled() != nullptr;
}

absl::Status LaunchPrefillAttentionSm90(DType dtype, const void* q, const void* k_cache,
                                        const void* v_cache, const int32_t* positions,
                                        const int32_t* slots, void* out, int rows, int num_heads,
                                        int num_kv_heads, int head_dim, int seq_capacity,
                                        const AttentionParams& params, cudaStream_t stream,
                                        bool pdl) {
  TANDEM_DISPATCH_HALF(dtype, {
    if (head_dim == 64) {
      return Launch<T, 64>(dtype, q, k_cache, v_cache, positions, slots, out, rows, num_heads,
                           num_kv_heads, seq_capacity, nullptr, params, stream, pdl);
    }
    return Launch<T, kMaxD>(dtype, q, k_cache, v_cache, positions, slots, out, rows, num_heads,
                            num_kv_heads, seq_capacity, nullptr, params, stream, pdl);
  });
  return absl::OkStatus();
}

absl::Status LaunchPrefillAttentionSm90Paged(DType dtype, const void* q, const KvPages& pages,
                                             const int32_t* positions, const int32_t* seqs,
                                             void* out, int rows, int num_heads,
                                             int num_kv_heads, int head_dim,
                                             const AttentionParams& params, cudaStream_t stream,
                                             bool pdl) {
  TANDEM_DISPATCH_HALF(dtype, {
    if (head_dim == 64) {
      return Launch<T, 64>(dtype, q, pages.k, pages.v, positions, seqs, out, rows, num_heads,
                           num_kv_heads, 0, &pages, params, stream, pdl);
    }
    return Launch<T, kMaxD>(dtype, q, pages.k, pages.v, positions, seqs, out, rows, num_heads,
                            num_kv_heads, 0, &pages, params, stream, pdl);
  });
  return absl::OkStatus();
}

}  // namespace tandem::cuda
