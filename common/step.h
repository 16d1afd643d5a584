// The step types the coordinator and the workers share: sampling parameters, logprobs, and a step
// descriptor with one row per sequence. The coordinator forms steps in this form
// (coordinator/scheduler.h) and the workers execute them (worker/stage.h), so neither side needs
// the other's libraries.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace tandem {
namespace structured {
struct Constraint;  // common/structured/grammar_cache.h
}

// What worker/sampling.h's rule reads; every default is neutral.
struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax); > 0 divides the logits
  int top_k = 0;             // 0: no limit
  float top_p = 1.0f;        // (0, 1]; 1: no limit
  uint64_t seed = 0;         // with the token index, keys the counter-based RNG (common/rng.h)
  float min_p = 0.0f;               // [0, 1]; 0: off
  float presence_penalty = 0.0f;    // [-2, 2]; 0: off
  float frequency_penalty = 0.0f;   // [-2, 2]; 0: off
  float repetition_penalty = 1.0f;  // (0, 100]; 1: off
  bool has_penalties() const {
    return presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f;
  }
};

// The most alternatives a logprob entry may carry (OpenAI's and vLLM's limit).
inline constexpr int kMaxTopLogprobs = 20;

// A distinct token a sequence has seen, for the penalties.
struct SeenToken {
  int32_t id = 0;
  int32_t output_count = 0;  // times the sequence generated it so far
  bool in_prompt = false;
};

// One token's logprob and the most likely alternatives (worker/sampling.h says how).
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;  // (token, logprob), most likely first
};

// One sequence's share of a step: one row of the step descriptor.
struct SequenceStep {
  int32_t slot = 0;        // KV-cache slot of this sequence, the same on every stage
  int32_t position = 0;    // position of this step's first token == tokens already in the cache
  int32_t num_tokens = 1;  // prompt tokens (prefill, possibly a chunk) or 1 (decode)
  bool sample = true;      // the last stage samples a token after this sequence's last token
  SamplingParams sampling;
  uint64_t sample_index = 0;  // tokens this sequence generated before; the RNG counter
  // With a penalty set (sampling.has_penalties()): each distinct token of the sequence that a
  // penalty looks at; the last stage reads it.
  std::vector<SeenToken> seen;
  int logprobs = -1;  // -1: none; k in [0, 20]: the sampled token's logprob and k alternatives
  // -1: none; k in [0, 20]: the logprobs of this step's tokens 1..num_tokens-1 (and of
  // next_prompt_token after the last one, when >= 0), each with k alternatives.
  int prompt_logprobs = -1;
  int32_t next_prompt_token = -1;
  // Nonzero: the step ends the prompt, and writes the sequence's KV-cache out under this key
  // layer by layer as it goes (Stage::OpenKvOut; a prefill worker's hand-off).
  uint64_t kv_out_key = 0;
  // A paged KV-cache (the stage was assigned kv_page_size > 0): the pages holding this sequence's
  // positions [0, position + num_tokens), in order; position p lives in page
  // block_table[p / page_size], row p % page_size, on every stage. Empty: the slot's contiguous
  // rows.
  std::vector<int32_t> block_table;
  // Set on a constrained sequence's sampling rows: the last stage masks the logits with the
  // grammar's allowed tokens and advances the sequence's matcher by what it samples
  // (worker/constrained_sampling.h). Null: free text.
  std::shared_ptr<const structured::Constraint> constraint;
  bool wants_logprobs() const { return logprobs >= 0 || prompt_logprobs >= 0; }
};

// The logprobs a sequence of a step asked for.
struct SequenceLogprobs {
  int seq = 0;                        // index into the step's seqs
  bool has_sampled = false;           // logprobs >= 0 and the sequence sampled
  TokenLogprob sampled;
  std::vector<TokenLogprob> prompt;   // prompt_logprobs >= 0: one per scored row, in order
};

// A token of a step that stands for the one its row's slot sampled in the step before: the
// coordinator sends a one-stage pipeline a sequence's next decode step while the step that samples
// its input still runs, and the stage feeds what that step sampled (worker/service/step_runner.h).
inline constexpr int32_t kPreviousSample = -1;

// What every stage of a pipeline executes, in the order the coordinator issued it.
struct StepDescriptor {
  uint64_t id = 0;
  std::vector<SequenceStep> seqs;
  std::vector<int32_t> tokens;  // every sequence's tokens, concatenated in `seqs` order
  bool return_logits = false;   // the last stage also returns the sampled rows' logits
};

}  // namespace tandem
