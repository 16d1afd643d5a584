// One request's progress as the coordinator fills it and a front end's handler thread waits on it
// (tokens, logprobs, the end and its reason, the times a request's metrics are made of).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/step.h"
#include "coordinator/finish_reason.h"
#include "coordinator/request_validation.h"
#include "proto/tandem.pb.h"

namespace tandem {

// Shared by the handler thread that waits on it and the scheduler that fills it.
class RequestState {
 public:
  RequestState(ValidatedRequest request, absl::Time arrival)
      : request_(std::move(request)), arrival_(arrival) {}
  const ValidatedRequest& request() const { return request_; }
  absl::Time arrival() const { return arrival_; }

  struct Snapshot {
    std::vector<int32_t> tokens;  // every generated token so far
    std::vector<TokenLogprob> logprobs;         // with request().logprobs >= 0: one per token
    std::vector<TokenLogprob> prompt_logprobs;  // with request().prompt_logprobs >= 0
    bool done = false;
    absl::Status status;  // when done
    v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;  // the front ends speak the wire's
    int text_limit = -1;  // when a stop string ended it: bytes of decoded text to keep
    absl::Time admitted = absl::InfinitePast(), first_token = absl::InfinitePast(),
               finished = absl::InfinitePast();
  };
  // For a follower that keeps its own snapshot: blocks until there are more tokens than `s`
  // holds, the request is done, or `until`; then appends to `s` only what it lacks (tokens,
  // logprobs, prompt logprobs) and copies the rest, so that following a long generation costs
  // its length once, not once per token. True when `s` got tokens or the end.
  bool WaitMore(Snapshot& s, absl::Time until);

  // Scheduler side.
  void Admitted(absl::Time t);
  // `logprob`: the token's, when the request asked for logprobs.
  void Append(int32_t token, absl::Time t, TokenLogprob* logprob = nullptr);
  // Appends the token that ends the request and ends it (OK, `finish`) at once, so that a waiter
  // never sees the last token without the end (a stream would send it as an ordinary token and
  // the end on its own, or show a stop string that the end's text_limit cuts).
  void AppendLast(int32_t token, absl::Time t, TokenLogprob* logprob, FinishReason finish,
                  int text_limit);
  void AppendPromptLogprobs(std::vector<TokenLogprob> logprobs);
  // First call wins; later ones are ignored.
  void Finish(absl::Status status, FinishReason finish, int text_limit, absl::Time t);
  size_t num_tokens();

 private:
  void AppendLocked(int32_t token, absl::Time t, TokenLogprob* logprob)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishLocked(absl::Status status, FinishReason finish, int text_limit, absl::Time t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ValidatedRequest request_;
  const absl::Time arrival_;
  absl::Mutex mu_;
  Snapshot s_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem
