// MLP activations: GELU-tanh with the c_fc bias (GPT-2), SwiGLU (Llama).
#include <algorithm>
#include <cstdint>

#include "worker/cuda/cuda_check.h"
#include "worker/cuda/device_util.cuh"
#include "worker/cuda/kernels.h"

namespace tandem::cuda {
namespace {

__device__ __forceinline__ float GeluTanh(float x) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

// Grid-stride over rows * cols elements.
template <typename T>
__global__ void GeluBiasKernel(T* __restrict__ h, const T* __restrict__ b, int rows, int cols) {
  const size_t n = static_cast<size_t>(rows) * cols;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float v = ToF(h[i]);
    // As the Linear layer's output, the biased value is rounded before the activation.
    if (b != nullptr) v = RoundTo<T>(v + ToF(b[i % cols]));
    h[i] = FromF<T>(GeluTanh(v));
  }
}

template <typename T>
__global__ void SwiGluKernel(const T* __restrict__ gate_up, T* __restrict__ out, int rows,
                             int cols) {
  const size_t n = static_cast<size_t>(rows) * cols;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t r = i / cols, c = i % cols;
    const float g = ToF(gate_up[r * 2 * cols + c]);
    const float u = ToF(gate_up[r * 2 * cols + cols + c]);
    // Hugging Face rounds silu(gate) to the activation type before the product.
    const float s = RoundTo<T>(g / (1.0f + expf(-g)));
    out[i] = FromF<T>(s * u);
  }
}

// grid (ceil(cols / 8 / 128), row groups): 8 columns per thread in 16-byte loads and stores, a
// row per blockIdx.y (+ gridDim.y, ...), so that no thread divides by cols; cols % 8 == 0 and the
// pointers 16-byte aligned. The same arithmetic per element as SwiGluKernel.
template <typename T>
__global__ void SwiGluVec8Kernel(const T* __restrict__ gate_up, T* __restrict__ out, int rows,
                                 int cols) {
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (c >= cols) return;
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* in = gate_up + static_cast<size_t>(r) * 2 * cols + c;
    const Vec8<T> g = *reinterpret_cast<const Vec8<T>*>(in);
    const Vec8<T> u = *reinterpret_cast<const Vec8<T>*>(in + cols);
    Vec8<T> y;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float gj = ToF(g.v[j]);
      const float s = RoundTo<T>(gj / (1.0f + expf(-gj)));
      y.v[j] = FromF<T>(s * ToF(u.v[j]));
    }
    *reinterpret_cast<Vec8<T>*>(out + static_cast<size_t>(r) * cols + c) = y;
  }
}

int GridFor(size_t n) {
  const size_t blocks = (n + 255) / 256;
  return static_cast<int>(blocks < 65536 ? blocks : 65536);
}

}  // namespace

absl::Status LaunchGeluBias(DType dtype, void* h, const void* b, int rows, int cols,
                            cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  TANDEM_DISPATCH_HALF(dtype, {
    GeluBiasKernel<T><<<GridFor(static_cast<size_t>(rows) * cols), 256, 0, stream>>>(
        static_cast<T*>(h), static_cast<const T*>(b), rows, cols);
  });
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

absl::Status LaunchSwiGlu(DType dtype, const void* gate_up, void* out, int rows, int cols,
                          cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  const bool aligned =
      reinterpret_cast<uintptr_t>(gate_up) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (cols % 8 == 0 && aligned) {
    const dim3 grid((cols / 8 + 127) / 128, std::min(rows, 65535));
    TANDEM_DISPATCH_HALF(dtype, {
      SwiGluVec8Kernel<T><<<grid, 128, 0, stream>>>(static_cast<const T*>(gate_up),
                                                    static_cast<T*>(out), rows, cols);
    });
    CUDA_CHECK_LAUNCH();
    return absl::OkStatus();
  }
  TANDEM_DISPATCH_HALF(dtype, {
    SwiGluKernel<T><<<GridFor(static_cast<size_t>(rows) * cols), 256, 0, stream>>>(
        static_cast<const T*>(gate_up), static_cast<T*>(out), rows, cols);
  });
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace tandem::cuda
