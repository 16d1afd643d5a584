// The agreement rule for greedy outputs (greedy_agreement.h).
#include "loadgen/greedy_agreement.h"

#include <algorithm>

namespace tandem::loadgen {

Verdict JudgeGreedy(const GreedyOutput& reference, const std::vector<std::string>& tokens,
                    double tolerance) {
  Verdict v;
  const std::vector<std::string>& ref = reference.tokens;
  if (!ref.empty() &&
      std::all_of(ref.begin(), ref.end(), [](const std::string& t) { return t.empty(); })) {
    v.agreement = Agreement::kUnchecked;
    return v;
  }
  const size_t common = std::min(ref.size(), tokens.size());
  size_t k = 0;
  while (k < common && ref[k] == tokens[k]) ++k;
  if (k == common && ref.size() == tokens.size()) return v;
  for (size_t j = 0; j < k && j < reference.unnamed.size(); ++j) {
    if (reference.unnamed[j]) {
      v.agreement = Agreement::kUnchecked;
      v.position = static_cast<int>(k);
      return v;
    }
  }
  v.position = static_cast<int>(k);
  if (k < ref.size()) v.reference_token = ref[k];
  if (k < tokens.size()) v.token = tokens[k];
  if (k < reference.top2_gaps.size()) v.gap = reference.top2_gaps[k];
  if (k == common) {
    v.agreement = Agreement::kDiffers;  // one output ends where the other goes on
  } else if (std::isnan(v.gap)) {
    v.agreement = Agreement::kNoGap;
  } else {
    v.agreement = v.gap < tolerance ? Agreement::kNearTie : Agreement::kDiffers;
  }
  return v;
}

const char* AgreementName(Agreement a) {
  switch (a) {
    case Agreement::kIdentical:
      return "identical";
    case Agreement::kNearTie:
      return "near-tie";
    case Agreement::kDiffers:
      return "differs";
    case Agreement::kNoGap:
      return "no logprobs";
    case Agreement::kUnchecked:
      return "unchecked";
  }
  return "?";
}

}  // namespace tandem::loadgen
