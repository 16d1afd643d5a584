// Quantization of fp32 matrices to FP8 E4M3 with one scale per block: the rule every FP8 path of
// tandem uses (--quantization fp8 at load, tandem-make-model's pre-quantized checkpoints).
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"

namespace tandem {

// Quantizes the row-major (rows, cols) matrix `w` in blocks of block_rows x block_cols (the last
// ones cut short): per block scale = amax / 448 (1 for an all-zero block), codes[i] =
// E4M3(w[i] / scale), rounded to nearest even and saturating at +-448, so that w[i] ~ E4M3(codes[i])
// * scale within half an E4M3 step (a relative 2^-4) of the block's scale. Per output channel is
// blocks of (1, cols); per tensor, (rows, cols). scales: ceil(rows / block_rows) x
// ceil(cols / block_cols), row-major. INVALID_ARGUMENT naming `name`, the row and the column of
// the first NaN or infinity (a checkpoint that holds one is broken, and no scale represents it).
absl::Status QuantizeE4M3(const float* w, int64_t rows, int64_t cols, int64_t block_rows,
                          int64_t block_cols, std::string_view name, uint8_t* codes,
                          float* scales);

// codes (rows, cols) with one scale per row back to fp32.
void DequantizeE4M3Rows(const uint8_t* codes, const float* row_scales, int64_t rows, int64_t cols,
                        float* out);

}  // namespace tandem
