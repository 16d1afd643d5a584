// Token sampling: the one rule every backend follows, so that a seeded request picks the same
// token on the CPU and on the GPU and whatever else shares its batch.
//
// Given one row of logits (vocab) and SamplingParams:
//   0. penalties (only when one is set; vLLM's order), on an fp32 copy of the logits, for each
//      token t of the sequence's SeenToken list with c = output_count (times generated so far):
//      if repetition_penalty != 1 and (c > 0 or in_prompt): x_t = x_t > 0 ? x_t / rp : x_t * rp;
//      then x_t -= frequency_penalty * c, and x_t -= presence_penalty when c > 0. Tokens never
//      seen are untouched. Every step below reads the penalised logits.
//   1. temperature == 0: greedy, the index of the largest logit (the lowest index on ties; NaN
//      logits are never picked unless every logit is NaN, then 0). min_p and the cuts are moot.
//   2. otherwise, in fp32:
//      a. x_i = logits_i / temperature; p_i = exp(x_i - max_j x_j) / sum_j exp(x_j - max_j x_j).
//         NaN logits count as -inf; when max_j x_j is not finite (every logit -inf or NaN, or
//         some +inf) the token is the greedy pick of step 1.
//      b. candidates sorted by p descending, ties broken by the lower index.
//      c. top_k > 0 keeps the first min(top_k, vocab) candidates.
//      d. top_p < 1 keeps the smallest prefix of those whose cumulative probability, renormalised
//         over the candidates that (c) kept, is >= top_p; always at least one candidate. (As in
//         transformers and vLLM, top-p applies after top-k.)
//      e. min_p > 0 keeps, of those, the candidates with p_i >= min_p * p_first (p_first: the
//         first candidate's, the largest); the first always stays, and min_p = 1 keeps only the
//         candidates tied with it. (vLLM's v0 order: after top-k and top-p.)
//      f. total = the kept candidates' probability; u = UniformFloat(seed, sample_index)
//         (common/rng.h); the token is the first kept candidate whose cumulative probability
//         exceeds u * total (the last kept candidate if rounding leaves none).
// sample_index counts the tokens the sequence generated before, so a sequence's draws depend only
// on (seed, its own history), never on the batch.
//
// Logprobs are "raw" (vLLM's default): the fp32 log-softmax of the logits as the LM head gave
// them, before penalties, temperature and every cut: lp_i = x_i - m - log(sum_j exp(x_j - m)),
// m = max_j x_j, NaN logits counting as -inf. A token's entry carries its lp and the top n
// alternatives: tokens by lp descending, the lower id first on ties (the order of step 2b).
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "worker/stage.h"

namespace tandem {

// INVALID_ARGUMENT naming the field unless temperature is finite and >= 0, top_k >= 0,
// 0 < top_p <= 1, 0 <= min_p <= 1, the presence and frequency penalties are in [-2, 2] and
// 0 < repetition_penalty <= 100.
absl::Status ValidateSamplingParams(const SamplingParams& params);

// Step 0 of the rule: applies the penalties of `params` for the tokens `seen` to `logits` in
// place. Ids outside the vocabulary are ignored (the step's check rejects them first).
void ApplyPenalties(std::span<float> logits, const SamplingParams& params,
                    std::span<const SeenToken> seen);

// Steps 1-2: the token drawn from `logits` (already penalised: step 0 is the caller's).
// `params` must be valid and `logits` non-empty.
int32_t SampleToken(std::span<const float> logits, const SamplingParams& params,
                    uint64_t sample_index);

// The raw logprob of `token` in `logits` and its `top_n` most likely alternatives (top_n is
// clamped to the vocabulary).
TokenLogprob ComputeLogprob(std::span<const float> logits, int32_t token, int top_n);

}  // namespace tandem
