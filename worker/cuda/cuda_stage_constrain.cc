// The CUDA stage's constrained rows: token masks built on the host by the grammar matchers
// (worker/constrained_sampling.h), applied to the logits on the device, and the rows sampled
// again behind them.
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/constrained_mask.h"
#include "worker/cuda/cuda_stage_impl.h"

namespace tandem {

absl::Status CudaStage::AllocateMasks() {
  const size_t words = (static_cast<size_t>(c_.vocab_size) + 31) / 32;
  const size_t bytes = MaskRowsBytes() + static_cast<size_t>(samples_cap_) * words * 4;
  RETURN_IF_ERROR(host_masks_.Allocate(bytes));
  return masks_.Allocate(bytes);
}

absl::Status CudaStage::ConstrainSamples(const StepDescriptor& step,
                                         std::span<const int> sample_seqs) {
  if (!constrained_step_ || sample_seqs.empty()) return absl::OkStatus();
  const int samples = static_cast<int>(sample_seqs.size());
  const int words = (c_.vocab_size + 31) / 32;
  const size_t rows_bytes = MaskRowsBytes();
  if (samples > samples_cap_) {
    return absl::InternalError(absl::StrCat("constraint: ", samples, " sampled rows in one pass, ",
                                            "past the stage's ", samples_cap_));
  }
  int32_t* rows = host_masks_.as<int32_t>();
  auto* bits = reinterpret_cast<uint32_t*>(host_masks_.as<char>() + rows_bytes);
  const int packed = constrained_->PackMasks(
      step, sample_seqs, words, std::span<uint32_t>(bits, static_cast<size_t>(samples) * words),
      std::span<int32_t>(rows, samples));
  if (packed == 0) return absl::OkStatus();
  // One copy: the row list, then the packed rows' bits.
  CUDA_CHECK(cudaMemcpyAsync(masks_.get(), host_masks_.get(),
                             rows_bytes + static_cast<size_t>(packed) * words * sizeof(uint32_t),
                             cudaMemcpyHostToDevice, stream_.get()));
  RETURN_IF_ERROR(
      cuda::LaunchMaskLogits(logits_.as<float>(), c_.vocab_size,
                             reinterpret_cast<const uint32_t*>(masks_.as<char>() + rows_bytes),
                             words, masks_.as<int32_t>(), packed, stream_.get()));
  cuda::SamplingArrays arrays{DevIn<float>(layout_.temperature), DevIn<int32_t>(layout_.top_k),
                              DevIn<float>(layout_.top_p), DevIn<uint64_t>(layout_.seed),
                              DevIn<uint64_t>(layout_.sample_index)};
  return cuda::LaunchSample(logits_.as<float>(), probs_.as<float>(), arrays,
                            tokens_out_.as<int32_t>(), samples, c_.vocab_size, stream_.get());
}

void CudaStage::AdvanceConstraints(const StepDescriptor& step, const StepOutput& out) {
  for (int i = 0, j = 0; i < static_cast<int>(step.seqs.size()); ++i) {
    const SequenceStep& s = step.seqs[i];
    if (!s.sample) continue;
    const int row = j++;
    if (s.constraint != nullptr && row < static_cast<int>(out.tokens.size())) {
      constrained_->Advance(s, out.tokens[row]);
    }
  }
}

}  // namespace tandem
