// The rotary inverse frequencies against the published formulas written out in double: Llama 3.1's
// scaling as Meta's reference code applies it, linear scaling, and the plain theta^(-2i/d).
#include "common/rope.h"

#include <gtest/gtest.h>

#include <cmath>

namespace tandem {
namespace {

ModelConfig Config(int head_dim, float theta) {
  ModelConfig c;
  c.head_dim = head_dim;
  c.rope_theta = theta;
  return c;
}

// Meta's apply_scaling (llama3.1 release), in double.
double Llama3(double freq, double factor, double low, double high, double old) {
  const double wavelen = 2 * M_PI / freq;
  if (wavelen < old / high) return freq;
  if (wavelen > old / low) return freq / factor;
  const double smooth = (old / wavelen - low) / (high - low);
  return (1 - smooth) * freq / factor + smooth * freq;
}

TEST(RopeTest, DefaultIsThetaToTheMinusTwoIOverD) {
  const std::vector<float> f = RopeInverseFrequencies(Config(100, 10000.0f));
  ASSERT_EQ(f.size(), 50u);
  for (int i = 0; i < 50; ++i) {
    const double want = std::pow(10000.0, -2.0 * i / 100);
    EXPECT_NEAR(f[i], want, 2e-6 * want) << i;
  }
}

// Llama 3.1 8B's parameters (theta 5e5, head_dim 128, factor 8, 1, 4, 8192) and Llama 3.2's
// factor 32: every frequency within fp32 rounding of the formula (theta^x in fp32 is good to
// about ln(theta) ulp), and all three bands populated.
TEST(RopeTest, Llama3ScalingFollowsMetasFormulaInEveryBand) {
  for (float factor : {8.0f, 32.0f}) {
    ModelConfig c = Config(128, 500000.0f);
    c.rope_scaling = {RopeScaling::Type::kLlama3, factor, 1.0f, 4.0f, 8192};
    const std::vector<float> f = RopeInverseFrequencies(c);
    ASSERT_EQ(f.size(), 64u);
    int kept = 0, divided = 0, ramped = 0;
    for (int i = 0; i < 64; ++i) {
      const double base = std::pow(500000.0, -2.0 * i / 128);
      const double want = Llama3(base, factor, 1, 4, 8192);
      EXPECT_NEAR(f[i], want, 2e-6 * want) << "factor " << factor << " i " << i;
      kept += want == base;
      divided += want == base / factor;
      ramped += want != base && want != base / factor;
    }
    EXPECT_GT(kept, 0);
    EXPECT_GT(divided, 0);
    EXPECT_GT(ramped, 0);
  }
}

TEST(RopeTest, LinearScalingDividesEveryFrequency) {
  ModelConfig c = Config(64, 10000.0f);
  c.rope_scaling.type = RopeScaling::Type::kLinear;
  c.rope_scaling.factor = 4.0f;
  const std::vector<float> f = RopeInverseFrequencies(c);
  for (int i = 0; i < 32; ++i) {
    const double want = std::pow(10000.0, -2.0 * i / 64) / 4;
    EXPECT_NEAR(f[i], want, 2e-6 * want) << i;
  }
}

}  // namespace
}  // namespace tandem
