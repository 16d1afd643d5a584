// Next-token agreement between two precisions (logit_agreement.h).
#include "bench/logit_agreement.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_format.h"

namespace tandem {
namespace {

// log(sum(exp(x))) over the logits, shifted by their maximum.
double LogSumExp(std::span<const float> x, double max) {
  double sum = 0;
  for (float v : x) sum += std::exp(double(v) - max);
  return max + std::log(sum);
}

}  // namespace

double KlDivergence(std::span<const float> reference, std::span<const float> test) {
  const double lse_p = LogSumExp(reference, *std::max_element(reference.begin(), reference.end()));
  const double lse_q = LogSumExp(test, *std::max_element(test.begin(), test.end()));
  double kl = 0;
  for (size_t i = 0; i < reference.size(); ++i) {
    const double log_p = double(reference[i]) - lse_p;
    const double log_q = double(test[i]) - lse_q;
    kl += std::exp(log_p) * (log_p - log_q);
  }
  return std::max(kl, 0.0);  // rounding can leave -1e-17 where the distributions are equal
}

int ArgMax(std::span<const float> logits) {
  return static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

PositionAgreement ComparePosition(std::span<const float> reference, std::span<const float> test) {
  PositionAgreement p;
  p.kl = KlDivergence(reference, test);
  const int top_ref = ArgMax(reference), top_test = ArgMax(test);
  double diff2 = 0, ref2 = 0, max_abs = 0;
  for (size_t i = 0; i < reference.size(); ++i) {
    const double d = double(test[i]) - reference[i];
    diff2 += d * d;
    ref2 += double(reference[i]) * reference[i];
    max_abs = std::max(max_abs, std::abs(d));
  }
  p.rel_error = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  p.same_top1 = top_ref == top_test;
  if (p.same_top1) return p;
  // The reference's margin of its token over the runner-up.
  double second = -INFINITY;
  for (size_t i = 0; i < reference.size(); ++i) {
    if (static_cast<int>(i) != top_ref) second = std::max(second, double(reference[i]));
  }
  p.unexplained_top1_difference = double(reference[top_ref]) - second > max_abs;
  return p;
}

void LogitAgreement::Add(const PositionAgreement& p) {
  kl_.push_back(p.kl);
  rel_.push_back(p.rel_error);
  if (p.same_top1) ++same_top1_;
  if (p.unexplained_top1_difference) ++unexplained_;
}

void LogitAgreement::Add(std::span<const float> reference, std::span<const float> test) {
  Add(ComparePosition(reference, test));
}

double LogitAgreement::mean_kl() const {
  return kl_.empty() ? 0 : std::accumulate(kl_.begin(), kl_.end(), 0.0) / kl_.size();
}

double LogitAgreement::kl_quantile(double q) const {
  if (kl_.empty()) return 0;
  std::vector<double> sorted = kl_;
  std::sort(sorted.begin(), sorted.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * sorted.size()));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

double LogitAgreement::top1_agreement() const {
  return kl_.empty() ? 0 : double(same_top1_) / kl_.size();
}

double LogitAgreement::mean_rel_error() const {
  return rel_.empty() ? 0 : std::accumulate(rel_.begin(), rel_.end(), 0.0) / rel_.size();
}

double LogitAgreement::max_rel_error() const {
  return rel_.empty() ? 0 : *std::max_element(rel_.begin(), rel_.end());
}

std::string LogitAgreement::Summary() const {
  return absl::StrFormat(
      "%d positions: KL mean %.3g, median %.3g, p99 %.3g, max %.3g nats; top-1 agreement "
      "%.2f%% (%d differences beyond a near-tie); logits error mean %.3g, max %.3g (relative)",
      positions(), mean_kl(), kl_quantile(0.5), kl_quantile(0.99), kl_quantile(1.0),
      100 * top1_agreement(), unexplained_top1_differences(), mean_rel_error(), max_rel_error());
}

nlohmann::json LogitAgreement::ToJson() const {
  return {{"positions", positions()},
          {"kl_mean", mean_kl()},
          {"kl_median", kl_quantile(0.5)},
          {"kl_p99", kl_quantile(0.99)},
          {"kl_max", kl_quantile(1.0)},
          {"top1_agreement", top1_agreement()},
          {"unexplained_top1_differences", unexplained_top1_differences()},
          {"rel_error_mean", mean_rel_error()},
          {"rel_error_max", max_rel_error()}};
}

}  // namespace tandem
