// Rotary inverse frequencies: default, linear and Llama 3.1 scaling.
#include "common/rope.h"

#include <cmath>

namespace tandem {

std::vector<float> RopeInverseFrequencies(const ModelConfig& c) {
  const int half = c.head_dim / 2;
  const RopeScaling& rs = c.rope_scaling;
  std::vector<float> inv_freq(half);
  for (int i = 0; i < half; ++i) {
    float f = 1.0f / std::pow(c.rope_theta, static_cast<float>(2 * i) /
                                                static_cast<float>(c.head_dim));
    if (rs.type == RopeScaling::Type::kLinear) {
      f /= rs.factor;
    } else if (rs.type == RopeScaling::Type::kLlama3) {
      // Wavelengths (positions per turn) below original / high_freq_factor keep their frequency,
      // those above original / low_freq_factor are divided by factor, and between the two the
      // frequency moves from one to the other linearly in original / wavelength.
      const float original = static_cast<float>(rs.original_max_positions);
      const float low_freq_wavelen = original / rs.low_freq_factor;
      const float high_freq_wavelen = original / rs.high_freq_factor;
      const float wavelen = (1.0f / f) * static_cast<float>(2.0 * M_PI);
      if (wavelen > low_freq_wavelen) {
        f = f / rs.factor;
      } else if (!(wavelen < high_freq_wavelen)) {
        const float smooth = ((1.0f / wavelen) * original - rs.low_freq_factor) /
                             (rs.high_freq_factor - rs.low_freq_factor);
        f = (1.0f - smooth) * f / rs.factor + smooth * f;
      }
    }
    inv_freq[i] = f;
  }
  return inv_freq;
}

}  // namespace tandem
