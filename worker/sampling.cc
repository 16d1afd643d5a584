// The sampling rule of worker/sampling.h, on the host.
#include "worker/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/rng.h"

namespace tandem {

absl::Status ValidateSamplingParams(const SamplingParams& p) {
  if (!std::isfinite(p.temperature) || p.temperature < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.temperature must be finite and >= 0, got ", p.temperature));
  }
  if (p.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.top_k must be >= 0 (0: no limit), got ", p.top_k));
  }
  // Written so that NaN fails too.
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.top_p must be in (0, 1], got ", p.top_p));
  }
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.min_p must be in [0, 1], got ", p.min_p));
  }
  if (!(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.presence_penalty must be in [-2, 2], got ", p.presence_penalty));
  }
  if (!(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.frequency_penalty must be in [-2, 2], got ", p.frequency_penalty));
  }
  if (!(p.repetition_penalty > 0.0f && p.repetition_penalty <= 100.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling.repetition_penalty must be in (0, 100] (1: off), got ", p.repetition_penalty));
  }
  return absl::OkStatus();
}

void ApplyPenalties(std::span<float> logits, const SamplingParams& params,
                    std::span<const SeenToken> seen) {
  const float rp = params.repetition_penalty;
  for (const SeenToken& t : seen) {
    if (t.id < 0 || static_cast<size_t>(t.id) >= logits.size()) continue;
    float& x = logits[t.id];
    if (rp != 1.0f && (t.output_count > 0 || t.in_prompt)) x = x > 0.0f ? x / rp : x * rp;
    x -= params.frequency_penalty * static_cast<float>(t.output_count);
    if (t.output_count > 0) x -= params.presence_penalty;
  }
}

TokenLogprob ComputeLogprob(std::span<const float> logits, int32_t token, int top_n) {
  const size_t n = logits.size();
  auto value = [&](size_t i) { return std::isnan(logits[i]) ? -INFINITY : logits[i]; };
  float max_x = -INFINITY;
  for (size_t i = 0; i < n; ++i) max_x = std::max(max_x, value(i));
  // log(sum exp(x - max)) in fp32; with no finite maximum every logprob is -inf or NaN anyway.
  float sum = 0.0f;
  for (size_t i = 0; i < n; ++i) sum += std::exp(value(i) - max_x);
  const float lse = max_x + std::log(sum);
  TokenLogprob out;
  out.token = token;
  out.logprob = value(static_cast<size_t>(token)) - lse;
  const size_t k = std::min(n, static_cast<size_t>(std::max(top_n, 0)));
  if (k == 0) return out;
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
    const float va = value(a), vb = value(b);
    return va > vb || (va == vb && a < b);
  });
  for (size_t j = 0; j < k; ++j) out.top.emplace_back(order[j], value(order[j]) - lse);
  return out;
}

namespace {

int32_t Argmax(std::span<const float> logits) {
  int32_t best = 0;
  // Strict > keeps the lowest index among equal maxima; a NaN first entry is replaced by the
  // first number that follows.
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best] || (std::isnan(logits[best]) && !std::isnan(logits[i]))) {
      best = static_cast<int32_t>(i);
    }
  }
  return best;
}

}  // namespace

int32_t SampleToken(std::span<const float> logits, const SamplingParams& params,
                    uint64_t sample_index) {
  if (params.temperature == 0.0f) return Argmax(logits);

  const size_t n = logits.size();
  // a. softmax of logits / temperature, in fp32.
  std::vector<float> prob(n);
  float max_x = -INFINITY;
  for (size_t i = 0; i < n; ++i) {
    prob[i] = std::isnan(logits[i]) ? -INFINITY : logits[i] / params.temperature;
    max_x = std::max(max_x, prob[i]);
  }
  // Every logit -inf or NaN, or some +inf (where exp(x - max) is NaN): no distribution to draw
  // from, so the greedy pick.
  if (!std::isfinite(max_x)) return Argmax(logits);
  float sum = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    prob[i] = std::exp(prob[i] - max_x);
    sum += prob[i];
  }
  for (size_t i = 0; i < n; ++i) prob[i] /= sum;

  // b, c. candidates by probability descending, lower index first on ties; only the top k need
  // to be in order.
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  const size_t keep_k = params.top_k > 0 ? std::min(n, static_cast<size_t>(params.top_k)) : n;
  auto before = [&](int32_t a, int32_t b) {
    return prob[a] > prob[b] || (prob[a] == prob[b] && a < b);
  };
  std::partial_sort(order.begin(), order.begin() + keep_k, order.end(), before);

  // d. the smallest prefix reaching top_p of the top-k mass.
  float mass_k = 0.0f;
  for (size_t j = 0; j < keep_k; ++j) mass_k += prob[order[j]];
  size_t keep = keep_k;
  if (params.top_p < 1.0f) {
    const float threshold = params.top_p * mass_k;
    float cum = 0.0f;
    for (size_t j = 0; j < keep_k; ++j) {
      cum += prob[order[j]];
      if (cum >= threshold) {
        keep = j + 1;
        break;
      }
    }
  }

  // e. min-p against the first candidate, the most likely; the sorted order makes the kept set
  // a prefix again.
  if (params.min_p > 0.0f) {
    const float floor_p = params.min_p * prob[order[0]];
    size_t j = 1;
    while (j < keep && prob[order[j]] >= floor_p) ++j;
    keep = j;
  }

  // f. inverse-CDF draw over the kept candidates.
  float total = 0.0f;
  for (size_t j = 0; j < keep; ++j) total += prob[order[j]];
  const float target = UniformFloat(params.seed, sample_index) * total;
  float cum = 0.0f;
  for (size_t j = 0; j < keep; ++j) {
    cum += prob[order[j]];
    if (cum > target) return order[j];
  }
  return order[keep - 1];
}

}  // namespace tandem
