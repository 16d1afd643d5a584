// Quantization of fp32 matrices to FP8 E4M3 with one scale per block: the rule every FP8 path of
// tandem uses (--quantization fp8 at load, tandem-make-model's pre-quantized checkpoints); and the
// rule of a KV-cache kept in FP8 (--kv_cache_dtype fp8).
#pragma once

#include <cstddef>
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

// The KV-cache in FP8 (KvCacheDType::kFp8E4M3, vLLM's rule): an element x of a layer's K (or V)
// whose scale is `scale` (> 0, per layer: the checkpoint's k_scale / v_scale, else 1) is stored as
// the code E4M3(x / scale), rounded to nearest even and saturating at +-448 (NaN stays NaN), and
// read as E4M3(code) * scale. Every backend stores and reads the cache so, so that a code means
// the same wherever it moves.
uint8_t EncodeKvE4M3(float x, float scale);
float DecodeKvE4M3(uint8_t code, float scale);
// The same over n elements.
void EncodeKvE4M3(const float* x, size_t n, float scale, uint8_t* codes);
void DecodeKvE4M3(const uint8_t* codes, size_t n, float scale, float* out);

}  // namespace tandem
