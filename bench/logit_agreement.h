// How closely one precision's next-token distributions follow another's (tandem-bench
// --agreement): per position, the KL divergence of the test distribution from the reference's,
// whether their most likely tokens agree, and the logits' error; summarised over every position.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace tandem {

// KL(p || q) in nats, p = softmax(reference), q = softmax(test), computed in double. The spans
// have the same, non-zero length.
double KlDivergence(std::span<const float> reference, std::span<const float> test);

// The index of the largest logit (the lowest such index on a tie).
int ArgMax(std::span<const float> logits);

// How one position's test logits compare with the reference's.
struct PositionAgreement {
  double kl = 0;         // KlDivergence(reference, test), nats
  double rel_error = 0;  // ||test - reference|| / ||reference|| (||test|| where the reference is 0)
  bool same_top1 = false;  // ArgMax(reference) == ArgMax(test)
  // The most likely tokens differ although the reference's top-2 gap is larger than the largest
  // absolute logit error at this position: a difference a near-tie does not explain.
  bool unexplained_top1_difference = false;
};

// One position, compared once: the reference's and the test's logits over the same vocabulary
// (the spans have the same, non-zero length).
PositionAgreement ComparePosition(std::span<const float> reference, std::span<const float> test);

// The summary of many positions' PositionAgreement.
class LogitAgreement {
 public:
  // One position's comparison; the same comparison may go into several summaries (a phase's and
  // the overall one).
  void Add(const PositionAgreement& p);
  // Add(ComparePosition(reference, test)).
  void Add(std::span<const float> reference, std::span<const float> test);

  int64_t positions() const { return static_cast<int64_t>(kl_.size()); }
  double mean_kl() const;
  // The q-quantile (0..1) of the positions' KL divergences (nearest rank).
  double kl_quantile(double q) const;
  // The share of positions whose most likely tokens agree.
  double top1_agreement() const;
  // Positions whose most likely tokens differ although the reference's top-2 gap is larger than
  // the largest absolute logit error at that position: a difference a near-tie does not explain.
  int64_t unexplained_top1_differences() const { return unexplained_; }
  double mean_rel_error() const;  // ||test - reference|| / ||reference||, averaged
  double max_rel_error() const;

  // One line: positions, KL mean / median / p99 / max, top-1 agreement, unexplained differences,
  // relative logits error.
  std::string Summary() const;
  // The same as JSON: positions, kl_mean, kl_median, kl_p99, kl_max, top1_agreement (0..1),
  // unexplained_top1_differences, rel_error_mean, rel_error_max.
  nlohmann::json ToJson() const;

 private:
  std::vector<double> kl_;
  std::vector<double> rel_;
  int64_t same_top1_ = 0;
  int64_t unexplained_ = 0;
};

}  // namespace tandem
