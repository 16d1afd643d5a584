// FP8 (E4M3) linear-layer weights in the one form the engine computes with: codes (out, in) and
// one fp32 scale per output row. Every source reaches it: 16/32-bit weights (--quantization fp8)
// and pre-quantized checkpoints (per-tensor and per-channel scales keep their codes; block scales
// are re-quantized per row). The CUDA backend uploads it; the CPU backend, the reference,
// computes in fp32 with the dequantized values of exactly the same codes and scales.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/weights.h"

namespace tandem {

struct Fp8Rows {
  int64_t rows = 0;             // out
  int64_t cols = 0;             // in
  std::vector<uint8_t> codes;   // (rows, cols) E4M3
  std::vector<float> scales;    // (rows): value = E4M3(code) * scale
  float input_scale = 0.0f;     // the checkpoint's static activation scale; 0: dynamic
};

// `src` (a linear layer's weight in the engine's (out, in) layout, `cols` = in) in FP8 with
// per-row scales. INVALID_ARGUMENT naming the checkpoint tensor for a NaN or infinite weight.
absl::StatusOr<Fp8Rows> SourceToFp8Rows(const TensorSource& src, int64_t cols);

// The values `q` stands for, (rows, cols) fp32.
std::vector<float> DequantizeFp8Rows(const Fp8Rows& q);

// Calls fn(from, to) for the four linear weights of each layer (wqkv, wo, w_in, w_out): the
// tensors that FP8 quantization applies to (embeddings, norms, biases and the LM head stay).
template <typename A, typename B, typename Fn>
void ForEachLinearWeight(A& from, B& to, Fn&& fn) {
  for (size_t i = 0; i < from.layers.size(); ++i) {
    fn(from.layers[i].wqkv, to.layers[i].wqkv);
    fn(from.layers[i].wo, to.layers[i].wo);
    fn(from.layers[i].w_in, to.layers[i].w_in);
    fn(from.layers[i].w_out, to.layers[i].w_out);
  }
}

// The CPU backend's --quantization fp8: each 16/32-bit linear weight of `w` (read from `sources`)
// replaced by the values of its Fp8Rows (weights stored in FP8 already hold their exact values), so that the fp32 forward computes what the FP8 kernels compute up to
// rounding of the activations.
absl::Status RoundLinearWeightsToFp8(const StageSources& sources, StageWeights& w);

}  // namespace tandem
