// The CUDA stage's decode steps: one graph captured per batch-size bucket when the stage loads and
// replayed per step, and steps launched ahead of the host (LaunchDecode) behind the step before.
// A step with a constrained row is never launched ahead; its graph samples as any other, and its
// rows are masked and sampled again behind it (cuda_stage_constrain.cc).
#include "worker/cuda/cuda_stage_impl.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace tandem {

absl::Status CudaStage::Capture(int bucket) {
  prefill_attention_ = false;  // as in every decode step
  CUDA_CHECK(cudaStreamBeginCapture(stream_.get(), cudaStreamCaptureModeThreadLocal));
  absl::Status st = Forward(bucket, has_head_ ? bucket : 0);
  cudaGraph_t g = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream_.get(), &g);
  cuda::Graph graph(g);
  RETURN_IF_ERROR(st);
  CUDA_CHECK(end);
  auto exec = std::make_unique<cuda::GraphExec>();
  RETURN_IF_ERROR(exec->Instantiate(graph.get()));
  graphs_[bucket] = std::move(exec);
  return absl::OkStatus();
}

absl::Status CudaStage::CaptureDecodeGraphs() {
  if (!opt_.cuda_graphs) return absl::OkStatus();
  for (int bucket = 1; bucket <= max_bucket_; bucket *= 2) RETURN_IF_ERROR(Capture(bucket));
  return absl::OkStatus();
}

absl::Status CudaStage::Replay(int bucket) {
  if (!graphs_.contains(bucket)) RETURN_IF_ERROR(Capture(bucket));
  CUDA_CHECK(cudaGraphLaunch(graphs_.at(bucket)->get(), stream_.get()));
  return absl::OkStatus();
}

// Every sequence has one token: pad to the bucket (padding rows write the spare slot), sample
// every row, and replay the bucket's graph.
absl::Status CudaStage::RunDecode(const StepDescriptor& step, const Activations& in,
                                  StepOutput& out, std::span<const int> from_previous, bool wait) {
  RETURN_IF_ERROR(Mark(DecodeObserver::Point::kBegin));
  const int n = static_cast<int>(step.seqs.size());
  const int bucket = NextPow2(n);
  prefill_attention_ = false;
  int32_t* tokens = HostIn<int32_t>(layout_.tokens);
  int32_t* positions = HostIn<int32_t>(layout_.positions);
  int32_t* slots = HostIn<int32_t>(layout_.slots);
  int32_t* gather = HostIn<int32_t>(layout_.gather);
  float* temperature = HostIn<float>(layout_.temperature);
  float* top_p = HostIn<float>(layout_.top_p);
  int32_t* top_k = HostIn<int32_t>(layout_.top_k);
  uint64_t* seed = HostIn<uint64_t>(layout_.seed);
  uint64_t* sample_index = HostIn<uint64_t>(layout_.sample_index);
  // Paged: a row's slot input is where its sequence's table starts in the flat table.
  std::vector<int32_t> table_at;
  if (paged()) RETURN_IF_ERROR(UploadBlockTables(step, table_at));
  for (int i = 0; i < bucket; ++i) {
    const bool real = i < n;
    const SequenceStep* s = real ? &step.seqs[i] : nullptr;
    const bool fed = real && !from_previous.empty() && from_previous[i] >= 0;
    tokens[i] = !real || !has_embedding_ ? 0 : fed ? -1 - from_previous[i] : step.tokens[i];
    positions[i] = real ? s->position : 0;
    slots[i] = paged() ? (real ? table_at[i] : 0) : real ? s->slot : max_slots_;
    gather[i] = i;
    temperature[i] = real ? s->sampling.temperature : 0.0f;
    top_p[i] = real ? s->sampling.top_p : 1.0f;
    top_k[i] = real ? s->sampling.top_k : 0;
    seed[i] = real ? s->sampling.seed : 0;
    sample_index[i] = real ? s->sample_index : 0;
  }
  CUDA_CHECK(cudaMemcpyAsync(inputs_.get(), host_in_[buf_].get(), layout_.total,
                             cudaMemcpyHostToDevice, stream_.get()));
  if (!has_embedding_) RETURN_IF_ERROR(CopyInput(in, 0, n));
  RETURN_IF_ERROR(Mark(DecodeObserver::Point::kForward));
  if (opt_.cuda_graphs) {
    RETURN_IF_ERROR(Replay(bucket));
  } else {
    RETURN_IF_ERROR(Forward(bucket, has_head_ ? bucket : 0));
  }
  if (constrained_step_) {
    std::vector<int> sample_seqs(n);
    for (int i = 0; i < n; ++i) sample_seqs[i] = i;
    RETURN_IF_ERROR(ConstrainSamples(step, sample_seqs));
  }
  RETURN_IF_ERROR(Mark(DecodeObserver::Point::kForwardEnd));
  if (!has_head_) {
    out.hidden.rows = n;
    out.hidden.cols = c_.hidden_size;
    out.hidden.dtype = opt_.dtype;
    out.hidden.where = Where::kDevice;
    out.hidden.data = std::shared_ptr<void>(x_.get(), [](void*) {});
  }
  const absl::Status tail =
      tail_ ? tail_(step, out.hidden, has_head_ ? tokens_out_.as<int32_t>() : nullptr)
            : absl::OkStatus();
  if (has_head_) {
    CUDA_CHECK(cudaMemcpyAsync(host_tokens_[buf_].get(), tokens_out_.get(), n * sizeof(int32_t),
                               cudaMemcpyDeviceToHost, stream_.get()));
    if (step.return_logits) {
      CUDA_CHECK(cudaMemcpyAsync(host_logits_.get(), logits_.get(),
                                 static_cast<size_t>(n) * c_.vocab_size * 4,
                                 cudaMemcpyDeviceToHost, stream_.get()));
    }
  }
  RETURN_IF_ERROR(Mark(DecodeObserver::Point::kEnd));
  if (!wait) return tail;
  RETURN_IF_ERROR(AwaitInput(in));
  RETURN_IF_ERROR(Drain());
  RETURN_IF_ERROR(tail);
  if (observer_ != nullptr) observer_->DecodeDone(num_layers_);
  if (has_head_) ReadDecodeTokens(step, host_tokens_[buf_].as<int32_t>(), out);
  return absl::OkStatus();
}

void CudaStage::ReadDecodeTokens(const StepDescriptor& step, const int32_t* host_tokens,
                                 StepOutput& out) const {
  const float* lg = host_logits_.as<float>();
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    if (!step.seqs[i].sample) continue;
    out.tokens.push_back(host_tokens[i]);
    if (step.return_logits) {
      out.logits.insert(out.logits.end(), lg + i * c_.vocab_size, lg + (i + 1) * c_.vocab_size);
    }
  }
}

bool CudaStage::CanLaunchDecode(const StepDescriptor& step) const {
  return Stage::CanLaunchDecode(step) && has_embedding_ && has_head_ && !tail_ && !watch_ &&
         observer_ == nullptr && static_cast<int>(step.seqs.size()) <= max_bucket_ &&
         std::none_of(step.seqs.begin(), step.seqs.end(), NeedsHostRule) &&
         !ConstrainedSampling::Constrains(step) &&
         std::none_of(step.seqs.begin(), step.seqs.end(),
                      [](const SequenceStep& s) { return s.prompt_logprobs >= 0; });
}

absl::Status CudaStage::LaunchDecode(const StepDescriptor& step,
                                     std::span<const int> from_previous) {
  RETURN_IF_ERROR(CheckLaunch(step, from_previous, static_cast<int>(ahead_.size()),
                              ahead_.empty() ? nullptr : &ahead_.back().step));
  RETURN_IF_ERROR(Validate(step, Activations{}));
  CUDA_CHECK(cudaSetDevice(opt_.device));
  StepOutput unused;
  RETURN_IF_ERROR(RunDecode(step, Activations{}, unused, from_previous, /*wait=*/false));
  CUDA_CHECK(cudaEventRecord(done_[buf_].get(), stream_.get()));
  ahead_.push_back(Launched{step, buf_});
  for (const SequenceStep& s : step.seqs) cached_len_[s.slot] = s.position + 1;
  buf_ ^= 1;
  return absl::OkStatus();
}

bool CudaStage::DecodeDone() const {
  return ahead_.empty() || cudaEventQuery(done_[ahead_.front().buf].get()) != cudaErrorNotReady;
}

absl::StatusOr<StepOutput> CudaStage::FinishDecode() {
  if (ahead_.empty()) return absl::FailedPreconditionError("no decode step is launched");
  const Launched l = std::move(ahead_.front());
  ahead_.pop_front();
  CUDA_CHECK(cudaEventSynchronize(done_[l.buf].get()));
  StepOutput out;
  ReadDecodeTokens(l.step, host_tokens_[l.buf].as<int32_t>(), out);
  return out;
}

}  // namespace tandem
