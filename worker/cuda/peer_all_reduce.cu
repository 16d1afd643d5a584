// The one-shot all-reduce over peer memory (peer_all_reduce.h).
//
// Block b of every rank sums the same slice of the message and meets the other ranks' block b
// only: a flag per (block, rank) in each rank's memory, written by that rank with the call's epoch
// (its block's counter, advanced by the block itself). Two staging buffers alternate by the
// epoch's parity: a rank that writes staging buffer p of call e + 2 has passed the barrier of call
// e + 1, which every other rank reached only after reading buffer p of call e.
#include "worker/cuda/peer_all_reduce.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "worker/cuda/device_util.cuh"

namespace tandem::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVector = 8;  // 2-byte elements in 16 bytes
// A peer that does not arrive within ~10 s (at ~2 GHz) is gone: the kernel traps, which fails the
// stream, rather than spinning for ever.
constexpr long long kSpinCycles = 20'000'000'000LL;

struct Args {
  const void* staging[PeerAllReduce::kMaxRanks];  // every rank's, parity 0 (parity 1 follows)
  unsigned* flags[PeerAllReduce::kMaxRanks];      // every rank's flags (kBlocks x kMaxRanks)
  unsigned* epochs;                               // this rank's, per block
  int rank;
  int ranks;
  size_t max_elements;
};

__device__ float ToFloat(__half v) { return __half2float(v); }
__device__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ T FromFloat(float v);
template <>
__device__ __half FromFloat<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Block b's barrier of epoch e: its flag in every peer, then every peer's flag in this rank.
__device__ void Barrier(const Args& a, unsigned e) {
  const int b = blockIdx.x;
  for (int p = 0; p < a.ranks; ++p) {
    if (p == a.rank) continue;
    volatile unsigned* f = a.flags[p] + b * PeerAllReduce::kMaxRanks + a.rank;
    *f = e;
  }
  const long long start = clock64();
  for (int p = 0; p < a.ranks; ++p) {
    if (p == a.rank) continue;
    volatile unsigned* f = a.flags[a.rank] + b * PeerAllReduce::kMaxRanks + p;
    while (static_cast<int>(*f - e) < 0) {
      if (clock64() - start > kSpinCycles) __trap();
    }
  }
  __threadfence_system();
}

template <typename T>
__global__ void __launch_bounds__(kThreads) OneShotSum(Args a, T* x, size_t n) {
  // The kernel after this one (the norm that reads x) may start, and the projection after it
  // prefetch its weights, while this one waits for its peers. Nothing of this call is read or
  // written before the projection that wrote x has finished, nor the call before this one.
  AllowDependentLaunch();
  WaitForPrerequisites();
  __shared__ unsigned epoch;
  if (threadIdx.x == 0) epoch = ++a.epochs[blockIdx.x];  // this block's counter alone
  __syncthreads();
  const unsigned e = epoch;
  const size_t parity = (e & 1u) != 0 ? a.max_elements : 0;
  // The block's slice: whole 16-byte vectors; the last block also takes the elements after them.
  const size_t vectors = n / kVector;
  const size_t per_block = (vectors + gridDim.x - 1) / gridDim.x;
  const size_t v0 = min(vectors, blockIdx.x * per_block), v1 = min(vectors, v0 + per_block);
  const bool tail = blockIdx.x == gridDim.x - 1;
  T* mine = static_cast<T*>(const_cast<void*>(a.staging[a.rank])) + parity;
  for (size_t i = v0 + threadIdx.x; i < v1; i += blockDim.x) {
    reinterpret_cast<uint4*>(mine)[i] = reinterpret_cast<const uint4*>(x)[i];
  }
  if (tail) {
    for (size_t i = vectors * kVector + threadIdx.x; i < n; i += blockDim.x) mine[i] = x[i];
  }
  __threadfence_system();  // this thread's staging writes, before the flags go out
  __syncthreads();
  if (threadIdx.x == 0) Barrier(a, e);
  __syncthreads();
  // Every rank's values in rank order, in fp32: the same bits on every rank. The ranks' loads are
  // issued together (each is a round trip over NVLink), then summed.
  for (size_t i = v0 + threadIdx.x; i < v1; i += blockDim.x) {
    uint4 v[PeerAllReduce::kMaxRanks];
#pragma unroll
    for (int r = 0; r < PeerAllReduce::kMaxRanks; ++r) {
      if (r < a.ranks) {
        v[r] = __ldcv(reinterpret_cast<const uint4*>(static_cast<const T*>(a.staging[r]) + parity) + i);
      }
    }
    float acc[kVector] = {};
#pragma unroll
    for (int r = 0; r < PeerAllReduce::kMaxRanks; ++r) {
      if (r >= a.ranks) break;
      const T* h = reinterpret_cast<const T*>(&v[r]);
#pragma unroll
      for (int k = 0; k < kVector; ++k) acc[k] += ToFloat(h[k]);
    }
    uint4 out;
    T* o = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int k = 0; k < kVector; ++k) o[k] = FromFloat<T>(acc[k]);
    reinterpret_cast<uint4*>(x)[i] = out;
  }
  if (tail) {
    for (size_t i = vectors * kVector + threadIdx.x; i < n; i += blockDim.x) {
      float acc = 0.0f;
      for (int r = 0; r < a.ranks; ++r) {
        const T* src = static_cast<const T*>(a.staging[r]) + parity;
        acc += ToFloat(src[i]);
      }
      x[i] = FromFloat<T>(acc);
    }
  }
}

absl::Status CudaError(cudaError_t e, const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PeerAllReduce>> PeerAllReduce::Create(int first_device, int ranks,
                                                                     size_t max_elements) {
  if (ranks < 2 || ranks > kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer all-reduce over ", ranks, " ranks (2 to ", kMaxRanks, ")"));
  }
  int previous = 0;
  (void)cudaGetDevice(&previous);
  for (int i = 0; i < ranks; ++i) {
    for (int j = 0; j < ranks; ++j) {
      if (i == j) continue;
      int can = 0;
      const cudaError_t e = cudaDeviceCanAccessPeer(&can, first_device + i, first_device + j);
      if (e != cudaSuccess) return CudaError(e, "cudaDeviceCanAccessPeer");
      if (can == 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("device ", first_device + i, " cannot access device ", first_device + j,
                         "'s memory (no peer access between them)"));
      }
    }
  }
  std::unique_ptr<PeerAllReduce> p(new PeerAllReduce());
  p->first_device_ = first_device;
  p->ranks_ = ranks;
  p->max_elements_ = (max_elements + kVector - 1) / kVector * kVector;  // parity 1 16-byte aligned
  max_elements = p->max_elements_;
  p->staging_.assign(ranks, nullptr);
  p->flags_.assign(ranks, nullptr);
  p->epochs_.assign(ranks, nullptr);
  absl::Status status;
  for (int i = 0; i < ranks && status.ok(); ++i) {
    (void)cudaSetDevice(first_device + i);
    for (int j = 0; j < ranks && status.ok(); ++j) {
      if (i == j) continue;
      const cudaError_t e = cudaDeviceEnablePeerAccess(first_device + j, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();
      } else if (e != cudaSuccess) {
        status = CudaError(e, absl::StrCat("peer access from device ", first_device + i, " to ",
                                           first_device + j));
      }
    }
    const size_t flag_bytes = sizeof(unsigned) * kBlocks * kMaxRanks;
    cudaError_t e = cudaMalloc(&p->staging_[i], 2 * max_elements * 2);
    if (e == cudaSuccess) e = cudaMalloc(reinterpret_cast<void**>(&p->flags_[i]), flag_bytes);
    if (e == cudaSuccess) e = cudaMemset(p->flags_[i], 0, flag_bytes);
    if (e == cudaSuccess) e = cudaMalloc(reinterpret_cast<void**>(&p->epochs_[i]), sizeof(unsigned) * kBlocks);
    if (e == cudaSuccess) e = cudaMemset(p->epochs_[i], 0, sizeof(unsigned) * kBlocks);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess && status.ok()) {
      status = CudaError(e, absl::StrCat("peer all-reduce buffers on device ", first_device + i));
    }
  }
  (void)cudaSetDevice(previous);
  if (!status.ok()) return status;  // the destructor frees what was allocated
  return p;
}

PeerAllReduce::~PeerAllReduce() {
  int previous = 0;
  (void)cudaGetDevice(&previous);
  for (int i = 0; i < ranks_; ++i) {
    (void)cudaSetDevice(first_device_ + i);
    (void)cudaDeviceSynchronize();
    if (staging_[i] != nullptr) (void)cudaFree(staging_[i]);
    if (flags_[i] != nullptr) (void)cudaFree(flags_[i]);
    if (epochs_[i] != nullptr) (void)cudaFree(epochs_[i]);
  }
  (void)cudaSetDevice(previous);
}

absl::Status PeerAllReduce::Run(int rank, void* x, size_t elements, DType dtype,
                                cudaStream_t stream) const {
  if (rank < 0 || rank >= ranks_) {
    return absl::InvalidArgumentError(absl::StrCat("peer all-reduce rank ", rank, " of ", ranks_));
  }
  if (elements > max_elements_) {
    return absl::InvalidArgumentError(absl::StrCat("peer all-reduce of ", elements,
                                                   " elements; at most ", max_elements_));
  }
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0) {
    return absl::InvalidArgumentError("peer all-reduce of a buffer not aligned to 16 bytes");
  }
  Args a{};
  for (int r = 0; r < ranks_; ++r) {
    a.staging[r] = staging_[r];
    a.flags[r] = flags_[r];
  }
  a.epochs = epochs_[rank];
  a.rank = rank;
  a.ranks = ranks_;
  a.max_elements = max_elements_;
  // A block per kThreads vectors, up to kBlocks: every rank launches the same grid for the same
  // size, so that block b meets block b.
  const size_t vectors = elements / kVector;
  const int blocks =
      static_cast<int>(std::clamp<size_t>((vectors + kThreads - 1) / kThreads, 1, kBlocks));
  // A programmatic dependent launch: it starts while the projection before it drains.
  cudaError_t e = cudaSuccess;
  if (dtype == DType::kF16) {
    e = LaunchKernel(OneShotSum<__half>, dim3(blocks), dim3(kThreads), 0, stream, true, a,
                     static_cast<__half*>(x), elements);
  } else if (dtype == DType::kBF16) {
    e = LaunchKernel(OneShotSum<__nv_bfloat16>, dim3(blocks), dim3(kThreads), 0, stream, true, a,
                     static_cast<__nv_bfloat16*>(x), elements);
  } else {
    return absl::InvalidArgumentError("peer all-reduce takes F16 or BF16 values");
  }
  if (e == cudaSuccess) e = cudaGetLastError();
  return e == cudaSuccess ? absl::OkStatus() : CudaError(e, "peer all-reduce launch");
}

}  // namespace tandem::cuda
