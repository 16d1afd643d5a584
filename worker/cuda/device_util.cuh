// Device-side building blocks shared by the kernels: element conversions for fp16/bf16, 16-byte
// vectors, warp and block reductions, and the dtype dispatch used by the launchers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "common/dtype.h"

namespace tandem::cuda {

__device__ __forceinline__ float ToF(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToF(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToF(float v) { return v; }
__device__ __forceinline__ float ToF(__nv_fp8_e4m3 v) { return static_cast<float>(v); }

// The two E4M3 codes in the low 16 bits of `word` (the first in the low byte) as floats, through
// fp16 (exact: every E4M3 value is an fp16 value).
__device__ __forceinline__ float2 Fp8PairToFloat2(uint32_t word) {
  const __half2_raw raw =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word & 0xffffu), __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&raw));
}

template <typename T>
__device__ __forceinline__ T FromF(float f);
template <>
__device__ __forceinline__ __half FromF<__half>(float f) { return __float2half_rn(f); }
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float f) {
  return __float2bfloat16_rn(f);
}
template <>
__device__ __forceinline__ float FromF<float>(float f) { return f; }

// Rounds through T: what storing a float in T and reading it back gives.
template <typename T>
__device__ __forceinline__ float RoundTo(float f) { return ToF(FromF<T>(f)); }

// 8 elements of a 2-byte type in one 16-byte load or store.
template <typename T>
struct alignas(16) Vec8 {
  T v[8];
};

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 32 floats; the call begins and ends with a barrier so that it can be repeated.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = WarpSum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : 0.0f;
  return WarpSum(v);
}
__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : -INFINITY;
  return WarpMax(v);
}

// Element offset of (slot, kv_head, pos, 0) in a KV-cache laid out (slots, kv_heads, capacity,
// head_dim).
__device__ __forceinline__ size_t KvCacheOffset(int slot, int kv_head, int pos, int num_kv_heads,
                                                int seq_capacity, int head_dim) {
  return ((static_cast<size_t>(slot) * num_kv_heads + kv_head) * seq_capacity + pos) * head_dim;
}

// Rotary embedding of the pair (x1, x2) = (x[i], x[i + head_dim / 2]) of one head at position
// pos, as Hugging Face Llama's rotate-half form in T: the angle pos * inv_freq (the pair's inverse
// frequency, from the host) in fp32, cos and sin rounded to T, then q·cos + rotate_half(q)·sin
// with each product and the sum rounded to T (every operation of that expression is a T tensor
// there). Every kernel that rotates calls this, so they agree bit for bit.
// RotaryCosSin gives the pair's cos and sin (rounded to T), RotateHalfPairBy turns by them; a
// kernel that rotates many heads at one position computes the former once per pair index.
template <typename T>
__device__ __forceinline__ void RotaryCosSin(int pos, float inv_freq, float& c, float& s) {
  const float angle = static_cast<float>(pos) * inv_freq;
  c = RoundTo<T>(cosf(angle));
  s = RoundTo<T>(sinf(angle));
}
template <typename T>
__device__ __forceinline__ void RotateHalfPairBy(float& x1, float& x2, float c, float s) {
  // A product of two 2-byte floats is exact in fp32, so each rounds once, as in T.
  const float y1 = RoundTo<T>(RoundTo<T>(x1 * c) - RoundTo<T>(x2 * s));
  const float y2 = RoundTo<T>(RoundTo<T>(x2 * c) + RoundTo<T>(x1 * s));
  x1 = y1;
  x2 = y2;
}
template <typename T>
__device__ __forceinline__ void RotateHalfPair(float& x1, float& x2, int pos, float inv_freq) {
  float c, s;
  RotaryCosSin<T>(pos, inv_freq, c, s);
  RotateHalfPairBy<T>(x1, x2, c, s);
}

// Programmatic dependent launch (sm_90). A kernel calls AllowDependentLaunch() first thing, so
// that the next kernel of the stream, when launched with the programmatic-serialization attribute
// (see LaunchKernel), can start and prefetch its weights while this one runs; that kernel calls
// WaitForPrerequisites() before it reads anything earlier kernels wrote and before its first
// write (it waits for the previous kernel's completion and memory visibility; as every kernel
// waits, completion is transitive). Before the wait a kernel reads only what no kernel of the
// pass writes (weights, the step's inputs). Both are no-ops where no such launch is involved.
__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ __forceinline__ void WaitForPrerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Launches `kernel` on `stream`; with `pdl` (and a stream of our own) as a programmatic
// dependent launch: the kernel may start once every block of the previous kernel has called
// AllowDependentLaunch(), so it must call WaitForPrerequisites() before it reads what earlier
// kernels wrote and before it writes anything. Graph capture keeps such edges programmatic.
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t stream, bool pdl, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl && stream != nullptr ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// Two floats as one register of two T (lower address: a).
template <typename T>
__device__ __forceinline__ uint32_t Pack(float a, float b) {
  if constexpr (std::is_same_v<T, __half>) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// Segments of a prefill attention block's rows (runs of one slot at consecutive positions): the
// rows that begin one, as bits (bit r % 32 of word r / 32 for row r), so that a segment's end is
// found in a few instructions instead of a walk over its rows.
//
// Called by the block's first kRows threads (whole warps) after pos_s and slot_s hold the block's
// rows (rows at n_rows and past are marked as starts); `starts` needs kRows / 32 words and a
// __syncthreads before it is read.
template <int kRows>
__device__ __forceinline__ void MarkSegmentStarts(const int* pos_s, const int* slot_s, int n_rows,
                                                  uint32_t* starts) {
  static_assert(kRows % 32 == 0);
  const int i = threadIdx.x;
  if (i >= kRows) return;
  const bool start =
      i == 0 || i >= n_rows || slot_s[i] != slot_s[i - 1] || pos_s[i] != pos_s[i - 1] + 1;
  const uint32_t bits = __ballot_sync(0xffffffffu, start);
  if (i % 32 == 0) starts[i / 32] = bits;
}

// The first row after `row` that begins a segment (kRows if none).
template <int kRows>
__device__ __forceinline__ int NextSegmentStart(const uint32_t* starts, int row) {
  const int from = row + 1;
  for (int w = from / 32; w < kRows / 32; ++w) {
    uint32_t bits = starts[w];
    if (w == from / 32) bits &= ~0u << (from % 32);
    if (bits != 0) return w * 32 + __ffs(bits) - 1;
  }
  return kRows;
}

}  // namespace tandem::cuda

// Calls `body` with T bound to the CUDA type of `dtype` (fp16 or bf16), or returns an error.
#define TANDEM_DISPATCH_HALF(dtype, ...)                                                  \
  do {                                                                                    \
    if ((dtype) == ::tandem::DType::kF16) {                                               \
      using T = __half;                                                                   \
      __VA_ARGS__                                                                         \
    } else if ((dtype) == ::tandem::DType::kBF16) {                                       \
      using T = __nv_bfloat16;                                                            \
      __VA_ARGS__                                                                         \
    } else {                                                                              \
      return absl::InvalidArgumentError("CUDA kernels take fp16 or bf16 tensors");        \
    }                                                                                     \
  } while (0)
