// The sweep's correctness rule for greedy outputs, the project's agreement rule: two runs of one
// prompt must give identical greedy tokens wherever the reference run's own top-2 logprob gap at
// that position is larger than the logits error. In fp16 the logits of a sequence depend a little
// on the batch it shares (the GPU's reduction order changes with the batch size), so at a near-tie
// two correct runs may take different tokens; from there on their outputs differ. The first
// differing token is therefore judged by the reference's gap there: below the tolerance it is a
// near-tie, above it a wrong token.
#pragma once

#include <cmath>
#include <string>
#include <vector>

namespace tandem::loadgen {

// The default tolerance, in nats (a logprob gap equals the gap of the raw logits). The largest
// per-logit error of an fp16 run against Hugging Face measured on the checkpoints of
// docs/performance.md is 0.008-0.019 (max abs; relative error 2-7e-3, within the 1e-2 rule, of
// logits with RMS ~1.2). Two fp16 runs that differ only in the batch they shared each carry such
// an error, so their logits differ by up to about 0.04, and two tokens can trade places only where
// their gap is smaller than that; every fp16 divergence measured there was at 0-0.012. 0.05 keeps
// a margin over that, and is still far below the gaps of most positions (a wrong token lands at a
// random position, whose gap is mostly well above it).
inline constexpr double kDefaultTieTolerance = 0.05;

// A greedy output as the check sees it.
struct GreedyOutput {
  // Each generated token as the API names it: its id over gRPC, its streamed text over an
  // OpenAI-compatible API (one chunk per token).
  std::vector<std::string> tokens;
  // Where the run asked for top-2 logprobs: at each position, the most likely token's logprob
  // minus the second's (nats, >= 0); NaN where the server gave fewer than two.
  std::vector<double> top2_gaps;
  // Over an OpenAI-compatible API, where the run asked for logprobs: the positions whose token
  // has no text of its own (an id the tokenizer does not decode), where a difference cannot be
  // seen in the text.
  std::vector<bool> unnamed;
};

enum class Agreement {
  kIdentical,
  kNearTie,    // first differs where the reference's top-2 gap is below the tolerance
  kDiffers,    // first differs at a clear gap, or one output ends early: a wrong output
  kNoGap,      // first differs where the reference has no top-2 gap to judge by: a failure
  kUnchecked,  // the reference names no token (every one empty: text without a tokenizer), or
               // a token before the first visible difference has no text, so the difference may
               // have begun there unseen: neither passed nor failed
};

struct Verdict {
  Agreement agreement = Agreement::kIdentical;
  int position = -1;            // the first differing token (from 0); -1 when identical
  double gap = std::nan("");    // the reference's top-2 gap there; NaN when unknown
  std::string reference_token;  // the reference's token there ("" past its end)
  std::string token;            // the judged output's token there ("" past its end)
};

// Judges `tokens` (an output of the same prompt and length) against `reference`. A difference at
// a gap below `tolerance` is a near-tie; tolerance 0 asks for identical outputs.
Verdict JudgeGreedy(const GreedyOutput& reference, const std::vector<std::string>& tokens,
                    double tolerance);

// Identical or a near-tie.
inline bool Agrees(const Verdict& v) {
  return v.agreement == Agreement::kIdentical || v.agreement == Agreement::kNearTie;
}

// "identical", "near-tie", "differs", "no logprobs", "unchecked".
const char* AgreementName(Agreement a);

}  // namespace tandem::loadgen
