// FP8 tensor-core GEMM for prompts and large batches with FP8 (E4M3) weights: activations are
// quantized per row (per token) to E4M3 on the fly, then cuBLASLt multiplies the two FP8 matrices
// on Hopper's FP8 tensor cores with fp32 accumulation, applying the weight's per-output-channel
// scales and the activations' per-row scales (outer-vector scaling) as it writes fp16/bf16. Where
// cuBLASLt has no outer-vector scaling for the device, the product is written in fp32 (in row
// pieces of a fixed scratch) and a small kernel applies both scales and writes fp16/bf16.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace tandem::cuda {

// codes (rows, cols) E4M3 and scales (rows) fp32 from x (rows, cols) `dtype`: each row's scale is
// its largest magnitude / 448 (E4M3's largest finite value), so that the row's codes use the
// whole range; an all-zero row gets scale 1. codes 16-byte aligned, cols a multiple of 16.
absl::Status LaunchQuantizeRowsFp8(DType dtype, const void* x, void* codes, float* scales,
                                   int rows, int cols, cudaStream_t stream);

// y (rows, out) `dtype` = (x · wᵀ) + beta * y with w (out, in) E4M3 codes and w_scales (out), x
// `dtype` (rows, in), quantized per row into x_codes (rows, in) and x_scales (rows), which the
// caller provides (16-byte aligned). in a multiple of 16. One object per stream.
class Fp8Gemm {
 public:
  // UNAVAILABLE where cuBLASLt offers no FP8 GEMM with outer-vector scales (before Hopper, or an
  // older cuBLAS): the caller then dequantizes the weights instead.
  // max_out: the widest output any Run will ask for (it sizes the fp32 scratch).
  static absl::StatusOr<std::unique_ptr<Fp8Gemm>> Create(cudaStream_t stream, int max_out);
  ~Fp8Gemm();
  Fp8Gemm(const Fp8Gemm&) = delete;
  Fp8Gemm& operator=(const Fp8Gemm&) = delete;

  absl::Status Run(DType dtype, const void* x, const void* w, const float* w_scales, void* y,
                   int rows, int out, int in, float beta, void* x_codes, float* x_scales);

  // How the scales are applied: by cuBLASLt (outer vectors) or by the fp32 epilogue kernel.
  bool outer_vector_scales() const { return outer_; }

 private:
  Fp8Gemm() = default;
  struct Plan;
  // (dtype, out, in, rows, beta != 0): the layouts and the algorithm chosen for them.
  using Key = std::tuple<int, int, int, int, bool>;
  absl::StatusOr<Plan*> PlanFor(DType dtype, int out, int in, int rows, bool accumulate);

  bool outer_ = true;
  int max_out_ = 0;
  float* scratch_ = nullptr;  // fp32 (kPieceRows, max_out_) for the epilogue kernel's path

  cublasLtHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* workspace_ = nullptr;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace tandem::cuda
