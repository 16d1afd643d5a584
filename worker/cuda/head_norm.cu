// Qwen3's q_norm and k_norm (head_norm.h): one warp per head, fp32 statistics, rounded as
// Hugging Face's Qwen3RMSNorm rounds.
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/device_util.cuh"
#include "worker/cuda/head_norm.h"

namespace tandem::cuda {
namespace {

constexpr int kHeadNormWarps = 4;  // heads per block

// One warp per head of one row: the bias added (the sum rounded to T, as the projection's output
// is), then q heads RMSNorm-ed with q_w, k heads with k_w; v heads (reached only when there is a
// bias) get the bias alone. The head is read twice (statistics, then output), from L1 the second
// time, so any head_dim works without registers sized for the widest.
template <typename T>
__global__ void __launch_bounds__(32 * kHeadNormWarps)
HeadNormKernel(T* __restrict__ qkv, const T* __restrict__ bias, const T* __restrict__ q_w,
               const T* __restrict__ k_w, int heads, int num_heads, int num_kv_heads,
               int head_dim, float eps) {
  WaitForPrerequisites();  // qkv is the projection's output
  const int head = blockIdx.y * kHeadNormWarps + threadIdx.x / 32;
  if (head >= heads) return;
  const int lane = threadIdx.x % 32;
  const int cols = (num_heads + 2 * num_kv_heads) * head_dim;
  T* x = qkv + static_cast<size_t>(blockIdx.x) * cols + static_cast<size_t>(head) * head_dim;
  const T* b = bias != nullptr ? bias + static_cast<size_t>(head) * head_dim : nullptr;
  auto load = [&](int j) { return b != nullptr ? RoundTo<T>(ToF(x[j]) + ToF(b[j])) : ToF(x[j]); };
  if (head >= num_heads + num_kv_heads) {  // a v head: the bias only
    for (int j = lane; j < head_dim; j += 32) x[j] = FromF<T>(load(j));
    return;
  }
  const T* w = head < num_heads ? q_w : k_w;
  float sum = 0.0f;
  for (int j = lane; j < head_dim; j += 32) {
    const float v = load(j);
    sum += v * v;
  }
  const float inv = rsqrtf(WarpSum(sum) / head_dim + eps);
  // Each lane writes only the elements it read, after WarpSum has gathered every lane's reads.
  // As Qwen3RMSNorm: the normalised value is rounded to the activation type before the weight.
  for (int j = lane; j < head_dim; j += 32) {
    x[j] = FromF<T>(RoundTo<T>(load(j) * inv) * ToF(w[j]));
  }
}

}  // namespace

absl::Status LaunchHeadNorm(DType dtype, void* qkv, const void* bias, const void* q_w,
                            const void* k_w, int rows, int num_heads, int num_kv_heads,
                            int head_dim, float eps, cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  if (q_w == nullptr || k_w == nullptr) {
    return absl::InvalidArgumentError("head norm needs both q_norm and k_norm weights");
  }
  const int heads = num_heads + num_kv_heads + (bias != nullptr ? num_kv_heads : 0);
  const dim3 grid(rows, (heads + kHeadNormWarps - 1) / kHeadNormWarps);
  TANDEM_DISPATCH_HALF(dtype, {
    CUDA_CHECK(LaunchKernel(HeadNormKernel<T>, grid, dim3(32 * kHeadNormWarps), 0, stream,
                            /*pdl=*/false, static_cast<T*>(qkv), static_cast<const T*>(bias),
                            static_cast<const T*>(q_w), static_cast<const T*>(k_w), heads,
                            num_heads, num_kv_heads, head_dim, eps));
  });
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace tandem::cuda
