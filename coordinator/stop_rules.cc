// The stop rules of coordinator/stop_rules.h, in the order the header lists them.
#include "coordinator/stop_rules.h"

#include <algorithm>

namespace tandem {

int StopText::EarliestMatch(const std::vector<std::string>& stops,
                            std::span<const int32_t> generated) {
  absl::StatusOr<std::string_view> text = stream_.Text(generated);
  if (!text.ok()) return -1;
  size_t best = std::string::npos, longest = 0;
  for (const std::string& stop : stops) {
    best = std::min(best, text->find(stop, search_from_));
    longest = std::max(longest, stop.size());
  }
  // A match found later ends in text that is new or may still change (past the stable text), so
  // it starts at most longest - 1 bytes before the stable text's end.
  const size_t stable = stream_.stable();
  search_from_ = std::max(search_from_, stable >= longest ? stable - longest + 1 : 0);
  return best == std::string::npos ? -1 : static_cast<int>(best);
}

StopDecision CheckStop(const ValidatedRequest& request, std::span<const int32_t> generated,
                       int context_length, StopText* text) {
  const int count = static_cast<int>(generated.size());
  const int32_t token = generated.back();
  StopDecision d;
  if (count <= request.min_tokens) {
    // min_tokens: neither EOS nor a stop condition ends the sequence yet.
  } else if (IsEos(request, token)) {
    d.finish = FinishReason::kEos;
  } else if (std::find(request.stop_token_ids.begin(), request.stop_token_ids.end(), token) !=
             request.stop_token_ids.end()) {
    d.finish = FinishReason::kStop;
  } else if (int at = text != nullptr && !request.stop_strings.empty()
                          ? text->EarliestMatch(request.stop_strings, generated)
                          : -1;
             at >= 0) {
    d.finish = FinishReason::kStop;
    d.text_limit = at;
  }
  if (!d.ends() && ReachesLength(request, count, context_length)) {
    d.finish = FinishReason::kLength;
  }
  return d;
}

bool ReachesLength(const ValidatedRequest& request, int count, int context_length) {
  const int prompt = static_cast<int>(request.prompt.size());
  return count >= request.max_new_tokens || prompt + count > context_length;
}

}  // namespace tandem
