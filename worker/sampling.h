// Token sampling: the one rule every backend follows, so that a seeded request picks the same
// token on the CPU and on the GPU and whatever else shares its batch.
//
// Given one row of logits (vocab) and SamplingParams {temperature, top_k, top_p, seed}:
//   1. temperature == 0: greedy, the index of the largest logit (the lowest index on ties; NaN
//      logits are never picked unless every logit is NaN, then 0).
//   2. otherwise, in fp32:
//      a. x_i = logits_i / temperature; p_i = exp(x_i - max_j x_j) / sum_j exp(x_j - max_j x_j).
//         NaN logits count as -inf; when max_j x_j is not finite (every logit -inf or NaN, or
//         some +inf) the token is the greedy pick of step 1.
//      b. candidates sorted by p descending, ties broken by the lower index.
//      c. top_k > 0 keeps the first min(top_k, vocab) candidates.
//      d. top_p < 1 keeps the smallest prefix of those whose cumulative probability, renormalised
//         over the candidates that (c) kept, is >= top_p; always at least one candidate. (As in
//         transformers and vLLM, top-p applies after top-k.)
//      e. total = the kept candidates' probability; u = UniformFloat(seed, sample_index)
//         (common/rng.h); the token is the first kept candidate whose cumulative probability
//         exceeds u * total (the last kept candidate if rounding leaves none).
// sample_index counts the tokens the sequence generated before, so a sequence's draws depend only
// on (seed, its own history), never on the batch.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "worker/stage.h"

namespace tandem {

// INVALID_ARGUMENT naming the field unless temperature is finite and >= 0, top_k >= 0 and
// 0 < top_p <= 1.
absl::Status ValidateSamplingParams(const SamplingParams& params);

// The token drawn from `logits` by the rule above. `params` must be valid and `logits` non-empty.
int32_t SampleToken(std::span<const float> logits, const SamplingParams& params,
                    uint64_t sample_index);

}  // namespace tandem
