// A request's progress: filled under its own mutex, waited on by the front end's handler thread.
#include "coordinator/request_state.h"

#include <utility>

namespace tandem {

bool RequestState::WaitMore(Snapshot& s, absl::Time until) {
  absl::MutexLock lock(&mu_);
  const size_t seen = s.tokens.size();
  auto ready = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return s_.done || s_.tokens.size() > seen;
  };
  mu_.AwaitWithDeadline(absl::Condition(&ready), until);
  const bool more = s_.tokens.size() > seen || (s_.done && !s.done);
  auto append_new = [](const auto& from, auto& to) {
    if (from.size() > to.size()) to.insert(to.end(), from.begin() + to.size(), from.end());
  };
  append_new(s_.tokens, s.tokens);
  append_new(s_.logprobs, s.logprobs);
  append_new(s_.prompt_logprobs, s.prompt_logprobs);
  s.done = s_.done;
  s.status = s_.status;
  s.finish = s_.finish;
  s.text_limit = s_.text_limit;
  s.admitted = s_.admitted;
  s.first_token = s_.first_token;
  s.finished = s_.finished;
  return more;
}

void RequestState::Admitted(absl::Time t) {
  absl::MutexLock lock(&mu_);
  s_.admitted = t;
}

void RequestState::Append(int32_t token, absl::Time t, TokenLogprob* logprob) {
  absl::MutexLock lock(&mu_);
  AppendLocked(token, t, logprob);
}

void RequestState::AppendLast(int32_t token, absl::Time t, TokenLogprob* logprob,
                              FinishReason finish, int text_limit) {
  absl::MutexLock lock(&mu_);
  AppendLocked(token, t, logprob);
  FinishLocked(absl::OkStatus(), finish, text_limit, t);
}

void RequestState::AppendLocked(int32_t token, absl::Time t, TokenLogprob* logprob) {
  if (s_.done) return;
  if (s_.tokens.empty()) s_.first_token = t;
  s_.tokens.push_back(token);
  if (logprob != nullptr) s_.logprobs.push_back(std::move(*logprob));
}

void RequestState::AppendPromptLogprobs(std::vector<TokenLogprob> logprobs) {
  absl::MutexLock lock(&mu_);
  if (s_.done) return;
  for (TokenLogprob& l : logprobs) s_.prompt_logprobs.push_back(std::move(l));
}

void RequestState::Finish(absl::Status status, FinishReason finish, int text_limit,
                          absl::Time t) {
  absl::MutexLock lock(&mu_);
  FinishLocked(std::move(status), finish, text_limit, t);
}

void RequestState::FinishLocked(absl::Status status, FinishReason finish, int text_limit,
                                absl::Time t) {
  if (s_.done) return;
  s_.done = true;
  s_.status = std::move(status);
  s_.finish = FinishReasonToProto(finish);
  s_.text_limit = text_limit;
  s_.finished = t;
}

size_t RequestState::num_tokens() {
  absl::MutexLock lock(&mu_);
  return s_.tokens.size();
}

}  // namespace tandem
