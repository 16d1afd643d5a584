// The engine's one interface: a contiguous range of layers of one model on one device, stepping a
// batch of sequences. Backends (cpu/, cuda/) implement it; workers and tests drive it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "common/model_config.h"

namespace tandem {

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

// One sequence's share of a step.
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
  bool wants_logprobs() const { return logprobs >= 0 || prompt_logprobs >= 0; }
};

// The logprobs a sequence of a step asked for.
struct SequenceLogprobs {
  int seq = 0;                        // index into the step's seqs
  bool has_sampled = false;           // logprobs >= 0 and the sequence sampled
  TokenLogprob sampled;
  std::vector<TokenLogprob> prompt;   // prompt_logprobs >= 0: one per scored row, in order
};

// What every stage of a pipeline executes, in the order the coordinator issued it.
struct StepDescriptor {
  uint64_t id = 0;
  std::vector<SequenceStep> seqs;
  std::vector<int32_t> tokens;  // every sequence's tokens, concatenated in `seqs` order
  bool return_logits = false;   // the last stage also returns the sampled rows' logits
};

enum class Where { kHost, kDevice };

// Hidden states between stages: [rows = sum of num_tokens, cols = hidden_size], row-major.
struct Activations {
  int64_t rows = 0;
  int64_t cols = 0;
  DType dtype = DType::kF32;
  Where where = Where::kHost;
  std::shared_ptr<void> data;  // host or device memory, kept alive by whoever holds a copy
  // Set on device activations that may still be arriving (ActivationTransport::PostRecv), so that
  // a stage can queue its work behind them before they are there: a stream must wait for `ready`
  // (a cudaEvent_t of the same device) before it reads `data`, and whoever computes from them must
  // call `arrival` before trusting (or returning) the result. `arrival` returns the host time at
  // which the data was seen complete, or the transport's error (the peer silent past the timeout,
  // another step's frame, cancelled), after which `ready` has completed too, over data to be
  // discarded. Idempotent; valid as long as the transport that made it.
  void* ready = nullptr;
  std::function<absl::StatusOr<absl::Time>()> arrival;
  size_t nbytes() const { return static_cast<size_t>(rows * cols) * DTypeSize(dtype); }
};

struct StepOutput {
  Activations hidden;           // every stage but the last: input of the next stage
  std::vector<int32_t> tokens;  // last stage: one per sequence with sample == true, in order
  std::vector<float> logits;    // last stage, return_logits: [tokens.size(), vocab] fp32
  std::vector<SequenceLogprobs> logprobs;  // last stage: one per sequence that wants_logprobs()
};

class Stage {
 public:
  virtual ~Stage() = default;
  // Runs one step. The first stage reads step.tokens and ignores `in`; the others read `in`.
  // Errors (bad slot, position past the context, shape mismatch) leave the stage usable.
  virtual absl::StatusOr<StepOutput> Step(const StepDescriptor& step, const Activations& in) = 0;
  virtual const ModelConfig& config() const = 0;
};

// What a stage loads and how much KV-cache it keeps.
struct StageSpec {
  std::filesystem::path model_dir;
  int first_layer = 0;      // inclusive; 0 also loads the embeddings
  int last_layer = -1;      // exclusive; -1 or num_layers also loads final norm + LM head
  int max_slots = 8;        // concurrent sequences
  int max_seq_len = 0;      // 0: the model's max_positions
};

}  // namespace tandem
