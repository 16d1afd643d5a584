// The CUDA stage's class and the pieces its files share: cuda_stage.cc (loading, steps, the public
// functions of cuda_stage.h), cuda_stage_weights.cc (weights placed on the device),
// cuda_stage_memory.cc (workspace and KV-cache), cuda_stage_kv.cc (KV blocks in and out),
// cuda_stage_forward.cc (the forward pass), cuda_stage_decode.cc (decode graphs and decode steps
// launched ahead), cuda_stage_constrain.cc (constrained rows' token masks). Internal to
// worker/cuda/.
//
// Device memory, all allocated at load time so that no step can run out of memory:
//   placed_    every tensor of the stage: arenas of weights, its own or taken from earlier stages
//              (StageSpec::placed) where they hold its layers
//   kv_        K and V: (layers, 2, max_slots + 1, kv_heads, seq_capacity, head_dim); the extra
//              slot takes the writes of the padding rows of a decode bucket, and stages KV blocks
//              (ExportKv, ImportKv) in the block's layout on their way to and from the host.
//              Paged (StageSpec::kv_page_size > 0): (layers, 2, kv_pages + 1, kv_heads, page_size,
//              head_dim); the extra page takes the padding rows' writes
//   table_     paged: the step's block tables, one flat run of page ids; each row's slot input
//              is the offset of its sequence's table there (entry 0 names the padding page), so
//              the kernels see a table of stride 1. Mirrored by two pinned host blocks like inputs_
//   work       activations for rows_cap rows: x (residual), xn, qkv, q, attn, mlp, partials and
//              the attention split counters; logits and sampling for samples_cap rows
//   inputs_    per-row and per-sample step inputs, mirrored by a pinned host block and copied in
//              one cudaMemcpyAsync, so that a graph reads them from fixed addresses
// A step with more rows than rows_cap (a long prefill) runs as consecutive row chunks: each chunk
// goes through every layer before the next, which is the same causal computation.
#pragma once

#include <cuda_runtime.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/constrained_sampling.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/cuda_stage.h"
#include "worker/cuda/fp8_gemm.h"
#include "worker/cuda/kernels.h"
#include "worker/cuda/kv_pages.h"
#include "worker/cuda/weight_upload.h"
#include "worker/kv_out.h"
#include "worker/weights.h"

namespace tandem {

using cuda::DeviceBuffer;
using cuda::PinnedBuffer;

// One arena of weights in device memory (PlacedWeights), of one checkpoint directory, dtype and
// device.
class CudaPlacedWeights final : public PlacedWeights {
 public:
  CudaPlacedWeights(std::string dir, DType dtype, int device, cuda::DeviceWeights w)
      : dir_(std::move(dir)), dtype_(dtype), device_(device), w_(std::move(w)) {}
  int first_layer() const override { return w_.tensors.first_layer; }
  int last_layer() const override { return w_.tensors.last_layer; }
  int64_t bytes() const override { return static_cast<int64_t>(w_.arena.size()); }
  bool Serves(const std::string& dir, DType dtype, int device) const {
    return dir == dir_ && dtype == dtype_ && device == device_;
  }
  bool Holds(int layer) const { return layer >= first_layer() && layer < last_layer(); }
  const StageWeightsOf<const void*>& tensors() const { return w_.tensors; }
  const StageWeightsOf<const float*>& scales() const { return w_.scales; }

 private:
  const std::string dir_;
  const DType dtype_;
  const int device_;
  const cuda::DeviceWeights w_;
};

// The weights of the layers [first, last) of `spec`'s checkpoint: those of `spec.placed` that
// serve it (same directory, dtype and device), and the layers they lack, from the first one
// lacking to the last, uploaded as one more arena (`uploaded`, null when nothing lacked).
struct StageArenas {
  std::vector<std::shared_ptr<const CudaPlacedWeights>> usable;
  std::shared_ptr<const CudaPlacedWeights> uploaded;
};
absl::StatusOr<StageArenas> ArenasFor(const StageSpec& spec, int first, int last,
                                      const CudaOptions& opt, bool tie_word_embeddings);

constexpr int kMinRowsCap = 1024;  // rows per forward pass (prefill chunk)

// A sequence whose token the device's sampler does not draw by the whole rule.
inline bool NeedsHostRule(const SequenceStep& s) {
  return s.sample && (s.sampling.has_penalties() || s.sampling.min_p > 0.0f || s.logprobs >= 0);
}

// The entry of sequence `seq` in out.logprobs, appended when it has none yet.
inline SequenceLogprobs& LogprobsEntry(StepOutput& out, int seq) {
  for (SequenceLogprobs& l : out.logprobs) {
    if (l.seq == seq) return l;
  }
  SequenceLogprobs& added = out.logprobs.emplace_back();
  added.seq = seq;
  return added;
}

inline int NextPow2(int n) {
  int b = 1;
  while (b < n) b <<= 1;
  return b;
}

struct DeviceLayer {
  const void* attn_norm_w = nullptr;  // (hidden)
  const void* attn_norm_b = nullptr;  // (hidden), GPT-2
  const void* wqkv = nullptr;         // (q_dim + 2 kv_dim, hidden)
  const void* bqkv = nullptr;         // (q_dim + 2 kv_dim), GPT-2
  const void* q_norm_w = nullptr;     // (head_dim), Qwen3
  const void* k_norm_w = nullptr;     // (head_dim), Qwen3
  const void* wo = nullptr;           // (hidden, q_dim)
  const void* bo = nullptr;           // (hidden), GPT-2
  const void* mlp_norm_w = nullptr;   // (hidden)
  const void* mlp_norm_b = nullptr;   // (hidden), GPT-2
  const void* w_in = nullptr;         // (intermediate or 2 * intermediate, hidden)
  const void* b_in = nullptr;         // (intermediate), GPT-2
  const void* w_out = nullptr;        // (hidden, intermediate)
  const void* b_out = nullptr;        // (hidden), GPT-2
  // FP8 weights: wqkv, wo, w_in and w_out are E4M3 codes and these their per-row scales (one
  // per output row); null for fp16/bf16 weights.
  const float* wqkv_scales = nullptr;
  const float* wo_scales = nullptr;
  const float* w_in_scales = nullptr;
  const float* w_out_scales = nullptr;
};

// A CUDA stage as one rank of a tensor-parallel group (cuda_tensor_parallel.h); the default is a
// whole stage. Its layers are `shard` (host weights of the rank's heads and columns, uploaded in
// place of the checkpoint's), and `reduce` sums a row-parallel projection's output over the
// ranks in place, queued on the stage's stream (and so captured into the decode graphs).
struct CudaRank {
  int rank = 0;
  const StageSources* shard = nullptr;
  std::function<absl::Status(void* x, int rows, cudaStream_t stream)> reduce;
  // The LM head split by vocabulary (`shard` holds rows [rank * head_rows, (rank + 1) *
  // head_rows) of it, the last rank fewer where the vocabulary does not divide): each rank
  // computes its rows' logits and `gather_head` collects every rank's `count` floats, rank r's at
  // parts + r * count, in place, so that every rank holds the whole logits. 0: the whole head.
  int ranks = 1;
  int head_rows = 0;
  std::function<absl::Status(float* parts, size_t count, cudaStream_t stream)> gather_head;
};

class CudaStage final : public Stage {
 public:
  CudaStage(const ModelConfig& c, const CudaOptions& o, CudaRank rank = {})
      : c_(c), opt_(o), rank_(std::move(rank)) {}

  ~CudaStage() override {
    if (stream_.get() != nullptr) cudaStreamSynchronize(stream_.get());
  }

  // Load in phases: options and shapes checked, weights uploaded, working buffers, KV-cache
  // (its share of the memory the others leave).
  absl::Status Load(const StageSpec& spec);
  absl::Status CheckOptions(const StageSpec& spec);
  // kv_page_size > 0: the page size, the head_dim the paged kernels take, the page count.
  absl::Status CheckPagedOptions(const StageSpec& spec);
  absl::Status UploadWeights(const StageSpec& spec);
  absl::Status AllocateWorkspace();
  absl::Status AllocateKvCache();
  // Paged: the pools of K and V pages (StageSpec::kv_pages, or as many as the budget holds) and
  // the step's flat table.
  absl::Status AllocateKvPages();
  // Bytes of the KV-cache of `layers` layers at the checked sizes, at most `budget`.
  absl::StatusOr<int64_t> KvBytes(int layers, int64_t budget, std::string_view budget_what) const;
  absl::StatusOr<StepOutput> Step(const StepDescriptor& step, const Activations& in) override;
  const ModelConfig& config() const override { return c_; }
  std::vector<std::shared_ptr<const PlacedWeights>> placed_weights() const override {
    return {placed_.begin(), placed_.end()};
  }
  int kv_pages() const override { return num_pages_; }
  absl::StatusOr<KvBlock> ExportKv(const KvPlace& place, int positions, int first_layer,
                                   int num_layers) const override;
  absl::StatusOr<KvBlock> ExportKvToDevice(const KvPlace& place, int positions, int first_layer,
                                           int num_layers) const override;
  absl::Status ImportKv(const KvPlace& place, const KvBlock& block) override;
  // A write-out's block is in device memory; the last chunk of its step gathers each layer's rows
  // into it right after writing them, on the stage's stream, and publishes the layer with an
  // event recorded behind the copy.
  absl::StatusOr<std::shared_ptr<KvOut>> OpenKvOut(const KvPlace& place, int positions) override;
  // Decode steps launched ahead: each fills one of two input blocks (the other may still be on
  // its way to the device for the step before), replays its graph behind the steps launched
  // before, and copies its tokens into one of two host blocks, with an event recorded after; a
  // row fed by the step before reads its token from tokens_out_ in the embedding.
  bool LaunchOverlaps() const override { return true; }
  bool CanLaunchDecode(const StepDescriptor& step) const override;
  absl::Status LaunchDecode(const StepDescriptor& step,
                            std::span<const int> from_previous) override;
  bool DecodeDone() const override;
  absl::StatusOr<StepOutput> FinishDecode() override;
  int launched_decodes() const override { return static_cast<int>(ahead_.size()); }
  absl::StatusOr<Activations> ToHost(const Activations& a) const override;
  absl::StatusOr<void*> DeviceStream() const override { return static_cast<void*>(stream()); }
  absl::Status SetDecodeTail(DecodeTail tail) override {
    tail_ = std::move(tail);
    return absl::OkStatus();
  }
  absl::Status SetStreamWatch(std::function<absl::Status()> watch) override {
    watch_ = std::move(watch);
    return absl::OkStatus();
  }
  // The observer's marks are recorded into the decode graphs: they are captured again.
  absl::Status SetDecodeObserver(DecodeObserver* observer) override {
    observer_ = observer;
    graphs_.clear();
    return absl::OkStatus();
  }
  absl::StatusOr<int> DecodeGraphCount() const override { return static_cast<int>(graphs_.size()); }
  cudaStream_t stream() const { return stream_.get(); }

 private:
  // Offsets (bytes) of the step inputs inside the host and device blocks.
  struct InputLayout {
    size_t seed, sample_index, temperature, top_p, top_k, tokens, positions, slots, gather, total;
    // Position and slot of each sampled row (gather's rows), for a last layer of sampled rows.
    size_t sample_positions, sample_slots;
  };

  absl::Status Validate(const StepDescriptor& step, const Activations& in) const;
  // Paged: every sequence's block table holds the pages of the positions its step writes and
  // reads, each a page of the pool. INVALID_ARGUMENT naming the sequence (its row) otherwise.
  absl::Status CheckBlockTables(const StepDescriptor& step) const;
  // Paged: the step's block tables into host_table_[buf_] and queued to table_ (one copy);
  // `offsets[i]` is where sequence i's table starts, the slot input of its rows.
  absl::Status UploadBlockTables(const StepDescriptor& step, std::vector<int32_t>& offsets);
  // Paged: layer l's pools and the flat table of the step.
  cuda::KvPages Pages(int l) const {
    cuda::KvPages p{KCache(l),         VCache(l), num_pages_ + 1, page_size_, table_.as<int32_t>(),
                    /*table_stride=*/1};
    if (kv_fp8_) {
      p.fp8 = true;
      p.k_scale = kv_scales_[l].k;
      p.v_scale = kv_scales_[l].v;
    }
    return p;
  }
  bool paged() const { return page_size_ > 0; }
  absl::StatusOr<StepOutput> StepRows(const StepDescriptor& step, const Activations& in);
  // A block of this stage's dtype and dims over the given layers and positions, its K and V in
  // device memory (not written); `table` (a paged write-out's block table) is copied after V.
  absl::StatusOr<KvBlock> DeviceKvBlock(int first_layer, int num_layers, int positions,
                                        std::span<const int32_t> table = {}) const;
  // Positions [0, positions) of layer `layer` of `place`, between the cache and a block layer's
  // K and V in device memory, on the stage's stream: the slot's rows, or on a paged stage the
  // pages of `table` (place.block_table in device memory).
  absl::Status CopyKvLayer(const KvPlace& place, const int32_t* table, int layer, void* k_block,
                           void* v_block, int positions, bool to_block) const;
  // Layer `l`'s rows of the write-out's slot into its block, published once they are there.
  absl::Status WriteOut(KvOut& out, int l);
  // Where a forward pass stands between layers: the residual stream and the rows a layer runs
  // past its cache write (every row, or in a pruned last layer the sampled ones, gathered), and
  // the bias of the last projection into x, not yet added.
  struct PassRows {
    void* x;
    const void* q;
    int n;
    const int32_t* positions;
    const int32_t* slots;
    bool sampled_only = false;
    const void* pending_bias = nullptr;
  };
  absl::Status Forward(int rows, int samples);
  absl::Status QkvIntoCache(int l, int rows, bool gemv, const void* pending_bias);
  absl::Status KeepSampledRows(int samples, PassRows& p);
  absl::Status AttentionAndMlp(int l, bool gemv, PassRows& p);
  // Norms of a tensor-parallel rank start as programmatic dependent launches: the one after an
  // all-reduce starts, and the projection after it prefetches its weights, while the ranks meet
  // (two H200s, llama3.1-8b TP2: 3.18 -> 3.13 ms a step at batch 1, 4.59 -> 4.48 at 64). A whole
  // stage's measured no faster so (4.28 and 4.30 ms at batch 1).
  bool NormPdl() const { return static_cast<bool>(rank_.reduce); }
  // After a row-parallel projection (attention output, MLP down) into x: the ranks' outputs
  // summed. Rank 0 adds its projection into the residual stream, the others store theirs alone,
  // so that the sum holds the residual once. A whole stage (no reduce) does nothing.
  absl::Status AfterRowParallel(void* x, int rows) {
    return rank_.reduce ? rank_.reduce(x, rows, stream_.get()) : absl::OkStatus();
  }
  absl::Status Head(int samples, const PassRows& p);
  // The LM head over `rows` normed rows into fp32 logits (rows, vocab): the whole head, or this
  // rank's vocabulary rows gathered with the other ranks' (CudaRank::head_rows).
  absl::Status HeadLogits(const void* normed, int rows, bool gemv, float* logits);
  // A decode step; `from_previous` as LaunchDecode's. With `wait` false it returns once the step
  // and the copy of its tokens to host_tokens_[buf_] are queued (no tail, no input to await).
  absl::Status RunDecode(const StepDescriptor& step, const Activations& in, StepOutput& out,
                         std::span<const int> from_previous = {}, bool wait = true);
  // The sampled rows' tokens (and logits) of decode step `step` from `host_tokens` into `out`.
  void ReadDecodeTokens(const StepDescriptor& step, const int32_t* host_tokens,
                        StepOutput& out) const;
  absl::Status RunChunks(const StepDescriptor& step, const Activations& in, StepOutput& out);
  // Constrained decoding (cuda_stage_constrain.cc). A step with a constrained row runs as a step,
  // never launched ahead: its masks need the tokens of the step before. After its forward pass
  // is queued (so that the host's grammar work overlaps the device's), each constrained row's
  // allow-bitmask goes into host_masks_ and, in one copy, to masks_; the refused tokens' logits
  // are set to -inf and the sampled rows drawn again (the same rule and seed, so that the
  // unconstrained rows keep their tokens) into tokens_out_. `sample_seqs[j]`: the sequence
  // whose logits are row j of logits_. Does nothing unless constrained_step_.
  absl::Status ConstrainSamples(const StepDescriptor& step, std::span<const int> sample_seqs);
  // The masks' buffers, host_masks_ and masks_ (a stage with the LM head, at load).
  absl::Status AllocateMasks();
  // Where the bits start in host_masks_ and masks_, after the row list.
  size_t MaskRowsBytes() const { return (static_cast<size_t>(samples_cap_) * 4 + 15) / 16 * 16; }
  // After a constrained step: each constrained row's grammar advanced by its token.
  void AdvanceConstraints(const StepDescriptor& step, const StepOutput& out);
  // A row of a pass scored for prompt logprobs: the row, its sequence (index in the step) and the
  // token after it, whose logprob it gives.
  struct ScoredRow {
    int row;
    int seq;
    int32_t next;
  };
  // The LM head over the scored rows of the pass just queued (their final norm in xn_), at most
  // prompt_rows_cap_ rows at a time, and each row's logprobs into `out` (cuda_stage_prompt.cc).
  absl::Status ScorePromptRows(const StepDescriptor& step, std::span<const ScoredRow> rows,
                               StepOutput& out);
  absl::Status CopyInput(const Activations& in, int64_t row0, int rows);
  absl::Status AwaitInput(const Activations& in);
  absl::Status Replay(int bucket);
  // Captures the decode graph of batch-size bucket `bucket` (nothing runs).
  absl::Status Capture(int bucket);
  // Every bucket's graph, 1, 2, 4, ... up to the largest, when the stage loads: a bucket's first
  // step would otherwise stall all of its sequences for the capture (tens of milliseconds, seen
  // as inter-token latency spikes in a service whose batch grows and shrinks).
  absl::Status CaptureDecodeGraphs();
  // Waits for the stream: in the driver, or polling watch_ where one is set.
  absl::Status Drain() const;
  // Where a KV block's layer `layer` (of the stage) passes through on its way to or from the
  // host, as (positions, kv_dim): the spare slot's rows of that layer's K and V. No sequence owns
  // the spare slot; padding rows of decode steps write there and nothing reads it back.
  std::pair<void*, void*> KvStaging(int layer) const {
    const size_t spare = static_cast<size_t>(max_slots_) * seq_capacity_ * RowBytes(c_.kv_dim());
    return {static_cast<char*>(KCache(layer)) + spare, static_cast<char*>(VCache(layer)) + spare};
  }
  // The observer's mark at `point` of the step, where one is set.
  absl::Status Mark(DecodeObserver::Point point) {
    return observer_ != nullptr ? observer_->Mark(point, stream_.get()) : absl::OkStatus();
  }
  int SplitsFor(int rows) const;
  // Decode passes of at most this many rows use the GEMV kernels (none when batch-invariant).
  int GemvMaxRows() const { return opt_.batch_invariant ? 0 : opt_.gemv_max_rows; }
  // Whether a pass of `rows` rows takes the GEMV kernels for every projection.
  bool GemvFits(int rows) const {
    return rows <= GemvMaxRows() && cuda::GemvSupported(rows, c_.hidden_size) &&
           cuda::GemvSupported(rows, c_.intermediate_size) && cuda::GemvSupported(rows, c_.q_dim());
  }
  // Whether the last layer of a pass runs past its cache write only for the sampled rows: a
  // head's prompt pass, where rows go unsampled and nothing reads their outputs (every row still
  // writes its keys and values). A pass that samples nothing stops after that cache write.
  // Not in a pass that scores prompt rows: those need every row's output.
  bool LastLayerSampledOnly(int rows, int samples, bool gemv) const {
    return has_head_ && !gemv && samples < rows && !score_rows_;
  }
  // y (rows, out) = x · wᵀ + beta * y: cuBLAS, or the pinned algorithms when batch-invariant.
  // FP8 weights (w_scales, per row): the FP8 tensor-core GEMM (fp8_gemm.h) with x quantized per
  // row; batch-invariant, or where cuBLASLt has none, dequantized into fp8_scratch_ first.
  absl::Status Matmul(const void* x, const void* w, void* y, int rows, int out, int in, float beta,
                      bool y_f32, const float* w_scales = nullptr);
  // cuda::Gemv, or cuda::GemvFp8 with w_scales.
  absl::Status Gemv(cuda::GemvEpilogue e, const void* x, const void* w, const float* w_scales,
                    const void* bias, void* y, int rows, int out, int in);

  template <typename T>
  T* HostIn(size_t off) {
    return reinterpret_cast<T*>(host_in_[buf_].as<char>() + off);
  }
  template <typename T>
  T* DevIn(size_t off) const {
    return reinterpret_cast<T*>(inputs_.as<char>() + off);
  }
  void* KCache(int layer) const {
    return kv_.as<char>() + (2 * static_cast<size_t>(layer)) * kv_layer_bytes_;
  }
  void* VCache(int layer) const {
    return kv_.as<char>() + (2 * static_cast<size_t>(layer) + 1) * kv_layer_bytes_;
  }
  size_t RowBytes(int cols) const { return static_cast<size_t>(cols) * DTypeSize(opt_.dtype); }
  // The KV-cache's element type: the activations', or kF8E4M3 codes over kv_scales_.
  DType KvDType() const { return kv_fp8_ ? DType::kF8E4M3 : opt_.dtype; }
  // The scales of the model layers [first_layer, first_layer + num_layers) of an FP8 cache (the
  // blocks it exports carry them); none otherwise.
  std::vector<KvScales> ScalesOf(int first_layer, int num_layers) const {
    if (!kv_fp8_) return {};
    const auto from = kv_scales_.begin() + (first_layer - first_layer_);
    return {from, from + num_layers};
  }
  // Bytes of `cols` elements of the KV-cache: one each where it holds FP8 codes.
  size_t KvRowBytes(int cols) const { return kv_fp8_ ? static_cast<size_t>(cols) : RowBytes(cols); }

  const ModelConfig c_;  // a tensor-parallel rank's: its heads and intermediate columns
  const CudaOptions opt_;
  const CudaRank rank_;
  bool has_embedding_ = false, has_head_ = false;
  int first_layer_ = 0;  // of the model: attention's scale and window are per model layer
  int num_layers_ = 0;
  int max_slots_ = 0, max_seq_len_ = 0, seq_capacity_ = 0;
  int rows_cap_ = 0, samples_cap_ = 0, max_bucket_ = 0, sm_count_ = 0;
  // The next forward pass's rows are prompt runs (several rows per sequence): attention through
  // the tensor-core prefill kernel. Set per chunk by RunChunks; never for decode steps.
  bool prefill_attention_ = false;
  // The next forward pass scores prompt rows: every row goes through the last layer and its final
  // norm lands in xn_. Set per chunk by RunChunks.
  bool score_rows_ = false;
  int prompt_rows_cap_ = 0;  // rows of prompt logits at a time (ScorePromptRows)
  size_t kv_layer_bytes_ = 0;
  // Paged KV-cache: positions per page (0: contiguous slots), pages of the pool (without the
  // padding page), pages asked for (StageSpec::kv_pages, 0: as many as fit), the most pages one
  // sequence holds, and the flat table's capacity in entries.
  int page_size_ = 0, num_pages_ = 0, pages_asked_ = 0, max_seq_pages_ = 0, table_cap_ = 0;
  // FP8 KV-cache (StageSpec::kv_cache_fp8, pages only): the pools hold E4M3 codes, with (K, V)
  // scales per layer of the stage.
  bool kv_fp8_ = false;
  std::vector<KvScales> kv_scales_;  // LoadKvScales, one pair per layer of the stage

  cuda::Stream stream_;
  cuda::CublasHandle cublas_;
  DeviceBuffer cublas_workspace_;
  std::unique_ptr<cuda::FixedAlgoGemm> fixed_gemm_;  // batch_invariant: every GEMM through it
  // The weights' arenas this stage runs on (its own upload, or taken from earlier stages).
  std::vector<std::shared_ptr<const CudaPlacedWeights>> placed_;
  DeviceBuffer kv_;
  DeviceBuffer inv_freq_;     // (head_dim / 2) fp32 rotary inverse frequencies (Llama)
  DeviceBuffer fp8_scratch_;  // FP8 weights: the largest linear weight in dtype, for the GEMM
  std::unique_ptr<cuda::Fp8Gemm>
      fp8_gemm_;  // FP8 weights on FP8 tensor cores (not batch-invariant)
  DeviceBuffer fp8_x_codes_, fp8_x_scales_;  // its activations, quantized per row
  DeviceBuffer x_, xn_, qkv_, q_, attn_, mlp_in_, mlp_act_, partials_, attn_counters_;
  DeviceBuffer head_in_, logits_, probs_, tokens_out_;
  DeviceBuffer sampled_x_, sampled_q_;  // the sampled rows of x_ and q_ in a pruned last layer
  DeviceBuffer inputs_;
  DeviceBuffer table_;  // paged: (table_cap_) int32 page ids
  PinnedBuffer host_table_[2];
  DeviceBuffer out_hidden_;  // outputs of steps longer than one chunk
  // Step inputs and sampled tokens in two blocks each, buf_ the one the next step uses: a step
  // launched ahead fills one while the step before may still read the other.
  PinnedBuffer host_in_[2], host_tokens_[2];
  int buf_ = 0;
  PinnedBuffer host_hidden_, host_logits_;
  DeviceBuffer prompt_logits_;       // (prompt_rows_cap_, vocab) fp32
  PinnedBuffer host_prompt_logits_;  // the same, on the host
  // Decode steps launched ahead and not finished, oldest first: the step and the block (and
  // event, done_[buf]) of its tokens.
  struct Launched {
    StepDescriptor step;
    int buf = 0;
  };
  std::deque<Launched> ahead_;
  cuda::Event done_[2];
  InputLayout layout_{};

  const void* tok_embedding_ = nullptr;  // (vocab, hidden)
  const void* pos_embedding_ = nullptr;  // (max_positions, hidden), GPT-2
  std::vector<DeviceLayer> layers_;
  const void* final_norm_w_ = nullptr;
  const void* final_norm_b_ = nullptr;
  const void* lm_head_ = nullptr;  // (vocab, hidden), or this rank's rows of it (head_rows)
  // A split head's logits of every rank, rank-major, before they go to their columns.
  cuda::DeviceBuffer head_parts_;

  std::map<int, std::unique_ptr<cuda::GraphExec>> graphs_;  // decode bucket -> graph

  DecodeObserver* observer_ = nullptr;  // SetDecodeObserver
  DecodeTail tail_;
  std::function<absl::Status()> watch_;  // SetStreamWatch
  PendingKvOuts kv_outs_;                // opened for the next step (OpenKvOut)
  // The write-outs the pass being queued fills layer by layer (a step's last chunk only).
  std::vector<std::shared_ptr<KvOut>> forward_outs_;
  std::vector<std::shared_ptr<KvOut>> step_outs_;  // the running step's
  std::vector<int> cached_len_;                    // per slot: positions [0, len) hold K/V
  std::vector<int> any_len_;  // paged: max_seq_len per slot (any position may be cached)

  // Constrained decoding: the grammar matchers of the constrained sequences this stage samples
  // (the model folder's tokenizer is read at the first constrained step), whether the running
  // step has a constrained row, and the masks: (samples_cap_) int32 rows then (samples_cap_,
  // vocab / 32) uint32 bits, pinned and on the device (vocab / 8 bytes per row: 16 KB for 128k
  // ids).
  std::unique_ptr<ConstrainedSampling> constrained_;
  bool constrained_step_ = false;
  PinnedBuffer host_masks_;
  DeviceBuffer masks_;
};

}  // namespace tandem
