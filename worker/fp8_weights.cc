// Linear weights to per-row FP8, from any source.
#include "worker/fp8_weights.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/fp8_quantize.h"
#include "common/status_macros.h"

namespace tandem {
namespace {

// One scale per row, from a stored scale tensor that is per tensor or per channel.
std::vector<float> RowScales(const TensorView& scale, int64_t rows) {
  std::vector<float> stored(static_cast<size_t>(scale.numel()));
  ToFloat(scale.dtype, scale.data.data(), stored.size(), stored.data());
  if (stored.size() == 1) return std::vector<float>(static_cast<size_t>(rows), stored[0]);
  return stored;
}

}  // namespace

absl::StatusOr<Fp8Rows> SourceToFp8Rows(const TensorSource& src, int64_t cols) {
  Fp8Rows q;
  q.cols = cols;
  q.rows = cols > 0 ? src.numel() / cols : 0;
  q.input_scale = src.input_scale;
  q.codes.resize(static_cast<size_t>(q.rows * q.cols));
  q.scales.resize(static_cast<size_t>(q.rows));
  const bool keep_codes =
      src.fp8() && src.quantization.scales != WeightQuantization::Scales::kBlock;
  if (keep_codes) {
    // The stored codes as they are; each part's scale spread over its rows.
    int64_t row = 0;
    for (size_t p = 0; p < src.parts.size(); ++p) {
      const TensorView& part = src.parts[p];
      const int64_t rows = part.shape[0];
      std::copy(part.data.begin(), part.data.end(),
                reinterpret_cast<std::byte*>(q.codes.data() + row * cols));
      const std::vector<float> s = RowScales(src.scales[p], rows);
      std::copy(s.begin(), s.end(), q.scales.begin() + row);
      row += rows;
    }
    return q;
  }
  // Everything else through its fp32 values, part by part (so that errors name the tensor).
  std::vector<float> values(static_cast<size_t>(q.rows * q.cols));
  SourceToFloat(src, values.data());
  int64_t row = 0;
  for (const TensorView& part : src.parts) {
    const int64_t rows = src.transposed ? part.shape[1] : part.shape[0];
    RETURN_IF_ERROR(QuantizeE4M3(values.data() + row * cols, rows, cols, 1, cols, part.name,
                                 q.codes.data() + row * cols, q.scales.data() + row));
    row += rows;
  }
  return q;
}

std::vector<float> DequantizeFp8Rows(const Fp8Rows& q) {
  std::vector<float> out(q.codes.size());
  DequantizeE4M3Rows(q.codes.data(), q.scales.data(), q.rows, q.cols, out.data());
  return out;
}

absl::Status RoundLinearWeightsToFp8(const StageSources& sources, StageWeights& w) {
  absl::Status status;
  ForEachLinearWeight(sources, w, [&](const TensorSource& src, std::vector<float>& dst) {
    if (!status.ok() || src.empty() || src.fp8()) return;  // FP8 sources read exactly
    // The engine layout's `in` is the stacked tensor's numel over its rows: recover it from the
    // first part (stored (out, in), or (in, out) when transposed).
    const TensorView& first = src.parts[0];
    const int64_t cols = src.transposed ? first.shape[0] : first.shape[1];
    absl::StatusOr<Fp8Rows> q = SourceToFp8Rows(src, cols);
    if (!q.ok()) {
      status = q.status();
      return;
    }
    dst = DequantizeFp8Rows(*q);
  });
  return status;
}

}  // namespace tandem
