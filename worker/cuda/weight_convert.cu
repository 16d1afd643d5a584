// Weight conversion kernels: one element per thread, through fp32 (exact for every fp16 and bf16
// value), so that the result is the host's FromFloat(to, ToFloat(from, x)) bit for bit. They run
// once per load over data that just crossed PCIe, so plain element loads are fast enough.
#include "worker/cuda/weight_convert.h"

#include "worker/cuda/cuda_check.h"
#include "worker/cuda/device_util.cuh"

namespace tandem::cuda {
namespace {

constexpr int kThreads = 256;

template <typename In, typename Out>
__global__ void ConvertKernel(const In* __restrict__ src, Out* __restrict__ dst, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = FromF<Out>(ToF(src[i]));
}

template <typename In, typename Out>
__global__ void ConvertTransposedKernel(const In* __restrict__ src, Out* __restrict__ dst,
                                        int64_t row0, int64_t rows, int64_t in, int64_t out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * out) return;
  const int64_t r = i / out, o = i % out;
  dst[o * in + row0 + r] = FromF<Out>(ToF(src[i]));
}

// Calls fn(In{}, Out{}) with the element types of `from` and `to` (to: fp16 or bf16).
template <typename Fn>
absl::Status Dispatch(DType from, DType to, Fn&& fn) {
  auto with_out = [&](auto in) -> absl::Status {
    if (to == DType::kF16) return fn(in, __half{});
    if (to == DType::kBF16) return fn(in, __nv_bfloat16{});
    return absl::InvalidArgumentError(
        absl::StrCat("weights convert to F16 or BF16, not ", std::string(DTypeName(to))));
  };
  switch (from) {
    case DType::kF32: return with_out(float{});
    case DType::kF16: return with_out(__half{});
    case DType::kBF16: return with_out(__nv_bfloat16{});
  }
  return absl::InvalidArgumentError("unknown stored dtype");
}

unsigned Blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

absl::Status LaunchConvert(DType from, DType to, const void* src, void* dst, int64_t n,
                           cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  return Dispatch(from, to, [&](auto in, auto out) -> absl::Status {
    using In = decltype(in);
    using Out = decltype(out);
    ConvertKernel<In, Out><<<Blocks(n), kThreads, 0, stream>>>(static_cast<const In*>(src),
                                                                 static_cast<Out*>(dst), n);
    CUDA_CHECK_LAUNCH();
    return absl::OkStatus();
  });
}

absl::Status LaunchConvertTransposed(DType from, DType to, const void* src, void* dst,
                                     int64_t row0, int64_t rows, int64_t in, int64_t out,
                                     cudaStream_t stream) {
  if (rows <= 0 || out <= 0) return absl::OkStatus();
  return Dispatch(from, to, [&](auto in_t, auto out_t) -> absl::Status {
    using In = decltype(in_t);
    using Out = decltype(out_t);
    ConvertTransposedKernel<In, Out><<<Blocks(rows * out), kThreads, 0, stream>>>(
        static_cast<const In*>(src), static_cast<Out*>(dst), row0, rows, in, out);
    CUDA_CHECK_LAUNCH();
    return absl::OkStatus();
  });
}

}  // namespace tandem::cuda
