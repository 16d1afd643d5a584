// Following a submitted request, and the text a client may see of it.
#include "coordinator/request_stream.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "common/metrics.h"
#include "common/utf8.h"

namespace tandem {
namespace {

// How often a waiting front end looks at its client.
constexpr absl::Duration kPoll = absl::Milliseconds(20);

}  // namespace

absl::StatusOr<RequestState::Snapshot> FollowRequest(Coordinator& c,
                                                     const std::shared_ptr<RequestState>& r,
                                                     absl::Time deadline,
                                                     const ClientGone& client_gone,
                                                     const OnProgress& on_progress) {
  if (r->request().timeout != absl::InfiniteDuration()) {
    deadline = std::min(deadline, r->arrival() + r->request().timeout);
  }
  RequestState::Snapshot s;  // what has come so far, added to as it comes
  while (true) {
    if (r->WaitMore(s, std::min(deadline, absl::Now() + kPoll))) {
      if (!on_progress(s)) {
        c.Cancel(r, absl::CancelledError("the client stopped reading"));
        return absl::CancelledError("the client stopped reading");
      }
    }
    if (s.done) {
      if (!s.status.ok()) return s.status;
      return s;
    }
    if (client_gone()) {
      c.Cancel(r, absl::CancelledError("cancelled by the client"));
      return absl::CancelledError("cancelled by the client");
    }
    if (absl::Now() >= deadline) {
      const absl::Status why = absl::DeadlineExceededError(absl::StrFormat(
          "request %s: deadline exceeded after %d generated tokens", r->request().request_id,
          s.tokens.size()));
      c.Cancel(r, why);
      return why;
    }
  }
}

void RecordRejected(Coordinator& c, const absl::Status& why) {
  if (c.metrics() != nullptr) c.metrics()->CountRequest(why);
}

void RecordEnd(Coordinator& c, const RequestState& r, const absl::Status& outcome) {
  if (c.metrics() == nullptr) return;
  c.metrics()->CountRequest(outcome);
  c.metrics()->request_duration.Observe(absl::ToDoubleSeconds(absl::Now() - r.arrival()));
}

size_t ShowablePrefix(std::string_view text, const std::vector<std::string>& stops) {
  size_t n = CompleteUtf8Prefix(text);
  // Decoders show the bytes of a character that a later token completes as U+FFFD (Hugging
  // Face's do), so a trailing U+FFFD waits for the next token, as in vLLM's detokenizer.
  constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  while (n >= kReplacement.size() && text.substr(n - kReplacement.size(), kReplacement.size()) ==
                                         kReplacement) {
    n -= kReplacement.size();
  }
  for (const std::string& stop : stops) {
    for (size_t k = std::min(stop.size() - 1, n); k > 0; --k) {
      if (text.compare(n - k, k, stop, 0, k) == 0) {
        n -= k;
        break;
      }
    }
  }
  return n;
}

std::span<const int32_t> TextTokens(std::span<const int32_t> tokens, bool done,
                                    v1::FinishReason finish) {
  if (done && finish == v1::FINISH_REASON_EOS && !tokens.empty()) {
    return tokens.first(tokens.size() - 1);
  }
  return tokens;
}

std::string TextStream::Next(std::span<const int32_t> tokens, bool done, int text_limit) {
  if (tokenizer_ == nullptr) return "";
  absl::StatusOr<std::string_view> text = text_.Text(tokens);
  if (!text.ok()) return "";
  size_t show = done ? text->size() : ShowablePrefix(*text, stops_);
  if (done && text_limit >= 0) show = std::min<size_t>(show, text_limit);
  if (show <= sent_) return "";
  std::string piece = ToValidUtf8(text->substr(sent_, show - sent_));
  sent_ = show;
  shown_ += piece;
  return piece;
}

}  // namespace tandem
