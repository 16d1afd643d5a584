// The CUDA Stage: weights uploaded once as fp16/bf16, a KV-cache sized up front, the forward pass
// enqueued on one stream (kernels of kernels.h, cuBLAS GEMMs), decode steps replayed from CUDA
// graphs captured per batch-size bucket.
//
// Device memory, all allocated at load time so that no step can run out of memory:
//   placed_    every tensor of the stage: arenas of weights, its own or taken from earlier stages
//              (StageSpec::placed) where they hold its layers
//   kv_        K and V: (layers, 2, max_slots + 1, kv_heads, seq_capacity, head_dim); the extra
//              slot takes the writes of the padding rows of a decode bucket, and stages KV blocks
//              (ExportKv, ImportKv) in the block's layout on their way to and from the host
//   work       activations for rows_cap rows: x (residual), xn, qkv, q, attn, mlp, partials and
//              the attention split counters; logits and sampling for samples_cap rows
//   inputs_    per-row and per-sample step inputs, mirrored by a pinned host block and copied in
//              one cudaMemcpyAsync, so that a graph reads them from fixed addresses
// A step with more rows than rows_cap (a long prefill) runs as consecutive row chunks: each chunk
// goes through every layer before the next, which is the same causal computation.
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
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/kernels.h"
#include "worker/cuda/prefill_attention.h"
#include "worker/cuda/weight_upload.h"
#include "worker/kv_out.h"
#include "worker/sampling.h"
#include "worker/step_check.h"
#include "worker/weights.h"

namespace tandem {
namespace {

std::string CanonicalDir(const std::filesystem::path& dir) {
  std::error_code ec;
  const std::filesystem::path c = std::filesystem::weakly_canonical(dir, ec);
  return ec ? dir.string() : c.string();
}

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
                                      const CudaOptions& opt, bool tie_word_embeddings) {
  StageArenas out;
  const std::string dir = CanonicalDir(spec.model_dir);
  for (const std::shared_ptr<const PlacedWeights>& p : spec.placed) {
    auto c = std::dynamic_pointer_cast<const CudaPlacedWeights>(p);
    if (c != nullptr && c->Serves(dir, opt.dtype, opt.device)) out.usable.push_back(std::move(c));
  }
  int lo = last, hi = first;
  for (int l = first; l < last; ++l) {
    const bool held = std::any_of(out.usable.begin(), out.usable.end(),
                                  [l](const auto& c) { return c->Holds(l); });
    if (!held) lo = std::min(lo, l), hi = std::max(hi, l + 1);
  }
  if (lo >= hi) return out;
  ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(spec.model_dir));
  ASSIGN_OR_RETURN(StageSources w, FindStageWeights(*ckpt, lo, hi));
  const bool share_head = w.has_head && w.has_embedding && tie_word_embeddings;
  ASSIGN_OR_RETURN(cuda::DeviceWeights uploaded,
                   cuda::UploadStageWeights(w, opt.dtype, share_head));
  out.uploaded = std::make_shared<const CudaPlacedWeights>(dir, opt.dtype, opt.device,
                                                          std::move(uploaded));
  return out;
}

// A sequence whose token the device's sampler does not draw by the whole rule.
bool NeedsHostRule(const SequenceStep& s) {
  return s.sample && (s.sampling.has_penalties() || s.sampling.min_p > 0.0f || s.logprobs >= 0);
}

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
      SequenceLogprobs l;
      l.seq = i;
      l.has_sampled = true;
      l.sampled = ComputeLogprob(row, token, s.logprobs);
      out.logprobs.push_back(std::move(l));
    }
  }
}

using cuda::DeviceBuffer;
using cuda::PinnedBuffer;

constexpr int kMinRowsCap = 1024;  // rows per forward pass (prefill chunk)
constexpr int kMaxSplits = 16;     // key splits per (row, kv head) in attention

int NextPow2(int n) {
  int b = 1;
  while (b < n) b <<= 1;
  return b;
}

struct DeviceLayer {
  const void* attn_norm_w = nullptr;  // (hidden)
  const void* attn_norm_b = nullptr;  // (hidden), GPT-2
  const void* wqkv = nullptr;         // (q_dim + 2 kv_dim, hidden)
  const void* bqkv = nullptr;         // (q_dim + 2 kv_dim), GPT-2
  const void* wo = nullptr;           // (hidden, q_dim)
  const void* bo = nullptr;           // (hidden), GPT-2
  const void* mlp_norm_w = nullptr;   // (hidden)
  const void* mlp_norm_b = nullptr;   // (hidden), GPT-2
  const void* w_in = nullptr;         // (intermediate or 2 * intermediate, hidden)
  const void* b_in = nullptr;         // (intermediate), GPT-2
  const void* w_out = nullptr;        // (hidden, intermediate)
  const void* b_out = nullptr;        // (hidden), GPT-2
};

class CudaStage final : public Stage {
 public:
  CudaStage(const ModelConfig& c, const CudaOptions& o) : c_(c), opt_(o) {}

  ~CudaStage() override {
    if (stream_.get() != nullptr) cudaStreamSynchronize(stream_.get());
  }

  // Load in phases: options and shapes checked, weights uploaded, working buffers, KV-cache
  // (its share of the memory the others leave).
  absl::Status Load(const StageSpec& spec);
  absl::Status CheckOptions(const StageSpec& spec);
  absl::Status UploadWeights(const StageSpec& spec);
  absl::Status AllocateWorkspace();
  absl::Status AllocateKvCache();
  // Bytes of the KV-cache of `layers` layers at the checked sizes, at most `budget`.
  absl::StatusOr<int64_t> KvBytes(int layers, int64_t budget, std::string_view budget_what) const;
  absl::StatusOr<StepOutput> Step(const StepDescriptor& step, const Activations& in) override;
  const ModelConfig& config() const override { return c_; }
  std::vector<std::shared_ptr<const PlacedWeights>> placed_weights() const override {
    return {placed_.begin(), placed_.end()};
  }
  absl::StatusOr<KvBlock> ExportKv(int slot, int positions, int first_layer,
                                   int num_layers) const override;
  absl::StatusOr<KvBlock> ExportKvToDevice(int slot, int positions, int first_layer,
                                           int num_layers) const override;
  absl::Status ImportKv(int slot, const KvBlock& block) override;
  // A write-out's block is in device memory; the last chunk of its step gathers each layer's rows
  // into it right after writing them, on the stage's stream, and publishes the layer with an
  // event recorded behind the copy.
  absl::StatusOr<std::shared_ptr<KvOut>> OpenKvOut(int slot, int positions) override;
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
  // The observer's marks are recorded into the decode graphs: they are captured again.
  void set_observer(DecodeObserver* observer) {
    observer_ = observer;
    graphs_.clear();
  }
  int decode_graphs() const { return static_cast<int>(graphs_.size()); }
  cudaStream_t stream() const { return stream_.get(); }
  void set_tail(DecodeTail tail) { tail_ = std::move(tail); }
  void set_watch(std::function<absl::Status()> watch) { watch_ = std::move(watch); }

 private:
  // Offsets (bytes) of the step inputs inside the host and device blocks.
  struct InputLayout {
    size_t seed, sample_index, temperature, top_p, top_k, tokens, positions, slots, gather, total;
    // Position and slot of each sampled row (gather's rows), for a last layer of sampled rows.
    size_t sample_positions, sample_slots;
  };

  absl::Status Validate(const StepDescriptor& step, const Activations& in) const;
  absl::StatusOr<StepOutput> StepRows(const StepDescriptor& step, const Activations& in);
  // A block of this stage's dtype and dims over the given layers and positions, its K and V in
  // device memory (not written).
  absl::StatusOr<KvBlock> DeviceKvBlock(int first_layer, int num_layers, int positions) const;
  // Layer `l`'s rows of the write-out's slot into its block, published once they are there.
  absl::Status WriteOut(KvOut& out, int l);
  absl::Status Forward(int rows, int samples);
  // A decode step; `from_previous` as LaunchDecode's. With `wait` false it returns once the step
  // and the copy of its tokens to host_tokens_[buf_] are queued (no tail, no input to await).
  absl::Status RunDecode(const StepDescriptor& step, const Activations& in, StepOutput& out,
                         std::span<const int> from_previous = {}, bool wait = true);
  // The sampled rows' tokens (and logits) of decode step `step` from `host_tokens` into `out`.
  void ReadDecodeTokens(const StepDescriptor& step, const int32_t* host_tokens,
                        StepOutput& out) const;
  absl::Status RunChunks(const StepDescriptor& step, const Activations& in, StepOutput& out);
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
  bool LastLayerSampledOnly(int rows, int samples, bool gemv) const {
    return has_head_ && !gemv && samples < rows;
  }
  // y (rows, out) = x · wᵀ + beta * y: cuBLAS, or the pinned algorithms when batch-invariant.
  absl::Status Matmul(const void* x, const void* w, void* y, int rows, int out, int in, float beta,
                      bool y_f32);

  template <typename T>
  T* HostIn(size_t off) { return reinterpret_cast<T*>(host_in_[buf_].as<char>() + off); }
  template <typename T>
  T* DevIn(size_t off) const { return reinterpret_cast<T*>(inputs_.as<char>() + off); }
  void* KCache(int layer) const {
    return kv_.as<char>() + (2 * static_cast<size_t>(layer)) * kv_layer_bytes_;
  }
  void* VCache(int layer) const {
    return kv_.as<char>() + (2 * static_cast<size_t>(layer) + 1) * kv_layer_bytes_;
  }
  size_t RowBytes(int cols) const { return static_cast<size_t>(cols) * DTypeSize(opt_.dtype); }

  const ModelConfig c_;
  const CudaOptions opt_;
  bool has_embedding_ = false, has_head_ = false;
  int first_layer_ = 0;  // of the model: attention's scale and window are per model layer
  int num_layers_ = 0;
  int max_slots_ = 0, max_seq_len_ = 0, seq_capacity_ = 0;
  int rows_cap_ = 0, samples_cap_ = 0, max_bucket_ = 0, sm_count_ = 0;
  // The next forward pass's rows are prompt runs (several rows per sequence): attention through
  // the tensor-core prefill kernel. Set per chunk by RunChunks; never for decode steps.
  bool prefill_attention_ = false;
  size_t kv_layer_bytes_ = 0;

  cuda::Stream stream_;
  cuda::CublasHandle cublas_;
  DeviceBuffer cublas_workspace_;
  std::unique_ptr<cuda::FixedAlgoGemm> fixed_gemm_;  // batch_invariant: every GEMM through it
  // The weights' arenas this stage runs on (its own upload, or taken from earlier stages).
  std::vector<std::shared_ptr<const CudaPlacedWeights>> placed_;
  DeviceBuffer kv_;
  DeviceBuffer inv_freq_;  // (head_dim / 2) fp32 rotary inverse frequencies (Llama)
  DeviceBuffer x_, xn_, qkv_, q_, attn_, mlp_in_, mlp_act_, partials_, attn_counters_;
  DeviceBuffer head_in_, logits_, probs_, tokens_out_;
  DeviceBuffer sampled_x_, sampled_q_;  // the sampled rows of x_ and q_ in a pruned last layer
  DeviceBuffer inputs_;
  DeviceBuffer out_hidden_;  // outputs of steps longer than one chunk
  // Step inputs and sampled tokens in two blocks each, buf_ the one the next step uses: a step
  // launched ahead fills one while the step before may still read the other.
  PinnedBuffer host_in_[2], host_tokens_[2];
  int buf_ = 0;
  PinnedBuffer host_hidden_, host_logits_;
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
  const void* lm_head_ = nullptr;  // (vocab, hidden)

  std::map<int, std::unique_ptr<cuda::GraphExec>> graphs_;  // decode bucket -> graph

  DecodeObserver* observer_ = nullptr;  // SetDecodeObserver
  DecodeTail tail_;
  std::function<absl::Status()> watch_;  // SetStreamWatch
  PendingKvOuts kv_outs_;  // opened for the next step (OpenKvOut)
  // The write-outs the pass being queued fills layer by layer (a step's last chunk only).
  std::vector<std::shared_ptr<KvOut>> forward_outs_;
  std::vector<std::shared_ptr<KvOut>> step_outs_;  // the running step's
  std::vector<int> cached_len_;  // per slot: positions [0, len) hold K/V
};

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
  spdlog::info("CUDA stage of layers [{}, {}): weights in {:.3f} s ({} arena(s)), buffers and "
               "KV-cache of {} bytes in {:.3f} s, {} decode graph(s) in {:.3f} s",
               first_layer_, first_layer_ + num_layers_, seconds(t0, t1), placed_.size(),
               kv_.size(), seconds(t1, t2), graphs_.size(), seconds(t2, t3));
  return absl::OkStatus();
}

absl::Status CudaStage::CheckOptions(const StageSpec& spec) {
  CUDA_CHECK(cudaSetDevice(opt_.device));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, opt_.device));
  sm_count_ = prop.multiProcessorCount;
  if (opt_.dtype != DType::kF16 && opt_.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA backend dtype must be F16 or BF16, got ", std::string(DTypeName(opt_.dtype))));
  }
  if (!(opt_.kv_memory_fraction > 0.0f && opt_.kv_memory_fraction <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("kv_memory_fraction must be in (0, 1], got ",
                                                   opt_.kv_memory_fraction));
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
  // Refused before anything is allocated: a cache whose size overflows or exceeds the whole GPU.
  const int last = spec.last_layer == -1 ? c_.num_layers : spec.last_layer;
  RETURN_IF_ERROR(KvBytes(std::clamp(last - spec.first_layer, 1, c_.num_layers),
                          static_cast<int64_t>(prop.totalGlobalMem), "GPU memory in all")
                      .status());
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

absl::Status CudaStage::UploadWeights(const StageSpec& spec) {
  const int last = spec.last_layer == -1 ? c_.num_layers : spec.last_layer;
  ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(spec.model_dir));
  ASSIGN_OR_RETURN(StageSources w, FindStageWeights(*ckpt, spec.first_layer, last));
  has_embedding_ = w.has_embedding;
  has_head_ = w.has_head;
  first_layer_ = w.first_layer;
  num_layers_ = static_cast<int>(w.layers.size());

  RETURN_IF_ERROR(stream_.Create());
  RETURN_IF_ERROR(cublas_.Create());
  CUBLAS_CHECK(cublasSetStream(cublas_.get(), stream_.get()));
  // A workspace of our own, so that graph capture never sees cuBLAS allocate.
  RETURN_IF_ERROR(cublas_workspace_.Allocate(32 << 20));
  CUBLAS_CHECK(cublasSetWorkspace(cublas_.get(), cublas_workspace_.get(), cublas_workspace_.size()));
  if (opt_.batch_invariant) {
    ASSIGN_OR_RETURN(fixed_gemm_, cuda::FixedAlgoGemm::Create(stream_.get()));
    const int inter = c_.intermediate_size;
    const int in_cols = c_.arch == Arch::kLlama ? 2 * inter : inter;
    for (auto [out, in] : {std::pair{c_.q_dim() + 2 * c_.kv_dim(), c_.hidden_size},
                           std::pair{c_.hidden_size, c_.q_dim()},
                           std::pair{in_cols, c_.hidden_size}, std::pair{c_.hidden_size, inter}}) {
      RETURN_IF_ERROR(fixed_gemm_->Prepare(opt_.dtype, out, in, false));
    }
    if (w.has_head) {
      RETURN_IF_ERROR(fixed_gemm_->Prepare(opt_.dtype, c_.vocab_size, c_.hidden_size, true));
    }
  }

  // Weights: arenas already placed where they hold the layers, the others copied from the mapped
  // checkpoint in their stored dtype into one more.
  const int end = first_layer_ + num_layers_;
  ASSIGN_OR_RETURN(StageArenas arenas,
                   ArenasFor(spec, first_layer_, end, opt_, c_.tie_word_embeddings));
  std::vector<std::shared_ptr<const CudaPlacedWeights>> from = arenas.usable;
  if (arenas.uploaded != nullptr) from.insert(from.begin(), arenas.uploaded);
  placed_.clear();
  // The first arena holding `layer`, kept by the stage.
  auto arena_of = [&](int layer) -> const StageWeightsOf<const void*>& {
    for (const std::shared_ptr<const CudaPlacedWeights>& a : from) {
      if (!a->Holds(layer)) continue;
      if (std::find(placed_.begin(), placed_.end(), a) == placed_.end()) placed_.push_back(a);
      return a->tensors();
    }
    std::abort();  // ArenasFor leaves no layer without one
  };
  if (has_embedding_) {
    tok_embedding_ = arena_of(0).tok_embedding;
    pos_embedding_ = arena_of(0).pos_embedding;
  }
  for (int layer = first_layer_; layer < end; ++layer) {
    const StageWeightsOf<const void*>& a = arena_of(layer);
    const LayerWeightsOf<const void*>& l = a.layers[layer - a.first_layer];
    DeviceLayer dl;
    dl.attn_norm_w = l.attn_norm_w;
    dl.attn_norm_b = l.attn_norm_b;
    dl.wqkv = l.wqkv;
    dl.bqkv = l.bqkv;
    dl.wo = l.wo;
    dl.bo = l.bo;
    dl.mlp_norm_w = l.mlp_norm_w;
    dl.mlp_norm_b = l.mlp_norm_b;
    dl.w_in = l.w_in;
    dl.b_in = l.b_in;
    dl.w_out = l.w_out;
    dl.b_out = l.b_out;
    layers_.push_back(dl);
  }
  if (has_head_) {
    const StageWeightsOf<const void*>& a = arena_of(end - 1);
    final_norm_w_ = a.final_norm_w;
    final_norm_b_ = a.final_norm_b;
    lm_head_ = a.lm_head;
  }
  if (c_.arch == Arch::kLlama) {
    const std::vector<float> inv_freq = RopeInverseFrequencies(c_);
    RETURN_IF_ERROR(inv_freq_.Allocate(inv_freq.size() * sizeof(float)));
    CUDA_CHECK(cudaMemcpy(inv_freq_.get(), inv_freq.data(), inv_freq.size() * sizeof(float),
                          cudaMemcpyHostToDevice));
  }
  return absl::OkStatus();
}

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
  }
  if (!has_embedding_) RETURN_IF_ERROR(host_hidden_.Allocate(rows_cap_ * RowBytes(hidden)));
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

absl::Status CudaStage::Matmul(const void* x, const void* w, void* y, int rows, int out, int in,
                               float beta, bool y_f32) {
  if (fixed_gemm_ != nullptr)
    return fixed_gemm_->Run(opt_.dtype, x, w, y, rows, out, in, beta, y_f32);
  return cuda::Gemm(cublas_.get(), opt_.dtype, x, w, y, rows, out, in, beta, y_f32);
}

int CudaStage::SplitsFor(int rows) const {
  // Batch-invariant: the keys of a row are never split, whatever the number of rows.
  if (opt_.batch_invariant) return 1;
  // Enough blocks to fill the GPU twice; no more splits than tiles of the longest context.
  const int64_t blocks = static_cast<int64_t>(rows) * c_.num_kv_heads;
  int splits = static_cast<int>((2 * sm_count_ + blocks - 1) / blocks);
  splits = std::min({splits, kMaxSplits, seq_capacity_ / cuda::kKvSeqAlign});
  return std::max(splits, 1);
}

absl::Status CudaStage::Forward(int rows, int samples) {
  using namespace cuda;
  const cudaStream_t s = stream_.get();
  const DType t = opt_.dtype;
  const int hidden = c_.hidden_size, inter = c_.intermediate_size;
  const bool llama = c_.arch == Arch::kLlama;
  const int qkv_cols = c_.q_dim() + 2 * c_.kv_dim();
  const int32_t* positions = DevIn<int32_t>(layout_.positions);
  const int32_t* slots = DevIn<int32_t>(layout_.slots);
  const float* inv_freq = llama ? inv_freq_.as<float>() : nullptr;  // null: no rotation
  // Decode-sized passes: every projection through the GEMV kernels, with biases, residual adds
  // and the MLP activation fused into them.
  const bool gemv = GemvFits(rows);
  uint32_t* counters = attn_counters_.as<uint32_t>();
  if (has_embedding_) {
    // Decode rows fed by the step before read its tokens where its sampling left them.
    RETURN_IF_ERROR(LaunchEmbedding(t, DevIn<int32_t>(layout_.tokens), positions, tok_embedding_,
                                    pos_embedding_, x_.get(), rows, hidden, s, /*pdl=*/false,
                                    has_head_ ? tokens_out_.as<int32_t>() : nullptr));
  }
  const void* pending_bias = nullptr;  // bias of the last projection into x, not yet added
  // The residual stream and the rows after the keys and values of a layer are written: every
  // row, or in a pruned last layer only the sampled ones, gathered (see CudaOptions).
  void* x = x_.get();
  const void* q = q_.get();
  int n = rows;
  const int32_t* row_positions = positions;
  const int32_t* row_slots = slots;
  bool sampled_only = false;
  for (int l = 0; l < num_layers_; ++l) {
    const DeviceLayer& L = layers_[l];
    if (l <= 1 || l == num_layers_ - 1) {
      constexpr DecodeObserver::Point kLayerPoints[] = {DecodeObserver::Point::kLayer0,
                                                        DecodeObserver::Point::kLayer1,
                                                        DecodeObserver::Point::kLastLayer};
      RETURN_IF_ERROR(Mark(kLayerPoints[std::min(l, 2)]));
    }
    // Attention block: norm -> qkv -> rope + cache -> attention -> out-proj added into x.
    RETURN_IF_ERROR(LaunchNorm(t, llama, x_.get(), pending_bias, L.attn_norm_w, L.attn_norm_b,
                               nullptr, xn_.get(), rows, hidden, c_.norm_eps, s));
    // GEMV-sized passes: the QKV projection writes q and the KV-cache itself, rotary embedding
    // included; otherwise a separate split/rotate kernel follows the GEMM.
    if (gemv) {
      QkvCacheArgs cache;
      cache.q_out = q_.get();
      cache.k_cache = KCache(l);
      cache.v_cache = VCache(l);
      cache.positions = positions;
      cache.slots = slots;
      cache.num_heads = c_.num_heads;
      cache.num_kv_heads = c_.num_kv_heads;
      cache.head_dim = c_.head_dim;
      cache.seq_capacity = seq_capacity_;
      cache.inv_freq = inv_freq;
      RETURN_IF_ERROR(GemvQkvCache(t, xn_.get(), L.wqkv, L.bqkv, cache, rows, hidden, s));
    } else {
      RETURN_IF_ERROR(Matmul(xn_.get(), L.wqkv, qkv_.get(), rows, qkv_cols, hidden, 0.0f, false));
      RETURN_IF_ERROR(LaunchQkvRopeCache(t, qkv_.get(), L.bqkv, q_.get(),
                                         KCache(l), VCache(l), positions, slots, rows, c_.num_heads,
                                         c_.num_kv_heads, c_.head_dim, seq_capacity_, inv_freq, s));
    }
    for (const std::shared_ptr<KvOut>& out : forward_outs_) RETURN_IF_ERROR(WriteOut(*out, l));
    if (l == num_layers_ - 1 && LastLayerSampledOnly(rows, samples, gemv)) {
      if (samples == 0) return absl::OkStatus();  // the cache is written; no row is read
      const int32_t* gather = DevIn<int32_t>(layout_.gather);
      RETURN_IF_ERROR(LaunchGatherRows(x_.get(), gather, sampled_x_.get(), samples,
                                       RowBytes(hidden), s));
      RETURN_IF_ERROR(LaunchGatherRows(q_.get(), gather, sampled_q_.get(), samples,
                                       RowBytes(c_.q_dim()), s));
      x = sampled_x_.get();
      q = sampled_q_.get();
      n = samples;
      row_positions = DevIn<int32_t>(layout_.sample_positions);
      row_slots = DevIn<int32_t>(layout_.sample_slots);
      sampled_only = true;
    }
    // Decode-sized passes (and a last layer of few sampled rows) take the GEMV kernels from here.
    const bool rest_gemv = sampled_only ? GemvFits(n) : gemv;
    const AttentionParams attention{c_.attention_scale(first_layer_ + l),
                                    c_.attention_window(first_layer_ + l)};
    if (prefill_attention_ && !sampled_only) {
      RETURN_IF_ERROR(LaunchPrefillAttention(t, q, KCache(l), VCache(l), row_positions,
                                             row_slots, attn_.get(), n, c_.num_heads,
                                             c_.num_kv_heads, c_.head_dim, seq_capacity_,
                                             attention, s));
    } else {
      RETURN_IF_ERROR(LaunchAttention(t, q, KCache(l), VCache(l), row_positions, row_slots,
                                      partials_.as<float>(), attn_.get(), n, c_.num_heads,
                                      c_.num_kv_heads, c_.head_dim, seq_capacity_, SplitsFor(n),
                                      attention, s, counters));
    }
    if (rest_gemv) {
      RETURN_IF_ERROR(Gemv(t, GemvEpilogue::kResidual, attn_.get(), L.wo, L.bo, x, n, hidden,
                           c_.q_dim(), s));
    } else {
      RETURN_IF_ERROR(Matmul(attn_.get(), L.wo, x, n, hidden, c_.q_dim(), 1.0f, false));
    }
    // MLP block: norm (adding the out-proj bias first) -> up -> activation -> down added into x.
    const void* mlp_x = xn_.get();  // input of the MLP-in projection
    RETURN_IF_ERROR(LaunchNorm(t, llama, x, rest_gemv ? nullptr : L.bo, L.mlp_norm_w,
                               L.mlp_norm_b, nullptr, xn_.get(), n, hidden, c_.norm_eps, s));
    const void* act = mlp_in_.get();
    if (rest_gemv) {
      const GemvEpilogue in_epilogue = llama ? GemvEpilogue::kSwiGlu : GemvEpilogue::kGelu;
      void* in_out = llama ? mlp_act_.get() : mlp_in_.get();
      const void* in_bias = llama ? nullptr : L.b_in;
      RETURN_IF_ERROR(
          Gemv(t, in_epilogue, mlp_x, L.w_in, in_bias, in_out, n, inter, hidden, s));
      act = in_out;
      RETURN_IF_ERROR(Gemv(t, GemvEpilogue::kResidual, act, L.w_out, L.b_out, x, n, hidden,
                           inter, s));
      pending_bias = nullptr;
      continue;
    }
    RETURN_IF_ERROR(
        Matmul(mlp_x, L.w_in, mlp_in_.get(), n, llama ? 2 * inter : inter, hidden, 0.0f, false));
    if (llama) {
      RETURN_IF_ERROR(LaunchSwiGlu(t, mlp_in_.get(), mlp_act_.get(), n, inter, s));
      act = mlp_act_.get();
    } else {
      RETURN_IF_ERROR(LaunchGeluBias(t, mlp_in_.get(), L.b_in, n, inter, s));
    }
    RETURN_IF_ERROR(Matmul(act, L.w_out, x, n, hidden, inter, 1.0f, false));
    pending_bias = L.b_out;
  }
  RETURN_IF_ERROR(Mark(DecodeObserver::Point::kHead));
  if (has_head_) {
    if (samples > 0) {
      // Final norm of the sampled rows only (gathered already where the last layer was pruned),
      // LM head into fp32 logits, sampling.
      const int32_t* gather = sampled_only ? nullptr : DevIn<int32_t>(layout_.gather);
      const bool head_gemv = samples <= GemvMaxRows() && GemvSupported(samples, hidden);
      RETURN_IF_ERROR(LaunchNorm(t, llama, x, pending_bias, final_norm_w_, final_norm_b_,
                                 gather, head_in_.get(), samples, hidden, c_.norm_eps, s));
      if (head_gemv) {
        RETURN_IF_ERROR(Gemv(t, GemvEpilogue::kF32, head_in_.get(), lm_head_, nullptr,
                             logits_.get(), samples, c_.vocab_size, hidden, s));
      } else {
        RETURN_IF_ERROR(Matmul(head_in_.get(), lm_head_, logits_.get(), samples, c_.vocab_size,
                               hidden, 0.0f, true));
      }
      SamplingArrays p{DevIn<float>(layout_.temperature), DevIn<int32_t>(layout_.top_k),
                       DevIn<float>(layout_.top_p), DevIn<uint64_t>(layout_.seed),
                       DevIn<uint64_t>(layout_.sample_index)};
      RETURN_IF_ERROR(LaunchSample(logits_.as<float>(), probs_.as<float>(), p,
                                   tokens_out_.as<int32_t>(), samples, c_.vocab_size, s));
    }
  } else if (pending_bias != nullptr) {
    RETURN_IF_ERROR(LaunchAddBias(t, x_.get(), pending_bias, rows, hidden, s));
  }
  return absl::OkStatus();
}

absl::Status CudaStage::Validate(const StepDescriptor& step, const Activations& in) const {
  const StepLimits limits{max_slots_, max_seq_len_, c_.vocab_size, c_.hidden_size,
                          has_embedding_};
  RETURN_IF_ERROR(ValidateStep(step, in, limits, cached_len_));
  for (size_t i = 0; has_head_ && i < step.seqs.size(); ++i) {
    if (step.seqs[i].prompt_logprobs >= 0) {
      return absl::UnimplementedError(absl::StrCat(
          "step ", step.id, ": sequence ", i,
          ": prompt_logprobs are not computed by the CUDA backend (its head scores only the "
          "sampled rows)"));
    }
  }
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

absl::StatusOr<KvBlock> CudaStage::ExportKv(int slot, int positions, int first_layer,
                                            int num_layers) const {
  RETURN_IF_ERROR(CheckKvExport(slot, positions, first_layer, num_layers, first_layer_,
                                first_layer_ + num_layers_, max_slots_,
                                slot >= 0 && slot < max_slots_ ? cached_len_[slot] : 0));
  KvBlock b = SizedKvBlock(opt_.dtype, first_layer, num_layers, c_.num_kv_heads, c_.head_dim,
                           positions);
  // Per layer: the slot's rows gathered into the block's layout on the device, then one copy
  // each of K and V to the host, all on the stage's stream behind the steps queued before.
  CUDA_CHECK(cudaSetDevice(opt_.device));
  const size_t layer_bytes = static_cast<size_t>(positions) * RowBytes(c_.kv_dim());
  for (int l = 0; l < num_layers; ++l) {
    const int layer = first_layer - first_layer_ + l;
    const auto [k_stage, v_stage] = KvStaging(layer);
    RETURN_IF_ERROR(cuda::LaunchKvBlockCopy(KCache(layer), VCache(layer), slot, k_stage, v_stage,
                                            positions, c_.num_kv_heads, c_.head_dim,
                                            seq_capacity_, /*to_block=*/true, stream_.get()));
    CUDA_CHECK(cudaMemcpyAsync(b.k.data() + l * layer_bytes, k_stage, layer_bytes,
                               cudaMemcpyDeviceToHost, stream_.get()));
    CUDA_CHECK(cudaMemcpyAsync(b.v.data() + l * layer_bytes, v_stage, layer_bytes,
                               cudaMemcpyDeviceToHost, stream_.get()));
  }
  RETURN_IF_ERROR(Drain());
  return b;
}

absl::StatusOr<KvBlock> CudaStage::DeviceKvBlock(int first_layer, int num_layers,
                                                 int positions) const {
  KvBlock b = KvBlockOf(opt_.dtype, first_layer, num_layers, c_.num_kv_heads, c_.head_dim,
                        positions);
  const size_t bytes = b.expected_bytes();
  ASSIGN_OR_RETURN(std::shared_ptr<uint8_t> mem, SharedDeviceBytes(opt_.device, 2 * bytes));
  b.device_k = mem;
  b.device_v = std::shared_ptr<uint8_t>(mem, mem.get() + bytes);
  return b;
}

absl::StatusOr<KvBlock> CudaStage::ExportKvToDevice(int slot, int positions, int first_layer,
                                                    int num_layers) const {
  RETURN_IF_ERROR(CheckKvExport(slot, positions, first_layer, num_layers, first_layer_,
                                first_layer_ + num_layers_, max_slots_,
                                slot >= 0 && slot < max_slots_ ? cached_len_[slot] : 0));
  ASSIGN_OR_RETURN(KvBlock b, DeviceKvBlock(first_layer, num_layers, positions));
  // Per layer: the slot's rows gathered straight into the block, on the stage's stream.
  const size_t layer_bytes = static_cast<size_t>(positions) * RowBytes(c_.kv_dim());
  for (int l = 0; l < num_layers; ++l) {
    const int layer = first_layer - first_layer_ + l;
    RETURN_IF_ERROR(cuda::LaunchKvBlockCopy(
        KCache(layer), VCache(layer), slot, b.device_k.get() + l * layer_bytes,
        b.device_v.get() + l * layer_bytes, positions, c_.num_kv_heads, c_.head_dim, seq_capacity_,
        /*to_block=*/true, stream_.get()));
  }
  RETURN_IF_ERROR(Drain());
  return b;
}

absl::Status CudaStage::ImportKv(int slot, const KvBlock& block) {
  RETURN_IF_ERROR(CheckKvBlock(block, slot, c_, opt_.dtype, first_layer_,
                               first_layer_ + num_layers_, max_slots_, max_seq_len_));
  CUDA_CHECK(cudaSetDevice(opt_.device));
  const size_t layer_bytes = static_cast<size_t>(block.positions) * RowBytes(c_.kv_dim());
  if (block.on_device()) {
    // Device memory of this GPU only (a block of another GPU comes over a KvLink first).
    for (const uint8_t* p : {block.device_k.get(), block.device_v.get()}) {
      cudaPointerAttributes attr{};
      CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
      if (attr.type != cudaMemoryTypeDevice || attr.device != opt_.device) {
        return absl::InvalidArgumentError(
            absl::StrCat("KV block: in the memory of ",
                         attr.type == cudaMemoryTypeDevice ? absl::StrCat("device ", attr.device)
                                                           : std::string("no device"),
                         ", this stage runs on device ", opt_.device));
      }
    }
    for (int l = 0; l < block.num_layers; ++l) {
      const int layer = block.first_layer - first_layer_ + l;
      RETURN_IF_ERROR(cuda::LaunchKvBlockCopy(
          KCache(layer), VCache(layer), slot, block.device_k.get() + l * layer_bytes,
          block.device_v.get() + l * layer_bytes, block.positions, c_.num_kv_heads, c_.head_dim,
          seq_capacity_, /*to_block=*/false, stream_.get()));
    }
    RETURN_IF_ERROR(Drain());
    cached_len_[slot] = block.positions;
    return absl::OkStatus();
  }
  // The reverse of ExportKv's copies, per layer.
  for (int l = 0; l < block.num_layers; ++l) {
    const int layer = block.first_layer - first_layer_ + l;
    const auto [k_stage, v_stage] = KvStaging(layer);
    CUDA_CHECK(cudaMemcpyAsync(k_stage, block.k.data() + l * layer_bytes, layer_bytes,
                               cudaMemcpyHostToDevice, stream_.get()));
    CUDA_CHECK(cudaMemcpyAsync(v_stage, block.v.data() + l * layer_bytes, layer_bytes,
                               cudaMemcpyHostToDevice, stream_.get()));
    RETURN_IF_ERROR(cuda::LaunchKvBlockCopy(KCache(layer), VCache(layer), slot, k_stage, v_stage,
                                            block.positions, c_.num_kv_heads, c_.head_dim,
                                            seq_capacity_, /*to_block=*/false, stream_.get()));
  }
  RETURN_IF_ERROR(Drain());
  cached_len_[slot] = block.positions;
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
    CUDA_CHECK(cudaMemcpyAsync(x_.get(), src, rows * row_bytes, cudaMemcpyDeviceToDevice,
                               stream_.get()));
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
  CUDA_CHECK(cudaMemcpyAsync(x_.get(), staging, rows * row_bytes, cudaMemcpyHostToDevice,
                             stream_.get()));
  return absl::OkStatus();
}

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
  for (int i = 0; i < bucket; ++i) {
    const bool real = i < n;
    const SequenceStep* s = real ? &step.seqs[i] : nullptr;
    const bool fed = real && !from_previous.empty() && from_previous[i] >= 0;
    tokens[i] = !real || !has_embedding_ ? 0 : fed ? -1 - from_previous[i] : step.tokens[i];
    positions[i] = real ? s->position : 0;
    slots[i] = real ? s->slot : max_slots_;
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
         std::none_of(step.seqs.begin(), step.seqs.end(), NeedsHostRule);
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
  // Row -> (sequence, token) as chunks are cut.
  size_t seq = 0;
  int tok = 0;
  for (int64_t row0 = 0; row0 < total; row0 += rows_cap_) {
    const int rows = static_cast<int>(std::min<int64_t>(rows_cap_, total - row0));
    int32_t* tokens = HostIn<int32_t>(layout_.tokens);
    int32_t* positions = HostIn<int32_t>(layout_.positions);
    int32_t* slots = HostIn<int32_t>(layout_.slots);
    std::vector<int> sampled_seqs;  // sequences sampled in this chunk
    int samples = 0, chunk_seqs = 0;
    for (int r = 0; r < rows; ++r) {
      const SequenceStep& s = step.seqs[seq];
      if (tok == 0 || r == 0) ++chunk_seqs;
      tokens[r] = has_embedding_ ? step.tokens[row0 + r] : 0;
      positions[r] = s.position + tok;
      slots[r] = s.slot;
      if (++tok == s.num_tokens) {
        if (s.sample && has_head_) {
          const int j = samples++;
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
    RETURN_IF_ERROR(Forward(rows, samples));
    if (has_head_ && samples > 0) {
      CUDA_CHECK(cudaMemcpyAsync(host_tokens_[buf_].get(), tokens_out_.get(), samples * sizeof(int32_t),
                                 cudaMemcpyDeviceToHost, stream_.get()));
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

absl::StatusOr<std::shared_ptr<KvOut>> CudaStage::OpenKvOut(int slot, int positions) {
  RETURN_IF_ERROR(CheckKvOut(slot, positions, first_layer_, first_layer_ + num_layers_,
                             max_slots_, max_seq_len_));
  ASSIGN_OR_RETURN(KvBlock b, DeviceKvBlock(first_layer_, num_layers_, positions));
  auto out = std::make_shared<KvOut>(std::move(b), slot);
  kv_outs_.Add(out);
  return out;
}

absl::Status CudaStage::WriteOut(KvOut& out, int l) {
  KvBlock& b = out.block_to_write();
  const size_t layer_bytes = static_cast<size_t>(b.positions) * RowBytes(c_.kv_dim());
  RETURN_IF_ERROR(cuda::LaunchKvBlockCopy(KCache(l), VCache(l), out.slot(),
                                          b.device_k.get() + l * layer_bytes,
                                          b.device_v.get() + l * layer_bytes, b.positions,
                                          c_.num_kv_heads, c_.head_dim, seq_capacity_,
                                          /*to_block=*/true, stream_.get()));
  auto written = std::make_shared<cuda::Event>();
  CUDA_CHECK(cudaEventCreateWithFlags(written->put(), cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(written->get(), stream_.get()));
  out.Written(l, [written, device = opt_.device]() -> absl::Status {
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaEventSynchronize(written->get()));
    return absl::OkStatus();
  });
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

absl::StatusOr<StepOutput> CudaStage::StepRows(const StepDescriptor& step,
                                               const Activations& in) {
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
  const bool decode = std::all_of(step.seqs.begin(), step.seqs.end(),
                                  [](const SequenceStep& s) { return s.num_tokens == 1; });
  // Sequences with min_p, a penalty or logprobs take the host rule over the sampled rows' fp32
  // logits, copied back only in steps that hold one; every other step runs as it would.
  const bool host_rule = has_head_ && std::any_of(step.seqs.begin(), step.seqs.end(),
                                                  NeedsHostRule);
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
  return out;
}

}  // namespace

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

namespace {
absl::StatusOr<CudaStage*> AsCudaStage(Stage& stage) {
  auto* cuda_stage = dynamic_cast<CudaStage*>(&stage);
  if (cuda_stage == nullptr) return absl::InvalidArgumentError("not a CUDA stage");
  return cuda_stage;
}
}  // namespace

absl::StatusOr<int> DecodeGraphCount(const Stage& stage) {
  const auto* cuda_stage = dynamic_cast<const CudaStage*>(&stage);
  if (cuda_stage == nullptr) return absl::InvalidArgumentError("not a CUDA stage");
  return cuda_stage->decode_graphs();
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
  CUDA_CHECK(cudaMemcpy(out.k.data(), block.device_k.get(), out.k.size(), cudaMemcpyDefault));
  CUDA_CHECK(cudaMemcpy(out.v.data(), block.device_v.get(), out.v.size(), cudaMemcpyDefault));
  return out;
}

absl::StatusOr<void*> CudaStageStream(Stage& stage) {
  ASSIGN_OR_RETURN(CudaStage * cuda_stage, AsCudaStage(stage));
  return static_cast<void*>(cuda_stage->stream());
}

absl::Status SetStreamWatch(Stage& stage, std::function<absl::Status()> watch) {
  ASSIGN_OR_RETURN(CudaStage * cuda_stage, AsCudaStage(stage));
  cuda_stage->set_watch(std::move(watch));
  return absl::OkStatus();
}

absl::Status SetDecodeObserver(Stage& stage, DecodeObserver* observer) {
  ASSIGN_OR_RETURN(CudaStage * cuda_stage, AsCudaStage(stage));
  cuda_stage->set_observer(observer);
  return absl::OkStatus();
}

absl::Status SetDecodeTail(Stage& stage, DecodeTail tail) {
  ASSIGN_OR_RETURN(CudaStage * cuda_stage, AsCudaStage(stage));
  cuda_stage->set_tail(std::move(tail));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const PlacedWeights>> PlaceCudaWeights(
    const StageSpec& spec, const CudaOptions& options) {
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
    return absl::InvalidArgumentError(absl::StrFormat(
        "layers [%d, %d) of a model of %d", spec.first_layer, last, c.num_layers));
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
