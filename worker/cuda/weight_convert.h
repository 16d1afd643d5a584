// Launchers of the weight conversion kernels (weight_convert.cu): checkpoint elements as stored
// (fp32, fp16, bf16) to the device's dtype (fp16 or bf16), rounding to nearest even exactly as
// common/dtype.h does on the host, optionally transposing GPT-2's Conv1D matrices on the way.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "common/dtype.h"

namespace tandem::cuda {

// dst[i] = to(from(src[i])) for i in [0, n). src and dst device memory, not overlapping.
absl::Status LaunchConvert(DType from, DType to, const void* src, void* dst, int64_t n,
                           cudaStream_t stream);

// Rows [row0, row0 + rows) of a stored (in, out) matrix, at src as `rows` rows of `out` elements,
// written converted into the (out, in) matrix at dst: dst[o * in + row0 + r] = src[r * out + o].
absl::Status LaunchConvertTransposed(DType from, DType to, const void* src, void* dst,
                                     int64_t row0, int64_t rows, int64_t in, int64_t out,
                                     cudaStream_t stream);

}  // namespace tandem::cuda
