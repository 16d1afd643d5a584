// The CUDA Stage: weights uploaded once as fp16/bf16, a KV-cache sized up front, the forward pass
// enqueued on one stream (kernels of kernels.h, cuBLAS GEMMs), decode steps replayed from CUDA
// graphs captured per batch-size bucket.

// This file: loading, steps (validation, inputs, row chunks) and the public functions of
// cuda_stage.h; the class and its other files are in cuda_stage_impl.h.
#include "worker/cuda/cuda_stage.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/rope.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"
#include "worker/context_fit.h"
#include "worker/cuda/block_tables.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/cuda_stage_impl.h"
#include "worker/cuda/host_copy.h"
#include "worker/cuda/kernels.h"
#include "worker/cuda/prefill_attention.h"
#include "worker/cuda/weight_upload.h"
#include "worker/kv_out.h"
#include "worker/sampling.h"
#include "worker/step_check.h"
#include "worker/weights.h"

namespace tandem {
namespace {

// The host rule (worker/sampling.h) for the sampled sequences that need it, over out.logits
// ([sampled, vocab] fp32, the LM head's raw output): their tokens are drawn again with the
// penalties and min_p, and their logprobs taken from the raw rows.
void ApplyHostRule(const StepDescriptor& step, int vocab, StepOutput& out) {
  std::vector<float> penalised;
  for (int i = 0, j = 0; i < static_cast<int>(step.seqs.size()); ++i) {
    const SequenceStep& s = step.seqs[i];
    if (!s.sample) continue;
    const int row_index = j++;
    if (!NeedsHostRule(s)) continue;
    std::span<const float> row(out.logits.data() + static_cast<size_t>(row_index) * vocab, vocab);
    int32_t& token = out.tokens[row_index];
    if (s.sampling.has_penalties()) {
      penalised.assign(row.begin(), row.end());
      ApplyPenalties(penalised, s.sampling, s.seen);
      token = SampleToken(penalised, s.sampling, s.sample_index);
    } else if (s.sampling.min_p > 0.0f) {
      token = SampleToken(row, s.sampling, s.sample_index);
    }
    if (s.logprobs >= 0) {
      SequenceLogprobs& l = LogprobsEntry(out, i);
      l.has_sampled = true;
      l.sampled = ComputeLogprob(row, token, s.logprobs);
    }
  }
}

}  // namespace

absl::Status CudaStage::Load(const StageSpec& spec) {
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  const Clock::time_point t0 = Clock::now();
  RETURN_IF_ERROR(CheckOptions(spec));
  RETURN_IF_ERROR(UploadWeights(spec));
  const Clock::time_point t1 = Clock::now();
  RETURN_IF_ERROR(AllocateWorkspace());
  RETURN_IF_ERROR(AllocateKvCache());
  const Clock::time_point t2 = Clock::now();
  RETURN_IF_ERROR(CaptureDecodeGraphs());
  const Clock::time_point t3 = Clock::now();
  // Constrained rows' masks come from the model folder's tokenizer, read at the first one.
  std::vector<int32_t> eos;
  if (c_.eos_token_id >= 0) eos.push_back(c_.eos_token_id);
  constrained_ = std::make_unique<ConstrainedSampling>(spec.model_dir, std::move(eos));
  spdlog::info(
      "CUDA stage of layers [{}, {}): weights in {:.3f} s ({} arena(s)), buffers and "
      "KV-cache of {} bytes in {:.3f} s, {} decode graph(s) in {:.3f} s",
      first_layer_, first_layer_ + num_layers_, seconds(t0, t1), placed_.size(), kv_.size(),
      seconds(t1, t2), graphs_.size(), seconds(t2, t3));
  return absl::OkStatus();
}

absl::Status CudaStage::CheckOptions(const StageSpec& spec) {
  CUDA_CHECK(cudaSetDevice(opt_.device));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, opt_.device));
  sm_count_ = prop.multiProcessorCount;
  if (opt_.dtype != DType::kF16 && opt_.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA backend dtype must be F16 or BF16, got ",
                                                   std::string(DTypeName(opt_.dtype))));
  }
  if (!(opt_.kv_memory_fraction > 0.0f && opt_.kv_memory_fraction <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_memory_fraction must be in (0, 1], got ", opt_.kv_memory_fraction));
  }
  if (spec.max_slots < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_slots must be >= 1, got ", spec.max_slots));
  }
  max_slots_ = spec.max_slots;
  max_seq_len_ = spec.max_seq_len == 0 ? c_.max_positions : spec.max_seq_len;
  if (max_seq_len_ < 1 || max_seq_len_ > c_.max_positions) {
    return absl::InvalidArgumentError(absl::StrCat("max_seq_len must be in [1, ", c_.max_positions,
                                                   "] (the model's max positions) or 0, got ",
                                                   spec.max_seq_len));
  }
  const int64_t capacity =
      (int64_t{max_seq_len_} + cuda::kKvSeqAlign - 1) / cuda::kKvSeqAlign * cuda::kKvSeqAlign;
  if (capacity > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("max_seq_len ", max_seq_len_, " rounds up to ",
                                                   capacity, " cached positions, beyond int"));
  }
  seq_capacity_ = static_cast<int>(capacity);
  const int last = spec.last_layer == -1 ? c_.num_layers : spec.last_layer;
  if (spec.kv_cache_fp8 && spec.kv_page_size == 0) {
    return absl::InvalidArgumentError(
        "an FP8 KV-cache (kv_cache_dtype fp8) needs the paged cache; give the stage a "
        "kv_page_size");
  }
  if (spec.kv_page_size != 0) {
    RETURN_IF_ERROR(CheckPagedOptions(spec));
  } else {
    // Refused before anything is allocated: a cache whose size overflows or exceeds the GPU.
    RETURN_IF_ERROR(KvBytes(std::clamp(last - spec.first_layer, 1, c_.num_layers),
                            static_cast<int64_t>(prop.totalGlobalMem), "GPU memory in all")
                        .status());
  }
  if (c_.hidden_size % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA backend needs hidden_size a multiple of 8, got ", c_.hidden_size));
  }
  if ((c_.num_heads / c_.num_kv_heads) * c_.head_dim > cuda::kMaxAttentionGroupWidth ||
      c_.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA attention needs an even head_dim and (num_heads / num_kv_heads) * head_dim <= ",
        cuda::kMaxAttentionGroupWidth));
  }
  return absl::OkStatus();
}

absl::Status CudaStage::CheckPagedOptions(const StageSpec& spec) {
  const int ps = spec.kv_page_size;
  if (ps < cuda::kMinKvPageSize || (ps & (ps - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_page_size must be 0 (contiguous slots) or a power of two >= ", cuda::kMinKvPageSize,
        " for the CUDA backend, got ", ps));
  }
  if (!cuda::PagedDecodeAttentionTakes(c_.head_dim, c_.num_heads / c_.num_kv_heads)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a paged KV-cache on the CUDA backend needs head_dim a multiple of 8, or of 4 up to 128 "
        "with at most 8 query heads per kv head; got head_dim ",
        c_.head_dim, " with ", c_.num_heads / c_.num_kv_heads, "; run with kv_page_size 0"));
  }
  if (spec.kv_pages < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_pages must be >= 0 (0: as many as the KV memory holds), got ", spec.kv_pages));
  }
  if (spec.kv_cache_fp8 &&
      !cuda::Fp8PagedAttentionTakes(c_.head_dim, c_.num_heads / c_.num_kv_heads)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "an FP8 KV-cache on the CUDA backend needs head_dim a multiple of 4 up to 128 with at "
        "most 8 query heads per kv head; got head_dim ",
        c_.head_dim, " with ", c_.num_heads / c_.num_kv_heads));
  }
  kv_fp8_ = spec.kv_cache_fp8;
  page_size_ = ps;
  pages_asked_ = spec.kv_pages;
  max_seq_pages_ = (max_seq_len_ + ps - 1) / ps;
  return absl::OkStatus();
}

absl::Status CudaStage::CheckBlockTables(const StepDescriptor& step) const {
  if (paged()) return cuda::CheckBlockTables(step, page_size_, num_pages_, max_seq_pages_);
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const SequenceStep& s = step.seqs[i];
    if (s.block_table.empty()) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", step.id, ": sequence ", i, " (slot ", s.slot, ") names ", s.block_table.size(),
        " KV pages; this stage's KV-cache is contiguous slots (assign it a kv_page_size for "
        "pages)"));
  }
  return absl::OkStatus();
}

absl::Status CudaStage::UploadBlockTables(const StepDescriptor& step,
                                          std::vector<int32_t>& offsets) {
  int32_t* table = host_table_[buf_].as<int32_t>();
  table[0] = num_pages_;  // the padding page, for the padding rows of a decode bucket
  int32_t used = 1;
  offsets.resize(step.seqs.size());
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const std::vector<int32_t>& t = step.seqs[i].block_table;
    offsets[i] = used;
    std::memcpy(table + used, t.data(), t.size() * sizeof(int32_t));
    used += static_cast<int32_t>(t.size());
  }
  CUDA_CHECK(cudaMemcpyAsync(table_.get(), table, used * sizeof(int32_t), cudaMemcpyHostToDevice,
                             stream_.get()));
  return absl::OkStatus();
}

absl::Status CudaStage::Validate(const StepDescriptor& step, const Activations& in) const {
  const StepLimits limits{max_slots_, max_seq_len_, c_.vocab_size, c_.hidden_size, has_embedding_};
  // Paged: what a sequence's pages hold is the coordinator's to know (a prefix may be cached
  // there by another sequence), so only the context bounds a position.
  RETURN_IF_ERROR(
      ValidateStep(step, in, limits,
                   paged() ? std::span<const int>(any_len_) : std::span<const int>(cached_len_)));
  RETURN_IF_ERROR(CheckBlockTables(step));
  if (in.ready != nullptr && in.where != Where::kDevice) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", step.id, ": input activations with a ready event must be in device memory"));
  }
  if (!has_embedding_ && in.where == Where::kDevice && in.dtype != opt_.dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("step ", step.id, ": input activations in device memory are ",
                     std::string(DTypeName(in.dtype)), ", the stage runs in ",
                     std::string(DTypeName(opt_.dtype))));
  }
  return absl::OkStatus();
}

// Before the host waits for a step whose input may still be arriving: the transport's verdict on
// that input. On an error the transfer was aborted, so the stream drains (over data discarded).
absl::Status CudaStage::AwaitInput(const Activations& in) {
  if (!in.arrival) return absl::OkStatus();
  const absl::StatusOr<absl::Time> arrived = in.arrival();
  if (arrived.ok()) return absl::OkStatus();
  cudaStreamSynchronize(stream_.get());
  return arrived.status();
}

absl::Status CudaStage::Drain() const {
  if (!watch_) {
    CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
    return absl::OkStatus();
  }
  using SteadyClock = std::chrono::steady_clock;
  absl::Status failed;
  SteadyClock::time_point next = SteadyClock::now() + std::chrono::milliseconds(1);
  SteadyClock::time_point give_up = SteadyClock::time_point::max();
  for (uint64_t i = 0;; ++i) {
    const cudaError_t q = cudaStreamQuery(stream_.get());
    if (q == cudaSuccess) return failed;
    if (q != cudaErrorNotReady) return cuda::CudaError(q, "cudaStreamQuery", __FILE__, __LINE__);
    if ((i & 63) != 0) continue;
    const SteadyClock::time_point now = SteadyClock::now();
    if (!failed.ok()) {
      if (now > give_up) return failed;  // the stream stays busy; the stage is not usable
    } else if (now >= next) {
      failed = watch_();
      next = now + std::chrono::milliseconds(1);
      if (!failed.ok()) give_up = now + std::chrono::seconds(10);
    }
  }
}

// Rows [row0, row0 + rows) of `in` into x_.
absl::Status CudaStage::CopyInput(const Activations& in, int64_t row0, int rows) {
  const size_t row_bytes = RowBytes(c_.hidden_size);
  const size_t in_row_bytes = static_cast<size_t>(in.cols) * DTypeSize(in.dtype);
  const char* src = static_cast<const char*>(in.data.get()) + row0 * in_row_bytes;
  if (in.where == Where::kDevice) {
    if (in.ready != nullptr) {  // still arriving: the step runs once it is there
      CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), static_cast<cudaEvent_t>(in.ready), 0));
    }
    CUDA_CHECK(
        cudaMemcpyAsync(x_.get(), src, rows * row_bytes, cudaMemcpyDeviceToDevice, stream_.get()));
    return absl::OkStatus();
  }
  char* staging = host_hidden_.as<char>();
  const size_t n = static_cast<size_t>(rows) * c_.hidden_size;
  if (in.dtype == opt_.dtype) {
    std::memcpy(staging, src, rows * row_bytes);
  } else {
    std::vector<float> f(n);
    ToFloat(in.dtype, src, n, f.data());
    FromFloat(opt_.dtype, f.data(), n, staging);
  }
  CUDA_CHECK(
      cudaMemcpyAsync(x_.get(), staging, rows * row_bytes, cudaMemcpyHostToDevice, stream_.get()));
  return absl::OkStatus();
}

// Any step: its rows in chunks of at most rows_cap_, each through every layer.
absl::Status CudaStage::RunChunks(const StepDescriptor& step, const Activations& in,
                                  StepOutput& out) {
  if (observer_ != nullptr) observer_->OtherStep();
  int64_t total = 0;
  for (const SequenceStep& s : step.seqs) total += s.num_tokens;
  const size_t row_bytes = RowBytes(c_.hidden_size);
  const bool single = total <= rows_cap_;
  if (!has_head_ && !single && out_hidden_.size() < total * row_bytes) {
    RETURN_IF_ERROR(out_hidden_.Allocate(total * row_bytes));
  }
  // Paged: a row's slot input is where its sequence's table starts in the flat table.
  std::vector<int32_t> table_at;
  if (paged()) RETURN_IF_ERROR(UploadBlockTables(step, table_at));
  // Row -> (sequence, token) as chunks are cut.
  size_t seq = 0;
  int tok = 0;
  for (int64_t row0 = 0; row0 < total; row0 += rows_cap_) {
    const int rows = static_cast<int>(std::min<int64_t>(rows_cap_, total - row0));
    int32_t* tokens = HostIn<int32_t>(layout_.tokens);
    int32_t* positions = HostIn<int32_t>(layout_.positions);
    int32_t* slots = HostIn<int32_t>(layout_.slots);
    std::vector<ScoredRow> scored;  // rows of this chunk scored for prompt logprobs
    std::vector<int> sample_seqs;   // the sequence of each sampled row of this chunk
    int samples = 0, chunk_seqs = 0;
    for (int r = 0; r < rows; ++r) {
      const SequenceStep& s = step.seqs[seq];
      if (tok == 0 || r == 0) ++chunk_seqs;
      tokens[r] = has_embedding_ ? step.tokens[row0 + r] : 0;
      positions[r] = s.position + tok;
      slots[r] = paged() ? table_at[seq] : s.slot;
      if (has_head_ && s.prompt_logprobs >= 0) {
        // Each row against the token after it; the last against next_prompt_token unless the
        // row samples (as the CPU backend).
        if (tok + 1 < s.num_tokens) {
          scored.push_back({r, static_cast<int>(seq), step.tokens[row0 + r + 1]});
        } else if (!s.sample && s.next_prompt_token >= 0) {
          scored.push_back({r, static_cast<int>(seq), s.next_prompt_token});
        }
      }
      if (++tok == s.num_tokens) {
        if (s.sample && has_head_) {
          const int j = samples++;
          sample_seqs.push_back(static_cast<int>(seq));
          HostIn<int32_t>(layout_.gather)[j] = r;
          HostIn<int32_t>(layout_.sample_positions)[j] = positions[r];
          HostIn<int32_t>(layout_.sample_slots)[j] = slots[r];
          HostIn<float>(layout_.temperature)[j] = s.sampling.temperature;
          HostIn<float>(layout_.top_p)[j] = s.sampling.top_p;
          HostIn<int32_t>(layout_.top_k)[j] = s.sampling.top_k;
          HostIn<uint64_t>(layout_.seed)[j] = s.sampling.seed;
          HostIn<uint64_t>(layout_.sample_index)[j] = s.sample_index;
        }
        ++seq;
        tok = 0;
      }
    }
    CUDA_CHECK(cudaMemcpyAsync(inputs_.get(), host_in_[buf_].get(), layout_.total,
                               cudaMemcpyHostToDevice, stream_.get()));
    if (!has_embedding_) RETURN_IF_ERROR(CopyInput(in, row0, rows));
    // Prompt runs of 8 rows or more on average; batch-invariant mode keeps the one-row kernel,
    // whose arithmetic decode steps share.
    prefill_attention_ = !opt_.batch_invariant && rows >= 8 * chunk_seqs &&
                         cuda::PrefillAttentionSupported(c_.head_dim);
    // The last chunk writes its step's write-outs out layer by layer: every row before it has
    // gone through every layer.
    absl::Cleanup no_outs = [this] { forward_outs_.clear(); };
    if (row0 + rows == total) {
      forward_outs_ = step_outs_;
    }
    score_rows_ = !scored.empty();
    absl::Cleanup unscored = [this] { score_rows_ = false; };
    RETURN_IF_ERROR(Forward(rows, samples));
    if (has_head_) RETURN_IF_ERROR(ConstrainSamples(step, sample_seqs));
    if (has_head_ && samples > 0) {
      CUDA_CHECK(cudaMemcpyAsync(host_tokens_[buf_].get(), tokens_out_.get(),
                                 samples * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_.get()));
      if (step.return_logits) {
        CUDA_CHECK(cudaMemcpyAsync(host_logits_.get(), logits_.get(),
                                   static_cast<size_t>(samples) * c_.vocab_size * 4,
                                   cudaMemcpyDeviceToHost, stream_.get()));
      }
    }
    if (!has_head_ && !single) {
      CUDA_CHECK(cudaMemcpyAsync(out_hidden_.as<char>() + row0 * row_bytes, x_.get(),
                                 rows * row_bytes, cudaMemcpyDeviceToDevice, stream_.get()));
    }
    RETURN_IF_ERROR(AwaitInput(in));
    RETURN_IF_ERROR(Drain());
    if (has_head_ && samples > 0) {
      const int32_t* t = host_tokens_[buf_].as<int32_t>();
      out.tokens.insert(out.tokens.end(), t, t + samples);
      if (step.return_logits) {
        const float* lg = host_logits_.as<float>();
        out.logits.insert(out.logits.end(), lg, lg + static_cast<size_t>(samples) * c_.vocab_size);
      }
    }
    if (!scored.empty()) RETURN_IF_ERROR(ScorePromptRows(step, scored, out));
  }
  if (!has_head_) {
    out.hidden.rows = total;
    out.hidden.cols = c_.hidden_size;
    out.hidden.dtype = opt_.dtype;
    out.hidden.where = Where::kDevice;
    out.hidden.data = std::shared_ptr<void>(single ? x_.get() : out_hidden_.get(), [](void*) {});
  }
  return absl::OkStatus();
}

absl::StatusOr<StepOutput> CudaStage::Step(const StepDescriptor& step, const Activations& in) {
  // Write-outs of this step's rows fill as its last chunk goes (a decode-sized step's after it);
  // any other was opened for nothing.
  step_outs_ = kv_outs_.Take(step);
  absl::StatusOr<StepOutput> out = StepRows(step, in);
  PendingKvOuts::End(step_outs_, out.status(), [this](KvOut& o, int first) -> absl::Status {
    CUDA_CHECK(cudaSetDevice(opt_.device));
    for (int l = first; l < num_layers_; ++l) RETURN_IF_ERROR(WriteOut(o, l));
    return absl::OkStatus();
  });
  step_outs_.clear();
  return out;
}

absl::StatusOr<StepOutput> CudaStage::StepRows(const StepDescriptor& step, const Activations& in) {
  if (absl::Status st = Validate(step, in); !st.ok()) {
    // A frame posted for this step is still taken, so that the next step's is not taken for it.
    if (in.arrival) (void)in.arrival();
    return st;
  }
  StepOutput out;
  if (step.seqs.empty()) return out;
  if (!ahead_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step.id, ": ", ahead_.size(), " decode steps launched ahead are not finished"));
  }
  CUDA_CHECK(cudaSetDevice(opt_.device));
  // Prompt logprobs: an entry per sequence that asks (prompt rows come in RunChunks).
  for (int i = 0; has_head_ && i < static_cast<int>(step.seqs.size()); ++i) {
    if (step.seqs[i].prompt_logprobs >= 0) LogprobsEntry(out, i);
  }
  const bool decode =
      out.logprobs.empty() && std::all_of(step.seqs.begin(), step.seqs.end(),
                                          [](const SequenceStep& s) { return s.num_tokens == 1; });
  // Sequences with min_p, a penalty or logprobs take the host rule over the sampled rows' fp32
  // logits, copied back only in steps that hold one; every other step runs as it would.
  const bool host_rule =
      has_head_ && std::any_of(step.seqs.begin(), step.seqs.end(), NeedsHostRule);
  // Constrained rows: their matchers placed (or refused) before anything runs.
  constrained_step_ = has_head_ && ConstrainedSampling::Constrains(step);
  absl::Cleanup unconstrained = [this] { constrained_step_ = false; };
  if (constrained_step_) RETURN_IF_ERROR(constrained_->Prepare(step));
  StepDescriptor with_logits;
  const StepDescriptor* run = &step;
  if (host_rule && !step.return_logits) {
    with_logits = step;
    with_logits.return_logits = true;
    run = &with_logits;
  }
  if (decode) {
    RETURN_IF_ERROR(RunDecode(*run, in, out));
  } else {
    RETURN_IF_ERROR(RunChunks(*run, in, out));
  }
  for (const SequenceStep& s : step.seqs) cached_len_[s.slot] = s.position + s.num_tokens;
  if (host_rule) {
    ApplyHostRule(step, c_.vocab_size, out);
    if (!step.return_logits) out.logits.clear();
  }
  if (constrained_step_) AdvanceConstraints(step, out);
  std::stable_sort(
      out.logprobs.begin(), out.logprobs.end(),
      [](const SequenceLogprobs& a, const SequenceLogprobs& b) { return a.seq < b.seq; });
  return out;
}

bool CudaDeviceAvailable() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

absl::StatusOr<std::string> CudaDeviceUuid(int device) {
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  return absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                         b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                         b[12], b[13], b[14], b[15]);
}

absl::StatusOr<Activations> CudaStage::ToHost(const Activations& a) const {
  return CopyActivationsToHost(a, opt_.device);
}

absl::StatusOr<std::shared_ptr<uint8_t>> SharedDeviceBytes(int device, size_t bytes) {
  CUDA_CHECK(cudaSetDevice(device));
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 1));
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat(bytes, " bytes of device memory are not free on device ", device));
  }
  if (e != cudaSuccess) return cuda::CudaError(e, "cudaMalloc", __FILE__, __LINE__);
  return std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [device](uint8_t* q) {
    cudaSetDevice(device);
    cudaFree(q);
  });
}

absl::StatusOr<KvBlock> KvBlockToHost(const KvBlock& block) {
  if (!block.on_device()) return block;
  KvBlock out = SizedKvBlock(block.dtype, block.first_layer, block.num_layers, block.num_kv_heads,
                             block.head_dim, block.positions);
  out.version = block.version;
  out.scales = block.scales;
  CUDA_CHECK(cudaMemcpy(out.k.data(), block.device_k.get(), out.k.size(), cudaMemcpyDefault));
  CUDA_CHECK(cudaMemcpy(out.v.data(), block.device_v.get(), out.v.size(), cudaMemcpyDefault));
  return out;
}

absl::StatusOr<std::shared_ptr<const PlacedWeights>> PlaceCudaWeights(const StageSpec& spec,
                                                                      const CudaOptions& options) {
  if (!CudaDeviceAvailable()) {
    return absl::FailedPreconditionError("no CUDA device is available");
  }
  if (options.dtype != DType::kF16 && options.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA backend dtype must be F16 or BF16, got ",
                                                   std::string(DTypeName(options.dtype))));
  }
  ASSIGN_OR_RETURN(ModelConfig c, LoadModelConfig(spec.model_dir));
  const int last = spec.last_layer == -1 ? c.num_layers : spec.last_layer;
  if (spec.first_layer < 0 || spec.first_layer >= last || last > c.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layers [%d, %d) of a model of %d", spec.first_layer, last, c.num_layers));
  }
  CUDA_CHECK(cudaSetDevice(options.device));
  ASSIGN_OR_RETURN(StageArenas arenas,
                   ArenasFor(spec, spec.first_layer, last, options, c.tie_word_embeddings));
  return std::shared_ptr<const PlacedWeights>(std::move(arenas.uploaded));
}

absl::StatusOr<std::unique_ptr<Stage>> MakeCudaStage(const StageSpec& spec,
                                                     const CudaOptions& options) {
  if (!CudaDeviceAvailable()) {
    return absl::FailedPreconditionError("no CUDA device is available");
  }
  ASSIGN_OR_RETURN(ModelConfig c, LoadModelConfig(spec.model_dir));
  auto stage = std::make_unique<CudaStage>(c, options);
  RETURN_IF_ERROR(stage->Load(spec));
  return std::unique_ptr<Stage>(std::move(stage));
}

}  // namespace tandem
