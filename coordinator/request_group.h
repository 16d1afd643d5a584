// A request of n sequences (sampling.n): each is submitted to the coordinator as a request of its
// own with its own seed, followed together, and answered as one (choices by index, usage over
// all of them). Both front ends (gRPC, OpenAI HTTP) answer n through these.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/coordinator.h"
#include "coordinator/request_stream.h"

namespace tandem {

// One sequence's request: `request` with the seed of sequence `index` (the request's seed +
// index when it set one, else `fresh_seed`), n = 1, and prompt logprobs for sequence 0 only.
ValidatedRequest ChoiceRequest(const ValidatedRequest& request, int index, uint64_t fresh_seed);

// A seed no other call returns in this process, from the machine's entropy.
uint64_t FreshSeed();

// Submits the n sequences of each of a request's prompts as one request (Coordinator::Submit:
// all or none, counted together against the service's room), prompt p's sequence j at p * n + j.
// Sequences without a request id share the first's.
absl::StatusOr<std::vector<std::shared_ptr<RequestState>>> SubmitChoices(
    Coordinator& c, std::vector<ValidatedRequest> prompts);

// Called with a sequence's index whenever it has new tokens or ended; calls are serialized.
using OnChoiceProgress = std::function<bool(int index, const RequestState::Snapshot&)>;

// Follows every sequence until all end (FollowRequest, one thread per sequence beyond the
// first). The first failure cancels the others and is returned; otherwise every final snapshot,
// by index.
absl::StatusOr<std::vector<RequestState::Snapshot>> FollowChoices(
    Coordinator& c, const std::vector<std::shared_ptr<RequestState>>& choices,
    absl::Time deadline, const ClientGone& client_gone, const OnChoiceProgress& on_progress);

// Usage of a finished request: the prompt once, every sequence's generated tokens.
struct ChoicesUsage {
  int prompt_tokens = 0;
  int completion_tokens = 0;
};
ChoicesUsage CountUsage(const std::vector<std::shared_ptr<RequestState>>& choices,
                        const std::vector<RequestState::Snapshot>& snapshots);

}  // namespace tandem
