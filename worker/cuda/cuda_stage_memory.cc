// The CUDA stage's working memory, allocated once at load time so that no step can run out:
// activations for rows_cap rows, sampling for samples_cap rows, the step inputs' blocks, and the
// KV-cache (its share of what the weights and the workspace leave).
#include "worker/cuda/cuda_stage_impl.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "worker/context_fit.h"

namespace tandem {

absl::Status CudaStage::AllocateWorkspace() {
  max_bucket_ = NextPow2(max_slots_);
  rows_cap_ = std::max({max_bucket_, kMinRowsCap, opt_.prefill_rows});
  samples_cap_ = max_bucket_;
  const int hidden = c_.hidden_size, inter = c_.intermediate_size;
  const int qkv_cols = c_.q_dim() + 2 * c_.kv_dim();
  const int in_cols = c_.arch == Arch::kLlama ? 2 * inter : inter;
  RETURN_IF_ERROR(x_.Allocate(rows_cap_ * RowBytes(hidden)));
  RETURN_IF_ERROR(xn_.Allocate(rows_cap_ * RowBytes(hidden)));
  RETURN_IF_ERROR(qkv_.Allocate(rows_cap_ * RowBytes(qkv_cols)));
  RETURN_IF_ERROR(q_.Allocate(rows_cap_ * RowBytes(c_.q_dim())));
  RETURN_IF_ERROR(attn_.Allocate(rows_cap_ * RowBytes(c_.q_dim())));
  RETURN_IF_ERROR(mlp_in_.Allocate(rows_cap_ * RowBytes(in_cols)));
  RETURN_IF_ERROR(mlp_act_.Allocate(rows_cap_ * RowBytes(inter)));
  // rows * splits <= rows + 2 * sm_count / kv_heads (see SplitsFor).
  RETURN_IF_ERROR(partials_.Allocate(
      cuda::AttentionPartialFloats(rows_cap_ + 2 * sm_count_, c_.num_heads, c_.head_dim, 1) *
      sizeof(float)));
  // One per (row, kv head): zero between attention launches (the kernel leaves them so).
  RETURN_IF_ERROR(
      attn_counters_.Allocate(static_cast<size_t>(rows_cap_) * c_.num_kv_heads * sizeof(uint32_t)));
  CUDA_CHECK(cudaMemset(attn_counters_.get(), 0, attn_counters_.size()));
  if (has_head_) {
    RETURN_IF_ERROR(head_in_.Allocate(samples_cap_ * RowBytes(hidden)));
    RETURN_IF_ERROR(sampled_x_.Allocate(samples_cap_ * RowBytes(hidden)));
    RETURN_IF_ERROR(sampled_q_.Allocate(samples_cap_ * RowBytes(c_.q_dim())));
    RETURN_IF_ERROR(logits_.Allocate(static_cast<size_t>(samples_cap_) * c_.vocab_size * 4));
    RETURN_IF_ERROR(probs_.Allocate(static_cast<size_t>(samples_cap_) * c_.vocab_size * 4));
    RETURN_IF_ERROR(tokens_out_.Allocate(samples_cap_ * sizeof(int32_t)));
    for (PinnedBuffer& b : host_tokens_) RETURN_IF_ERROR(b.Allocate(samples_cap_ * sizeof(int32_t)));
    RETURN_IF_ERROR(host_logits_.Allocate(static_cast<size_t>(samples_cap_) * c_.vocab_size * 4));
    // Prompt logprobs: the LM head runs over a long prompt in pieces of ~16 MiB of fp32 logits.
    const size_t row_logits = static_cast<size_t>(c_.vocab_size) * 4;
    prompt_rows_cap_ = static_cast<int>(
        std::clamp<size_t>((size_t{16} << 20) / row_logits, 1, static_cast<size_t>(rows_cap_)));
    RETURN_IF_ERROR(prompt_logits_.Allocate(prompt_rows_cap_ * row_logits));
    if (rank_.head_rows > 0) {
      RETURN_IF_ERROR(
          head_parts_.Allocate(static_cast<size_t>(std::max(samples_cap_, prompt_rows_cap_)) *
                               rank_.ranks * rank_.head_rows * sizeof(float)));
    }
    RETURN_IF_ERROR(host_prompt_logits_.Allocate(prompt_rows_cap_ * row_logits));
    RETURN_IF_ERROR(AllocateMasks());
  }
  if (!has_embedding_) RETURN_IF_ERROR(host_hidden_.Allocate(rows_cap_ * RowBytes(hidden)));
  if (fp8_gemm_ != nullptr) {
    const size_t widest_in = std::max({hidden, c_.q_dim(), inter});
    RETURN_IF_ERROR(fp8_x_codes_.Allocate(rows_cap_ * widest_in));
    RETURN_IF_ERROR(fp8_x_scales_.Allocate(rows_cap_ * sizeof(float)));
  }
  {
    size_t off = 0;
    auto place = [&](size_t bytes) {
      const size_t at = off;
      off += (bytes + 15) / 16 * 16;
      return at;
    };
    const size_t R = rows_cap_, S = samples_cap_;
    layout_.seed = place(S * 8);
    layout_.sample_index = place(S * 8);
    layout_.temperature = place(S * 4);
    layout_.top_p = place(S * 4);
    layout_.top_k = place(S * 4);
    layout_.gather = place(S * 4);
    layout_.sample_positions = place(S * 4);
    layout_.sample_slots = place(S * 4);
    layout_.tokens = place(R * 4);
    layout_.positions = place(R * 4);
    layout_.slots = place(R * 4);
    layout_.total = off;
    RETURN_IF_ERROR(inputs_.Allocate(off));
    for (PinnedBuffer& b : host_in_) {
      RETURN_IF_ERROR(b.Allocate(off));
      std::memset(b.get(), 0, off);
    }
  }
  for (cuda::Event& e : done_) CUDA_CHECK(cudaEventCreateWithFlags(e.put(), cudaEventDisableTiming));
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CudaStage::KvBytes(int layers, int64_t budget,
                                           std::string_view budget_what) const {
  return KvCacheBytes({.slots = int64_t{max_slots_} + 1,  // and the padding rows' slot
                       .layers = std::max(layers, 1),
                       .positions = seq_capacity_,
                       .kv_dim = c_.kv_dim(),
                       .element_bytes = static_cast<int64_t>(DTypeSize(opt_.dtype))},
                      budget, budget_what);
}

absl::Status CudaStage::AllocateKvCache() {
  if (paged()) return AllocateKvPages();
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const size_t budget = static_cast<size_t>(static_cast<double>(free_bytes) * opt_.kv_memory_fraction);
  ASSIGN_OR_RETURN(
      const int64_t kv_bytes,
      KvBytes(num_layers_, static_cast<int64_t>(budget),
              absl::StrFormat("GPU memory (%s; kv_memory_fraction %.2f of the %d bytes free after "
                              "the weights)",
                              std::string(DTypeName(opt_.dtype)), opt_.kv_memory_fraction,
                              free_bytes)));
  kv_layer_bytes_ = static_cast<size_t>(kv_bytes) / 2 / std::max(num_layers_, 1);
  RETURN_IF_ERROR(kv_.Allocate(kv_bytes));
  // Zeroed so that padding rows and never-written positions hold finite values.
  CUDA_CHECK(cudaMemset(kv_.get(), 0, kv_bytes));
  CUDA_CHECK(cudaMemset(x_.get(), 0, x_.size()));
  cached_len_.assign(max_slots_, 0);
  CUDA_CHECK(cudaDeviceSynchronize());
  return absl::OkStatus();
}

absl::Status CudaStage::AllocateKvPages() {
  const int layers = std::max(num_layers_, 1);
  // One page of one layer's K (or V): every kv head of page_size positions.
  const int64_t page_bytes = int64_t{page_size_} * static_cast<int64_t>(KvRowBytes(c_.kv_dim()));
  const int64_t per_page = 2 * layers * page_bytes;  // K and V of every layer
  // The flat table of a step: the padding page's entry, then a full table per sequence.
  table_cap_ = 1 + max_bucket_ * max_seq_pages_;
  RETURN_IF_ERROR(table_.Allocate(static_cast<size_t>(table_cap_) * sizeof(int32_t)));
  for (PinnedBuffer& b : host_table_) {
    RETURN_IF_ERROR(b.Allocate(static_cast<size_t>(table_cap_) * sizeof(int32_t)));
  }
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const int64_t budget =
      static_cast<int64_t>(static_cast<double>(free_bytes) * opt_.kv_memory_fraction);
  const int64_t fit = budget / per_page - 1;  // less the padding page
  if (fit < 1 || pages_asked_ > fit) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "KV pages: %d pages of %d positions (%d bytes each over %d layers, and one for padding "
        "rows) asked, %d fit in GPU memory (%s; kv_memory_fraction %.2f of the %d bytes free "
        "after the weights); ask for fewer kv_pages or raise kv_memory_fraction",
        pages_asked_ == 0 ? 1 : pages_asked_, page_size_, per_page, layers,
        std::max<int64_t>(fit, 0), kv_fp8_ ? "FP8 E4M3" : std::string(DTypeName(opt_.dtype)),
        opt_.kv_memory_fraction, free_bytes));
  }
  num_pages_ = pages_asked_ > 0 ? pages_asked_ : static_cast<int>(std::min<int64_t>(
                                                     fit, std::numeric_limits<int>::max() - 1));
  kv_layer_bytes_ = static_cast<size_t>(num_pages_ + 1) * page_bytes;
  const size_t kv_bytes = 2 * static_cast<size_t>(layers) * kv_layer_bytes_;
  RETURN_IF_ERROR(kv_.Allocate(kv_bytes));
  // Zeroed so that the padding page and never-written positions hold finite values.
  CUDA_CHECK(cudaMemset(kv_.get(), 0, kv_bytes));
  CUDA_CHECK(cudaMemset(table_.get(), 0, table_.size()));
  CUDA_CHECK(cudaMemset(x_.get(), 0, x_.size()));
  cached_len_.assign(max_slots_, 0);
  any_len_.assign(max_slots_, max_seq_len_);
  CUDA_CHECK(cudaDeviceSynchronize());
  return absl::OkStatus();
}

}  // namespace tandem
