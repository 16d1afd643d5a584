// The stop rules of coordinator/stop_rules.h, in the order the header lists them.
#include "coordinator/stop_rules.h"

#include <algorithm>

namespace tandem {
namespace {

// The byte offset of the earliest match of any of `stops` in the decoded text, or -1.
int EarliestStopString(const std::vector<std::string>& stops, std::span<const int32_t> generated,
                       const TextDecoder& decode) {
  if (stops.empty() || !decode) return -1;
  // Tokens come back one at a time, so the earliest match is always in the newest text.
  absl::StatusOr<std::string> text = decode(generated);
  if (!text.ok()) return -1;
  size_t best = std::string::npos;
  for (const std::string& stop : stops) best = std::min(best, text->find(stop));
  return best == std::string::npos ? -1 : static_cast<int>(best);
}

}  // namespace

StopDecision CheckStop(const ValidatedRequest& request, std::span<const int32_t> generated,
                       int context_length, const TextDecoder& decode) {
  const int count = static_cast<int>(generated.size());
  const int32_t token = generated.back();
  StopDecision d;
  if (count <= request.min_tokens) {
    // min_tokens: neither EOS nor a stop condition ends the sequence yet.
  } else if (IsEos(request, token)) {
    d.finish = v1::FINISH_REASON_EOS;
  } else if (std::find(request.stop_token_ids.begin(), request.stop_token_ids.end(), token) !=
             request.stop_token_ids.end()) {
    d.finish = v1::FINISH_REASON_STOP;
  } else if (int at = EarliestStopString(request.stop_strings, generated, decode); at >= 0) {
    d.finish = v1::FINISH_REASON_STOP;
    d.text_limit = at;
  }
  if (!d.ends() && ReachesLength(request, count, context_length)) {
    d.finish = v1::FINISH_REASON_LENGTH;
  }
  return d;
}

bool ReachesLength(const ValidatedRequest& request, int count, int context_length) {
  const int prompt = static_cast<int>(request.prompt.size());
  return count >= request.max_new_tokens || prompt + count > context_length;
}

}  // namespace tandem
