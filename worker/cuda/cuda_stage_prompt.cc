// Prompt logprobs on the CUDA stage: the LM head over the prompt rows a step scores, in pieces so
// that a long prompt never needs (prompt, vocab) logits at once, and each row's log-softmax,
// next-token logprob and alternatives taken on the host by the rule the CPU backend uses
// (worker/sampling.h).
#include <cuda_runtime.h>

#include <span>

#include "common/status_macros.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/cuda_stage_impl.h"
#include "worker/sampling.h"

namespace tandem {

absl::Status CudaStage::ScorePromptRows(const StepDescriptor& step,
                                        std::span<const ScoredRow> rows, StepOutput& out) {
  const int hidden = c_.hidden_size, vocab = c_.vocab_size;
  const float* host = host_prompt_logits_.as<float>();
  for (size_t a = 0; a < rows.size();) {
    // The next piece: rows [first, first + n) of the pass, holding scored rows a..b-1.
    const int first = rows[a].row;
    size_t b = a;
    while (b < rows.size() && rows[b].row < first + prompt_rows_cap_) ++b;
    const int n = rows[b - 1].row - first + 1;
    const void* normed = xn_.as<char>() + static_cast<size_t>(first) * RowBytes(hidden);
    RETURN_IF_ERROR(HeadLogits(normed, n, /*gemv=*/false, prompt_logits_.as<float>()));
    CUDA_CHECK(cudaMemcpyAsync(host_prompt_logits_.get(), prompt_logits_.get(),
                               static_cast<size_t>(n) * vocab * sizeof(float),
                               cudaMemcpyDeviceToHost, stream_.get()));
    RETURN_IF_ERROR(Drain());
    for (; a < b; ++a) {
      const ScoredRow& r = rows[a];
      std::span<const float> logits(host + static_cast<size_t>(r.row - first) * vocab, vocab);
      LogprobsEntry(out, r.seq).prompt.push_back(
          ComputeLogprob(logits, r.next, step.seqs[r.seq].prompt_logprobs));
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem
