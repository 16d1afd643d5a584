// FP8 weights on FP8 tensor cores: per-row activation quantization and cuBLASLt's E4M3 GEMM with
// outer-vector scales (the weight's per-channel scales on A, the activations' per-row scales on
// B), written as fp16/bf16.
#include "worker/cuda/fp8_gemm.h"

#include <cuda_fp8.h>

#include <algorithm>
#include <array>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/device_util.cuh"
#include "worker/cuda/kernels.h"

namespace tandem::cuda {
namespace {

constexpr float kE4M3Max = 448.0f;
constexpr int kQuantThreads = 256;
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
// Plans kept (one per shape and row count); past this many the cache starts again.
constexpr size_t kMaxPlans = 1024;
// Rows per product on the fp32 path (its scratch holds this many rows of the widest output).
constexpr int kPieceRows = 512;

// One block per row: the row's largest magnitude, then its codes at scale amax / 448, 8 per
// thread step (16-byte reads of the input, 8-byte writes of codes).
template <typename T>
__global__ void QuantizeRowsFp8Kernel(const T* __restrict__ x, uint8_t* __restrict__ codes,
                                      float* __restrict__ scales, int cols) {
  const int64_t row = blockIdx.x;
  const T* in = x + row * cols;
  uint8_t* q = codes + row * cols;
  const int groups = cols / 8;
  float amax = 0.0f;
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    alignas(16) T v[8];
    *reinterpret_cast<uint4*>(v) = reinterpret_cast<const uint4*>(in)[g];
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(ToF(v[i])));
  }
  __shared__ float warp_max[kQuantThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x < 32) {
    amax = threadIdx.x < blockDim.x / 32 ? warp_max[threadIdx.x] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (threadIdx.x == 0) warp_max[0] = amax;
  }
  __syncthreads();
  amax = warp_max[0];
  const float scale = amax > 0.0f ? amax / kE4M3Max : 1.0f;
  const float inv = 1.0f / scale;
  if (threadIdx.x == 0) scales[row] = scale;
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    alignas(16) T v[8];
    *reinterpret_cast<uint4*>(v) = reinterpret_cast<const uint4*>(in)[g];
    alignas(8) __nv_fp8_storage_t out[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      out[i] = __nv_cvt_float_to_fp8(ToF(v[i]) * inv, __NV_SATFINITE, __NV_E4M3);
    }
    reinterpret_cast<uint2*>(q)[g] = *reinterpret_cast<const uint2*>(out);
  }
}

// y (rows, out) = d * x_scales[row] * w_scales[col] + beta * y, d fp32 (rows, out).
template <typename T>
__global__ void ScaleFp32ProductKernel(const float* __restrict__ d, const float* __restrict__ x_scales,
                                       const float* __restrict__ w_scales, T* __restrict__ y,
                                       int out, int64_t n, float beta) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t row = i / out;
  const int col = static_cast<int>(i - row * out);
  float v = d[i] * x_scales[row] * w_scales[col];
  if (beta != 0.0f) v += beta * ToF(y[i]);
  y[i] = FromF<T>(v);
}

cudaDataType_t HalfType(DType dtype) { return dtype == DType::kF16 ? CUDA_R_16F : CUDA_R_16BF; }

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

absl::Status LaunchQuantizeRowsFp8(DType dtype, const void* x, void* codes, float* scales,
                                   int rows, int cols, cudaStream_t stream) {
  if (dtype != DType::kF16 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError("FP8 activation quantization takes fp16 or bf16 input");
  }
  if (rows < 0 || cols <= 0 || cols % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FP8 activation quantization takes a width that is a positive multiple of 16, got ", cols));
  }
  if (!Aligned16(x) || !Aligned16(codes)) {
    return absl::InvalidArgumentError("FP8 activation quantization needs 16-byte aligned buffers");
  }
  if (rows == 0) return absl::OkStatus();
  TANDEM_DISPATCH_HALF(dtype, {
    QuantizeRowsFp8Kernel<T><<<rows, kQuantThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<uint8_t*>(codes), scales, cols);
  });
  CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

struct Fp8Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo;
  ~Plan() {
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

Fp8Gemm::~Fp8Gemm() {
  plans_.clear();
  if (scratch_ != nullptr) cudaFree(scratch_);
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

absl::StatusOr<std::unique_ptr<Fp8Gemm>> Fp8Gemm::Create(cudaStream_t stream, int max_out) {
  int device = 0, major = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 9) {
    return absl::UnavailableError(
        absl::StrCat("FP8 tensor-core GEMM needs compute capability 9.0 or newer, the device has ",
                     major, ".x"));
  }
  std::unique_ptr<Fp8Gemm> g(new Fp8Gemm());
  CUBLAS_CHECK(cublasLtCreate(&g->handle_));
  CUDA_CHECK(cudaMalloc(&g->workspace_, kWorkspaceBytes));
  g->stream_ = stream;
  g->max_out_ = max_out;
  // A shape every FP8 layer has: if cuBLASLt offers nothing for it, it offers nothing at all.
  // First with outer-vector scales; else scalar scales into fp32 and the epilogue kernel.
  absl::StatusOr<Plan*> probe = g->PlanFor(DType::kF16, 256, 256, 64, false);
  if (probe.ok()) return g;
  const absl::Status outer = probe.status();
  g->outer_ = false;
  g->plans_.clear();
  probe = g->PlanFor(DType::kF16, 256, 256, 64, false);
  if (!probe.ok()) {
    return absl::UnavailableError(absl::StrCat(outer.message(), "; without scale vectors: ",
                                               probe.status().message()));
  }
  CUDA_CHECK(cudaMalloc(&g->scratch_, static_cast<size_t>(kPieceRows) * max_out * sizeof(float)));
  return g;
}

absl::StatusOr<Fp8Gemm::Plan*> Fp8Gemm::PlanFor(DType dtype, int out, int in, int rows,
                                                bool accumulate) {
  const Key key{static_cast<int>(dtype), out, in, rows, accumulate};
  if (auto it = plans_.find(key); it != plans_.end()) return it->second.get();
  if (plans_.size() >= kMaxPlans) plans_.clear();
  auto p = std::make_unique<Plan>();
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  // A = w (column-major (in, out), transposed): one scale per output channel, its M; B = the
  // quantized x (in, rows): one scale per row, its N. Without them: unscaled, into fp32.
  if (outer_) {
    const int32_t outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                &outer, sizeof(outer)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                &outer, sizeof(outer)));
  }
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_8F_E4M3, in, out, in));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_8F_E4M3, in, rows, in));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->c, outer_ ? HalfType(dtype) : CUDA_R_32F, out, rows,
                                          out));
  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspaceBytes, sizeof(kWorkspaceBytes));
  cublasLtMatmulHeuristicResult_t found{};
  int count = 0;
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(handle_, p->desc, p->a, p->b, p->c, p->c, pref, 1, &found,
                                        &count);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || count == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuBLASLt has no FP8 GEMM with per-channel and per-row scales for out ", out, ", in ", in,
        ", rows ", rows, " (", st != CUBLAS_STATUS_SUCCESS ? cublasGetStatusString(st) : "none",
        ")"));
  }
  p->algo = found.algo;
  Plan* plan = p.get();
  plans_.emplace(key, std::move(p));
  return plan;
}

absl::Status Fp8Gemm::Run(DType dtype, const void* x, const void* w, const float* w_scales,
                          void* y, int rows, int out, int in, float beta, void* x_codes,
                          float* x_scales) {
  if (rows == 0) return absl::OkStatus();
  if (in % 16 != 0 || out % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FP8 GEMM takes widths that are multiples of 16, got out ", out, ", in ", in));
  }
  if (!Aligned16(w) || !Aligned16(y)) {
    return absl::InvalidArgumentError("FP8 GEMM needs 16-byte aligned weights and output");
  }
  if (out > max_out_) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 GEMM output of ", out, " columns, past the ", max_out_, " it was made for"));
  }
  RETURN_IF_ERROR(LaunchQuantizeRowsFp8(dtype, x, x_codes, x_scales, rows, in, stream_));
  const float alpha = 1.0f;
  if (!outer_) {
    const float zero = 0.0f;
    for (int r0 = 0; r0 < rows; r0 += kPieceRows) {
      const int n = std::min(kPieceRows, rows - r0);
      ASSIGN_OR_RETURN(Plan * p, PlanFor(dtype, out, in, n, false));
      const void* b = static_cast<const uint8_t*>(x_codes) + static_cast<int64_t>(r0) * in;
      CUBLAS_CHECK(cublasLtMatmul(handle_, p->desc, &alpha, w, p->a, b, p->b, &zero, scratch_,
                                  p->c, scratch_, p->c, &p->algo, workspace_, kWorkspaceBytes,
                                  stream_));
      const int64_t count = static_cast<int64_t>(n) * out;
      constexpr int kThreads = 256;
      const unsigned blocks = static_cast<unsigned>((count + kThreads - 1) / kThreads);
      TANDEM_DISPATCH_HALF(dtype, {
        ScaleFp32ProductKernel<T><<<blocks, kThreads, 0, stream_>>>(
            scratch_, x_scales + r0, w_scales, static_cast<T*>(y) + static_cast<int64_t>(r0) * out,
            out, count, beta);
      });
      CUDA_CHECK_LAUNCH();
    }
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(Plan * p, PlanFor(dtype, out, in, rows, beta != 0.0f));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                              &w_scales, sizeof(w_scales)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                              &x_scales, sizeof(x_scales)));
  CUBLAS_CHECK(cublasLtMatmul(handle_, p->desc, &alpha, w, p->a, x_codes, p->b, &beta, y, p->c, y,
                              p->c, &p->algo, workspace_, kWorkspaceBytes, stream_));
  return absl::OkStatus();
}

}  // namespace tandem::cuda
