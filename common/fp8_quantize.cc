// Block-scaled E4M3 quantization on the host.
#include "common/fp8_quantize.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace tandem {

absl::Status QuantizeE4M3(const float* w, int64_t rows, int64_t cols, int64_t block_rows,
                          int64_t block_cols, std::string_view name, uint8_t* codes,
                          float* scales) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      if (!std::isfinite(w[r * cols + c])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", std::string(name), "' holds ", w[r * cols + c], " at row ", r, ", column ",
            c, ": a weight must be finite to be quantized to FP8 (the checkpoint is broken)"));
      }
    }
  }
  const int64_t blocks_across = (cols + block_cols - 1) / block_cols;
  for (int64_t r0 = 0; r0 < rows; r0 += block_rows) {
    const int64_t r1 = std::min(rows, r0 + block_rows);
    for (int64_t c0 = 0; c0 < cols; c0 += block_cols) {
      const int64_t c1 = std::min(cols, c0 + block_cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(w[r * cols + c]));
      }
      const float scale = amax > 0.0f ? amax / kE4M3Max : 1.0f;
      scales[(r0 / block_rows) * blocks_across + c0 / block_cols] = scale;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c)
          codes[r * cols + c] = FloatToE4M3(w[r * cols + c] / scale);
      }
    }
  }
  return absl::OkStatus();
}

void DequantizeE4M3Rows(const uint8_t* codes, const float* row_scales, int64_t rows, int64_t cols,
                        float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      out[r * cols + c] = E4M3ToFloat(codes[r * cols + c]) * row_scales[r];
    }
  }
}

uint8_t EncodeKvE4M3(float x, float scale) { return FloatToE4M3(x / scale); }

float DecodeKvE4M3(uint8_t code, float scale) { return E4M3ToFloat(code) * scale; }

void EncodeKvE4M3(const float* x, size_t n, float scale, uint8_t* codes) {
  for (size_t i = 0; i < n; ++i) codes[i] = FloatToE4M3(x[i] / scale);
}

void DecodeKvE4M3(const uint8_t* codes, size_t n, float scale, float* out) {
  // Every code's value, once: attention decodes a sequence's whole context at every step.
  static const std::array<float, 256> kValues = [] {
    std::array<float, 256> v;
    for (int b = 0; b < 256; ++b) v[b] = E4M3ToFloat(static_cast<uint8_t>(b));
    return v;
  }();
  for (size_t i = 0; i < n; ++i) out[i] = kValues[codes[i]] * scale;
}

}  // namespace tandem
