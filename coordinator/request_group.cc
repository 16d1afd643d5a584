// Fan-out of a request's n sequences and following them together.
#include "coordinator/request_group.h"

#include <atomic>
#include <random>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "common/rng.h"

namespace tandem {

ValidatedRequest ChoiceRequest(const ValidatedRequest& request, int index, uint64_t fresh_seed) {
  ValidatedRequest out = request;
  out.n = 1;
  out.sampling.seed = request.seed ? *request.seed + static_cast<uint64_t>(index) : fresh_seed;
  if (index > 0) out.prompt_logprobs = -1;
  return out;
}

uint64_t FreshSeed() {
  // One draw from the machine's entropy per process, then a counter through a bijective mix:
  // distinct seeds without locking.
  static const uint64_t base = [] {
    std::random_device device;
    return (static_cast<uint64_t>(device()) << 32) ^ device();
  }();
  static std::atomic<uint64_t> counter{0};
  return RandomBits(base, counter.fetch_add(1));
}

absl::StatusOr<std::vector<std::shared_ptr<RequestState>>> SubmitChoices(
    Coordinator& c, std::vector<ValidatedRequest> prompts) {
  std::vector<ValidatedRequest> sequences;
  for (const ValidatedRequest& prompt : prompts) {
    for (int i = 0; i < prompt.n; ++i) sequences.push_back(ChoiceRequest(prompt, i, FreshSeed()));
  }
  return c.Submit(std::move(sequences));
}

absl::StatusOr<std::vector<RequestState::Snapshot>> FollowChoices(
    Coordinator& c, const std::vector<std::shared_ptr<RequestState>>& choices,
    absl::Time deadline, const ClientGone& client_gone, const OnChoiceProgress& on_progress) {
  const int n = static_cast<int>(choices.size());
  std::vector<absl::StatusOr<RequestState::Snapshot>> results(
      n, absl::UnknownError("not followed"));
  absl::Mutex mu;  // serializes on_progress and guards `failed`
  bool failed = false;
  auto follow = [&](int i) {
    results[i] = FollowRequest(
        c, choices[i], deadline,
        [&] {
          absl::MutexLock lock(&mu);
          return failed || client_gone();
        },
        [&](const RequestState::Snapshot& s) {
          absl::MutexLock lock(&mu);
          return !failed && on_progress(i, s);
        });
    if (!results[i].ok()) {
      absl::MutexLock lock(&mu);
      failed = true;
    }
  };
  std::vector<std::thread> threads;
  for (int i = 1; i < n; ++i) threads.emplace_back(follow, i);
  if (n > 0) follow(0);
  for (std::thread& t : threads) t.join();
  // The first real failure, not a sequence stopped because another failed.
  const absl::Status* first = nullptr;
  for (const auto& r : results) {
    if (r.ok()) continue;
    if (first == nullptr || (first->code() == absl::StatusCode::kCancelled &&
                             r.status().code() != absl::StatusCode::kCancelled)) {
      first = &r.status();
    }
  }
  if (first != nullptr) {
    for (const auto& r : choices) c.Cancel(r, *first);
    return *first;
  }
  std::vector<RequestState::Snapshot> out;
  for (auto& r : results) out.push_back(*std::move(r));
  return out;
}

ChoicesUsage CountUsage(const std::vector<std::shared_ptr<RequestState>>& choices,
                        const std::vector<RequestState::Snapshot>& snapshots) {
  ChoicesUsage u;
  if (!choices.empty()) u.prompt_tokens = static_cast<int>(choices[0]->request().prompt.size());
  for (const auto& s : snapshots) u.completion_tokens += static_cast<int>(s.tokens.size());
  return u;
}

}  // namespace tandem
