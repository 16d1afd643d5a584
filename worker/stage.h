// The engine's one interface: a contiguous range of layers of one model on one device, stepping a
// batch of sequences (common/step.h). Backends (cpu/, cuda/) implement it; workers and tests drive
// it.
#pragma once

#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "common/model_config.h"
#include "common/step.h"
#include "worker/kv_scales.h"

namespace tandem {

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

// The KV-cache of one sequence over some of a model's layers, positions [0, positions): what a
// stage exports for another to import when the sequence moves. k and v are each
// [layer][position][num_kv_heads * head_dim] elements of `dtype`. The fields say what the bytes
// are, so that a stage refuses a block that does not fit it instead of reading it wrongly.
struct KvBlock {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // kF8E4M3: a KV-cache kept in FP8, the codes of each layer's K and V over its `scales`.
  DType dtype = DType::kF32;
  int first_layer = 0;  // model layers [first_layer, first_layer + num_layers)
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int positions = 0;
  // With dtype kF8E4M3, one per layer of the block, in order: what its codes are multiples of
  // (value = E4M3(code) * scale, worker/kv_scales.h). Empty for every other dtype.
  std::vector<KvScales> scales;
  std::vector<uint8_t> k, v;
  // Instead of k and v (then empty): device memory of one GPU holding the same bytes (a block kept
  // on its GPU by ExportKvToDevice, or received over NCCL), each pointer sharing the ownership of
  // the allocation it points into.
  std::shared_ptr<uint8_t> device_k, device_v;
  size_t expected_bytes() const;  // of k (and of v) by the fields above; 0 when they are invalid
  bool on_device() const { return device_k != nullptr; }
  size_t bytes() const;  // of K and V together, wherever they are
};

// Where a sequence's KV-cache is in a stage: its slot, which names the sequence (its sampling
// state, its moves), and on a stage whose KV-cache is paged (StageSpec::kv_page_size > 0) its
// block table: position p is in page block_table[p / page_size], row p % page_size. The table is
// empty on a stage of contiguous slots, where the slot holds the positions.
struct KvPlace {
  KvPlace(int slot) : slot(slot) {}  // NOLINT(google-explicit-constructor): a contiguous slot
  KvPlace(int slot, std::vector<int32_t> block_table)
      : slot(slot), block_table(std::move(block_table)) {}
  int slot = 0;
  std::vector<int32_t> block_table;
};

// Weights a backend has placed (a CUDA stage's arena in device memory), which a later stage of
// the same checkpoint may take instead of loading them again (StageSpec::placed): the model
// layers [first_layer, last_layer), with the embeddings where first_layer is 0 and the final
// norm and LM head where last_layer is the model's last. Freed once no stage or holder keeps it.
class PlacedWeights {
 public:
  virtual ~PlacedWeights() = default;
  virtual int first_layer() const = 0;
  virtual int last_layer() const = 0;
  virtual int64_t bytes() const = 0;
};

class KvOut;           // worker/kv_out.h
class DecodeObserver;  // worker/cuda/cuda_stage.h

// Work queued on a device stage's stream right behind each decode step's forward pass, before the
// stage waits for the step: a transport sharing the stream (ActivationTransport::BindStage) sends
// the step's output from there, so the send starts when the forward pass ends rather than once
// the host has seen the step complete. `hidden` is the output of a stage without the LM head
// (device memory, written in stream order), `device_tokens` that of the last stage (one sampled
// token per sequence of the step, in order, whether or not the sequence samples; device memory),
// null otherwise. An error fails the step (after the stage has waited for it) and leaves the
// stage usable.
using DecodeTail = std::function<absl::Status(const StepDescriptor& step, const Activations& hidden,
                                              const int32_t* device_tokens)>;

class Stage {
 public:
  virtual ~Stage() = default;
  // The placed weights this stage runs on (kept alive by it); none where the backend places
  // none.
  virtual std::vector<std::shared_ptr<const PlacedWeights>> placed_weights() const { return {}; }
  // Runs one step. The first stage reads step.tokens and ignores `in`; the others read `in`.
  // Errors (bad slot, position past the context, shape mismatch) leave the stage usable.
  virtual absl::StatusOr<StepOutput> Step(const StepDescriptor& step, const Activations& in) = 0;
  virtual const ModelConfig& config() const = 0;
  // The pages of KV-cache the stage holds when spec.kv_page_size > 0 (steps then name each
  // sequence's pages in SequenceStep::block_table); 0 where its slots hold contiguous rows.
  virtual int kv_pages() const { return 0; }
  // The KV-cache of the sequence at `place`, positions [0, positions), of the model layers
  // [first_layer, first_layer + num_layers), all within this stage's. INVALID_ARGUMENT naming
  // what is out of range (a slot, a page, positions the sequence does not hold, layers the stage
  // does not have).
  virtual absl::StatusOr<KvBlock> ExportKv(const KvPlace& place, int positions, int first_layer,
                                           int num_layers) const {
    (void)place, (void)positions, (void)first_layer, (void)num_layers;
    return absl::UnimplementedError("this backend does not export its KV-cache");
  }
  // As ExportKv, but the block stays in this stage's device memory (on_device()), for a copy to
  // another GPU or back into this stage. UNIMPLEMENTED where the backend has no device.
  virtual absl::StatusOr<KvBlock> ExportKvToDevice(const KvPlace& place, int positions,
                                                   int first_layer, int num_layers) const {
    (void)place, (void)positions, (void)first_layer, (void)num_layers;
    return absl::UnimplementedError("this backend keeps no KV-cache in device memory");
  }
  // Writes `block` (in host memory or, where the backend has a device, in this stage's device
  // memory) at `place`, which then holds its positions [0, block.positions): the next step of the
  // sequence starts there. A block of other dims, another version, a dtype other than the
  // cache's, layers outside this stage's, positions past its capacity (or the place's pages), a
  // byte count that does not match or device memory this stage cannot read is INVALID_ARGUMENT
  // naming it, and nothing is written. Every layer of the stage must come (in one block or
  // several) before the sequence's next step.
  virtual absl::Status ImportKv(const KvPlace& place, const KvBlock& block) {
    (void)place, (void)block;
    return absl::UnimplementedError("this backend does not import a KV-cache");
  }

  // Opens the write-out of the KV-cache at `place` (the slot and block table of the next step's
  // row), positions [0, positions) of every layer of this stage, that the next Step fills as it
  // goes (its row of that slot must end at `positions`): each layer is published
  // (KvOut::Written) once the step has written it, while the step goes on with the next layers.
  // A next step without that row fails it. UNIMPLEMENTED where the backend writes none out;
  // RESOURCE_EXHAUSTED where there is no room for the block.
  virtual absl::StatusOr<std::shared_ptr<KvOut>> OpenKvOut(const KvPlace& place, int positions) {
    (void)place, (void)positions;
    return absl::UnimplementedError("this backend does not write its KV-cache out");
  }

  // Decode steps launched ahead, on a stage that both embeds and samples: LaunchDecode queues a
  // step behind those launched before it and returns without waiting for them, so that the next
  // step is on its way while one runs (a backend with a device queues both there, and the device
  // runs them back to back). `from_previous[i]` >= 0 makes the token of the step's row i the one
  // that row from_previous[i] of the newest launched, unfinished step samples (step.tokens[i] is
  // then ignored); -1 takes step.tokens[i]. FinishDecode waits for the oldest launched step and
  // returns its output, as Step would have; DecodeDone says whether it would not wait. At most
  // kMaxLaunchedDecodes steps are launched and unfinished; while any is, Step, ExportKv and
  // ImportKv are still allowed (they run after them). CanLaunchDecode: whether `step` may be
  // launched so (one token per row; no logits returned; on a stage that embeds and samples).
  // This default runs the step at launch (Step) and keeps its output until it is finished.
  // LaunchOverlaps: whether a launched step runs while the host goes on (on a device's stream);
  // false where LaunchDecode runs the step before it returns, as the default does.
  static constexpr int kMaxLaunchedDecodes = 2;
  virtual bool LaunchOverlaps() const { return false; }
  virtual bool CanLaunchDecode(const StepDescriptor& step) const;
  virtual absl::Status LaunchDecode(const StepDescriptor& step, std::span<const int> from_previous);
  virtual bool DecodeDone() const { return true; }
  virtual absl::StatusOr<StepOutput> FinishDecode();
  virtual int launched_decodes() const { return static_cast<int>(launched_.size()); }

  // What a stage on a device offers the worker and its transport. A host stage (the defaults)
  // has no device: ToHost returns host activations as they are, the rest is UNIMPLEMENTED.
  //
  // `a` in host memory: a copy of device activations this stage made, or `a` itself.
  virtual absl::StatusOr<Activations> ToHost(const Activations& a) const;
  // The stream (a cudaStream_t) every step of this stage runs on, for a transport to queue its
  // work on in issue order.
  virtual absl::StatusOr<void*> DeviceStream() const;
  // Sets (or, with an empty function, clears) the work queued behind each decode step's forward
  // pass (DecodeTail).
  virtual absl::Status SetDecodeTail(DecodeTail tail);
  // Has the stage's waits for its stream poll `watch` (about every millisecond) instead of
  // blocking in the driver, for a transport that shares the stream: an error from it fails the
  // step once the stream has drained (the watch having aborted what kept it busy), or after 10 s
  // more if it does not drain. An empty function restores the plain wait. The watch must stay
  // callable while set.
  virtual absl::Status SetStreamWatch(std::function<absl::Status()> watch);
  // Sets (or, with null, clears) the observer of the decode steps, which must outlive the stage;
  // set it before the first step, so that the decode graphs hold its marks.
  virtual absl::Status SetDecodeObserver(DecodeObserver* observer);
  // How many decode graphs the stage holds (one per batch-size bucket replayed so far).
  virtual absl::StatusOr<int> DecodeGraphCount() const;

 protected:
  // The checks of LaunchDecode every backend makes: that `step` can be launched, that no more
  // than kMaxLaunchedDecodes would be unfinished (`unfinished` are now), and that
  // `from_previous` names sampled rows of `previous`, the newest unfinished step (null: none).
  // INVALID_ARGUMENT or FAILED_PRECONDITION naming what is wrong.
  absl::Status CheckLaunch(const StepDescriptor& step, std::span<const int> from_previous,
                           int unfinished, const StepDescriptor* previous) const;

 private:
  // The default's launched steps, oldest first: each step with its output.
  struct Launched {
    StepDescriptor step;
    absl::StatusOr<StepOutput> output;
  };
  std::deque<Launched> launched_;
};

// The checks every backend's ImportKv makes, against a stage of model config `c` holding the
// model layers [first_layer, last_layer) in `dtype` with `max_slots` slots of `max_seq_len`
// positions, and with dtype kF8E4M3 the scales `scales` (one per layer of the stage: the block's
// must be those of its layers, exactly; no conversion between scales or dtypes is made): OK, or
// INVALID_ARGUMENT naming the first mismatch (a dtype or a scale: the block's and the stage's).
absl::Status CheckKvBlock(const KvBlock& block, int slot, const ModelConfig& c, DType dtype,
                          int first_layer, int last_layer, int max_slots, int max_seq_len,
                          std::span<const KvScales> scales = {});
// Slot `slot` within [0, max_slots) and the layers [first_layer, first_layer + num_layers)
// within the stage's [stage_first, stage_last): OK, or INVALID_ARGUMENT beginning with `what`.
absl::Status CheckKvRange(const char* what, int slot, int first_layer, int num_layers,
                          int stage_first, int stage_last, int max_slots);
// The checks of every backend's ExportKv: CheckKvRange, and `positions` within [1, cached] (what
// the slot holds). OK, or INVALID_ARGUMENT naming what is out of range.
absl::Status CheckKvExport(int slot, int positions, int first_layer, int num_layers,
                           int stage_first, int stage_last, int max_slots, int cached);
// The checks of every backend's OpenKvOut: slot `slot` within [0, max_slots) and `positions`
// within [1, max_seq_len]. OK, or INVALID_ARGUMENT naming what is out of range.
absl::Status CheckKvOut(int slot, int positions, int stage_first, int stage_last, int max_slots,
                        int max_seq_len);
// A block table naming the pages of positions [0, positions) on a stage of `num_pages` pages of
// `page_size` positions and a context of `max_seq_len`: at least ceil(positions / page_size)
// pages, no more than ceil(max_seq_len / page_size), each within [0, num_pages) and none twice.
// OK, or INVALID_ARGUMENT naming the page (its index in the table and its id) or the count.
absl::Status CheckBlockTable(std::span<const int32_t> table, int64_t positions, int page_size,
                             int num_pages, int max_seq_len);
// `place` fits the stage's KV-cache for positions [0, positions): on a stage of contiguous slots
// (page_size 0) its table is empty, on a paged one CheckBlockTable holds. OK, or
// INVALID_ARGUMENT beginning with `what` and naming the slot.
absl::Status CheckKvPlace(const char* what, const KvPlace& place, int64_t positions, int page_size,
                          int num_pages, int max_seq_len);
// A block of the given fields, with no bytes anywhere (for device memory, or a header's block).
KvBlock KvBlockOf(DType dtype, int first_layer, int num_layers, int num_kv_heads, int head_dim,
                  int positions);
// The same with its K and V bytes allocated in host memory (zero), for ExportKv to fill.
KvBlock SizedKvBlock(DType dtype, int first_layer, int num_layers, int num_kv_heads, int head_dim,
                     int positions);

// What a stage loads and how much KV-cache it keeps.
struct StageSpec {
  std::filesystem::path model_dir;
  int first_layer = 0;      // inclusive; 0 also loads the embeddings
  int last_layer = -1;      // exclusive; -1 or num_layers also loads final norm + LM head
  int max_slots = 8;        // concurrent sequences
  int max_seq_len = 0;      // 0: the model's max_positions
  // > 0: the KV-cache is a pool of pages of this many positions, shared by the slots through the
  // block tables steps carry; 0: each slot holds max_seq_len contiguous positions.
  int kv_page_size = 0;
  int kv_pages = 0;  // with kv_page_size > 0: pages to hold; 0: as many as the KV memory holds
  // The CPU backend's KV memory: with kv_page_size > 0 and kv_pages 0, the pool takes at most this
  // share of the host memory available after the stage's weights (and no more than max_slots x
  // max_seq_len positions). The CUDA backend's is CudaOptions::kv_memory_fraction.
  double kv_memory_fraction = 0.9;
  bool quantize_fp8 = false;  // --quantization fp8: linear weights to FP8 at load (per row)
  // --kv_cache_dtype fp8 (AssignStageRequest.kv_cache_dtype fp8_e4m3): the KV-cache holds E4M3
  // codes, one byte per element, of each layer's K and V over the layer's scales (LoadKvScales,
  // worker/kv_scales.h; EncodeKvE4M3, common/fp8_quantize.h); its blocks (ExportKv, OpenKvOut) are
  // kF8E4M3 with those scales. Needs kv_page_size > 0. false: the model's dtype.
  bool kv_cache_fp8 = false;
  // Ranks to split the stage over (AssignStageRequest.tensor_parallel), at most the backend's;
  // 0: the backend's own (--tensor_parallel).
  int tensor_parallel = 0;
  // Weights already placed (by an earlier stage or ahead of this one) that the stage may take
  // where they are of this checkpoint, dtype and device; what they lack is loaded.
  std::vector<std::shared_ptr<const PlacedWeights>> placed;
};

}  // namespace tandem
