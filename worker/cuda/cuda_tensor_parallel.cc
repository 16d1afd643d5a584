// The CUDA stage over tensor-parallel GPUs (cuda_tensor_parallel.h).
//
// Threads and devices: the caller of Step runs rank 0, ranks 1 .. N-1 run on threads of their own
// (worker/rank_threads.h); every rank's work sets its own device (CudaStage does). The ranks load
// on their threads at once, as their steps run, and meet only in the all-reduces. One NCCL
// communicator per rank, made together in-process (ncclCommInitAll) before any stage captures
// its decode graphs, so that the graphs hold the all-reduce as a node.
#include "worker/cuda/cuda_tensor_parallel.h"

#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_stage_impl.h"
#include "worker/cuda/peer_all_reduce.h"
#include "worker/rank_threads.h"
#include "worker/tensor_parallel.h"

namespace tandem {
namespace {

// Rows of the hidden state up to which the all-reduce goes over peer memory (decode batches);
// NCCL's ring takes larger messages (prompt chunks).
constexpr size_t kPeerAllReduceRows = 256;

absl::Status NcclError(ncclResult_t r, const char* what) {
  return absl::InternalError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

// One communicator per rank, destroyed with the group.
class Comms {
 public:
  ~Comms() {
    for (ncclComm_t c : comms_) ncclCommDestroy(c);
  }
  absl::Status Init(int first_device, int ranks) {
    // NVLink SHARP (NVLS) multicast objects are not wanted by this all-reduce of small messages;
    // connections made at init, not at a collective's first launch (which may be inside a graph
    // capture).
    setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
    setenv("NCCL_RUNTIME_CONNECT", "0", /*overwrite=*/0);
    std::vector<int> devices(ranks);
    std::iota(devices.begin(), devices.end(), first_device);
    comms_.resize(ranks);
    const ncclResult_t r = ncclCommInitAll(comms_.data(), ranks, devices.data());
    if (r != ncclSuccess) {
      comms_.clear();
      return NcclError(r, "ncclCommInitAll over the tensor-parallel GPUs");
    }
    return WarmUp(first_device);
  }
  ncclComm_t operator[](int rank) const { return comms_[rank]; }
  // The one-shot all-reduce over peer memory where every pair of the GPUs has peer access and
  // TANDEM_ALL_REDUCE is not "nccl"; null otherwise (NCCL for every message).
  const cuda::PeerAllReduce* peer() const { return peer_.get(); }
  absl::Status InitPeer(int first_device, int ranks, size_t max_elements) {
    const char* choice = std::getenv("TANDEM_ALL_REDUCE");
    if (choice != nullptr && std::string(choice) == "nccl") return absl::OkStatus();
    absl::StatusOr<std::unique_ptr<cuda::PeerAllReduce>> p =
        cuda::PeerAllReduce::Create(first_device, ranks, max_elements);
    if (p.ok()) {
      peer_ = *std::move(p);
    } else if (choice != nullptr && std::string(choice) == "peer") {
      return p.status();  // asked for, not available
    }
    return absl::OkStatus();
  }

 private:
  // One all-reduce over every rank, from this thread as a group, waited for: NCCL works between
  // the GPUs before any stage loads (an error here, not a hang in a later step).
  absl::Status WarmUp(int first_device) {
    const int ranks = static_cast<int>(comms_.size());
    std::vector<cuda::DeviceBuffer> bufs(ranks);
    for (int r = 0; r < ranks; ++r) {
      CUDA_CHECK(cudaSetDevice(first_device + r));
      RETURN_IF_ERROR(bufs[r].Allocate(4096));
      CUDA_CHECK(cudaMemset(bufs[r].get(), 0, 4096));
    }
    ncclResult_t res = ncclGroupStart();
    for (int r = 0; r < ranks && res == ncclSuccess; ++r) {
      CUDA_CHECK(cudaSetDevice(first_device + r));
      res = ncclAllReduce(bufs[r].get(), bufs[r].get(), 1024, ncclFloat, ncclSum, comms_[r],
                          cudaStreamLegacy);
    }
    const ncclResult_t end = ncclGroupEnd();
    if (res != ncclSuccess) return NcclError(res, "the first all-reduce over the GPUs");
    if (end != ncclSuccess) return NcclError(end, "the first all-reduce over the GPUs");
    for (int r = 0; r < ranks; ++r) {
      CUDA_CHECK(cudaSetDevice(first_device + r));
      CUDA_CHECK(cudaDeviceSynchronize());
    }
    for (int r = 0; r < ranks; ++r) {
      CUDA_CHECK(cudaSetDevice(first_device + r));
      bufs[r].Reset();
    }
    return absl::OkStatus();
  }

  std::vector<ncclComm_t> comms_;
  std::unique_ptr<cuda::PeerAllReduce> peer_;
};

// A tensor's fp32 host values as a source UploadStageWeights takes (empty stays empty).
TensorSource HostSource(const std::vector<float>& v) {
  TensorSource s;
  if (v.empty()) return s;
  TensorView t;
  t.dtype = DType::kF32;
  t.shape = {static_cast<int64_t>(v.size())};
  t.data = std::as_bytes(std::span<const float>(v));
  s.parts.push_back(std::move(t));
  return s;
}

// Rank r's weights as sources over host memory that must outlive them: the layers of `shard`
// (which holds nothing else), the replicated tensors of the whole stage.
StageSources RankSources(const StageWeights& whole, const StageWeights& shard) {
  auto host = [](const std::vector<float>& from, TensorSource& to) { to = HostSource(from); };
  StageSources s;
  ForEachTensor(whole, s, host);
  StageSources shard_sources;
  ForEachTensor(shard, shard_sources, host);
  s.layers = std::move(shard_sources.layers);
  return s;
}

// The sources of `spec`'s layers where the cuda ranks can split them over `ranks`: the heads and
// widths divide (CheckTensorParallel), 16-bit weights, no bias on a row-parallel projection.
absl::StatusOr<StageSources> SplittableSources(Checkpoint& ckpt, const StageSpec& spec,
                                               int ranks) {
  const ModelConfig& c = ckpt.config();
  RETURN_IF_ERROR(CheckTensorParallel(c, ranks));
  if (spec.quantize_fp8 || c.quantization.fp8()) {
    return absl::InvalidArgumentError(
        "tensor parallelism on the cuda backend takes fp16/bf16 weights, not FP8 (drop "
        "--quantization fp8, or use --tensor_parallel 1)");
  }
  const int last = spec.last_layer == -1 ? c.num_layers : spec.last_layer;
  if (spec.first_layer < 0 || spec.first_layer >= last || last > c.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layers [", spec.first_layer, ", ", last,
                                                   ") of a model of ", c.num_layers));
  }
  ASSIGN_OR_RETURN(StageSources sources, FindStageWeights(ckpt, spec.first_layer, last));
  for (const LayerWeightsOf<TensorSource>& l : sources.layers) {
    if (!l.bo.empty() || !l.b_out.empty()) {
      return absl::InvalidArgumentError(
          "tensor parallelism on the cuda backend does not take biases on the attention output "
          "or the MLP down projection (GPT-2, attention_bias); use --backend cpu or "
          "--tensor_parallel 1");
    }
  }
  return sources;
}

// Rank r's sum of a row-parallel output over the ranks, in place on the rank's stream: over peer
// memory up to its size (decode's few rows), by NCCL above it (prompts).
std::function<absl::Status(void*, int, cudaStream_t)> AllReduceOf(const Comms& comms, int rank,
                                                                  DType dtype, int hidden) {
  const ncclComm_t comm = comms[rank];
  const cuda::PeerAllReduce* peer = comms.peer();
  const ncclDataType_t type = dtype == DType::kBF16 ? ncclBfloat16 : ncclFloat16;
  return [comm, peer, rank, dtype, type, hidden](void* x, int rows, cudaStream_t stream) {
    const size_t n = static_cast<size_t>(rows) * hidden;
    if (peer != nullptr && n <= peer->max_elements()) return peer->Run(rank, x, n, dtype, stream);
    const ncclResult_t res = ncclAllReduce(x, x, n, type, ncclSum, comm, stream);
    return res == ncclSuccess ? absl::OkStatus() : NcclError(res, "ncclAllReduce");
  };
}

// Rank r's part of gathering the split LM head's logits: every rank's `count` floats, rank q's at
// parts + q * count, in place on the rank's stream.
std::function<absl::Status(float*, size_t, cudaStream_t)> GatherOf(const Comms& comms, int rank) {
  const ncclComm_t comm = comms[rank];
  return [comm, rank](float* parts, size_t count, cudaStream_t stream) {
    const ncclResult_t res =
        ncclAllGather(parts + rank * count, parts, count, ncclFloat32, comm, stream);
    return res == ncclSuccess ? absl::OkStatus() : NcclError(res, "ncclAllGather of the logits");
  };
}

// Every rank's stage, loaded at once, each on its thread and device (a decode graph's capture is
// local to its thread). On an error the loaded ones are freed on their devices.
absl::StatusOr<std::vector<std::unique_ptr<Stage>>> LoadRanks(
    const StageSpec& spec, const CudaOptions& options, const ModelConfig& rank_config,
    const std::vector<StageSources>& rank_sources, const Comms& comms, int head_rows) {
  const int ranks = static_cast<int>(rank_sources.size());
  std::vector<std::unique_ptr<Stage>> stages(ranks);
  std::vector<absl::Status> loaded(ranks);
  {
    RankThreads load(ranks);
    load.Run([&](int r) {
      CudaOptions o = options;
      o.device = options.device + r;
      CudaRank rank{
          r,     &rank_sources[r], AllReduceOf(comms, r, options.dtype, rank_config.hidden_size),
          ranks, head_rows,        head_rows > 0 ? GatherOf(comms, r) : nullptr};
      auto stage = std::make_unique<CudaStage>(rank_config, o, std::move(rank));
      loaded[r] = stage->Load(spec);
      stages[r] = std::move(stage);
    });
  }
  for (int r = 0; r < ranks; ++r) {
    if (loaded[r].ok()) continue;
    for (int q = 0; q < ranks; ++q) {
      cudaSetDevice(options.device + q);
      stages[q].reset();
    }
    return absl::Status(loaded[r].code(), absl::StrCat("tensor-parallel rank ", r, " (device ",
                                                       options.device + r, "): ",
                                                       loaded[r].message()));
  }
  return stages;
}

class CudaTensorParallelStage final : public Stage {
 public:
  CudaTensorParallelStage(std::unique_ptr<Comms> comms, std::vector<std::unique_ptr<Stage>> ranks,
                          ModelConfig config, int first_device)
      : first_device_(first_device),
        comms_(std::move(comms)),
        ranks_(std::move(ranks)),
        config_(std::move(config)),
        threads_(static_cast<int>(ranks_.size())) {}

  ~CudaTensorParallelStage() override {
    // Each rank's stage waits for its stream and frees its memory on its own device.
    threads_.Run([&](int r) {
      cudaSetDevice(first_device_ + r);
      ranks_[r].reset();
    });
  }

  const ModelConfig& config() const override { return config_; }
  // Every rank holds the same positions of its own K/V heads: the pages of the smallest pool.
  int kv_pages() const override {
    int pages = ranks_[0]->kv_pages();
    for (const auto& r : ranks_) pages = std::min(pages, r->kv_pages());
    return pages;
  }

  // A sequence's KV-cache of every K/V head in host memory (each rank's heads side by side), and
  // a host block from anywhere giving each rank its heads (tensor_parallel.h). The ranks' stages
  // set their own devices; the caller's is set back.
  absl::StatusOr<KvBlock> ExportKv(const KvPlace& place, int positions, int first_layer,
                                   int num_layers) const override {
    const CallersDevice keep;
    return ExportSplitKv(config_, ranks_, place, positions, first_layer, num_layers);
  }
  absl::Status ImportKv(const KvPlace& place, const KvBlock& block) override {
    const CallersDevice keep;
    return ImportSplitKv(config_, ranks_, place, block);
  }

  // Every rank validates the same step against the same state, so they accept or refuse it
  // together, before any reaches an all-reduce.
  // Input still arriving from the previous stage is awaited here, once, before any rank reads it
  // (each rank copies it from the device it landed on).
  absl::StatusOr<StepOutput> Step(const StepDescriptor& step, const Activations& in) override {
    Activations arrived = in;
    if (in.arrival) {
      RETURN_IF_ERROR(in.arrival().status());
      arrived.arrival = nullptr;
    }
    std::vector<absl::StatusOr<StepOutput>> outs(ranks_.size());
    threads_.Run([&](int r) { outs[r] = ranks_[r]->Step(step, arrived); });
    for (size_t r = 1; r < outs.size(); ++r) {
      if (!outs[r].ok()) return RankError(r, outs[r].status());
    }
    return std::move(outs[0]);
  }

  // Decode steps launched ahead on every rank: each rank queues the step on its own stream (its
  // graph's all-reduces meet the other ranks' on the devices) and returns; rank 0's tokens are
  // the step's. The ranks check a launch against the same state, so they take or refuse it
  // together.
  bool LaunchOverlaps() const override { return ranks_[0]->LaunchOverlaps(); }
  bool CanLaunchDecode(const StepDescriptor& step) const override {
    return std::all_of(ranks_.begin(), ranks_.end(),
                       [&](const auto& r) { return r->CanLaunchDecode(step); });
  }
  absl::Status LaunchDecode(const StepDescriptor& step,
                            std::span<const int> from_previous) override {
    std::vector<absl::Status> launched(ranks_.size());
    threads_.Run([&](int r) { launched[r] = ranks_[r]->LaunchDecode(step, from_previous); });
    for (size_t r = 0; r < launched.size(); ++r) {
      if (!launched[r].ok()) return r == 0 ? launched[0] : RankError(r, launched[r]);
    }
    return absl::OkStatus();
  }
  bool DecodeDone() const override {
    return std::all_of(ranks_.begin(), ranks_.end(), [](const auto& r) { return r->DecodeDone(); });
  }
  absl::StatusOr<StepOutput> FinishDecode() override {
    std::vector<absl::StatusOr<StepOutput>> outs(ranks_.size());
    threads_.Run([&](int r) { outs[r] = ranks_[r]->FinishDecode(); });
    for (size_t r = 1; r < outs.size(); ++r) {
      if (!outs[r].ok()) return RankError(r, outs[r].status());
    }
    return std::move(outs[0]);
  }
  int launched_decodes() const override { return ranks_[0]->launched_decodes(); }

  absl::StatusOr<Activations> ToHost(const Activations& a) const override {
    return ranks_[0]->ToHost(a);
  }
  absl::StatusOr<void*> DeviceStream() const override { return ranks_[0]->DeviceStream(); }
  absl::StatusOr<int> DecodeGraphCount() const override { return ranks_[0]->DecodeGraphCount(); }

 private:
  // The calling thread's current device, set back when this goes out of scope.
  class CallersDevice {
   public:
    CallersDevice() { cudaGetDevice(&device_); }
    ~CallersDevice() { cudaSetDevice(device_); }

   private:
    int device_ = 0;
  };

  const int first_device_;
  std::unique_ptr<Comms> comms_;  // outlives the stages, whose graphs use it
  std::vector<std::unique_ptr<Stage>> ranks_;
  const ModelConfig config_;  // the whole model's
  RankThreads threads_;
};

}  // namespace

absl::Status CheckTensorParallelDevices(int first_device, int ranks) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    count = 0;
  }
  if (first_device + ranks > count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--tensor_parallel ", ranks, " from --gpu ", first_device, " needs CUDA devices ",
        first_device, "..", first_device + ranks - 1, " but this host has ", count,
        " (use fewer ranks, or a lower --gpu)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Stage>> MakeCudaTensorParallelStage(const StageSpec& spec,
                                                                   const CudaOptions& options,
                                                                   int ranks) {
  if (ranks == 1) return MakeCudaStage(spec, options);
  ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(spec.model_dir));
  const ModelConfig& c = ckpt->config();
  ASSIGN_OR_RETURN(StageSources sources, SplittableSources(*ckpt, spec, ranks));
  RETURN_IF_ERROR(CheckTensorParallelDevices(options.device, ranks));
  const StageWeights whole = ReadStageWeights(sources);
  // Each rank's shard of the layers on the host, and its sources over them.
  std::vector<StageWeights> shards(ranks);  // the layers alone
  std::vector<StageSources> rank_sources;
  for (int r = 0; r < ranks; ++r) {
    for (const LayerWeights& l : whole.layers) {
      shards[r].layers.push_back(ShardLayer(c, l, r, ranks));
    }
    rank_sources.push_back(RankSources(whole, shards[r]));
  }
  // The LM head split by vocabulary: each rank reads head_rows rows of it a step instead of all
  // (the last rank's padded with zeros to head_rows; their logits are dropped). Not where it is
  // the tied embedding, which every rank needs whole.
  const int hidden = c.hidden_size;
  const int head_rows =
      whole.lm_head.empty() || c.tie_word_embeddings ? 0 : (c.vocab_size + ranks - 1) / ranks;
  std::vector<std::vector<float>> head_shards(ranks);
  for (int r = 0; r < ranks && head_rows > 0; ++r) {
    const size_t begin = static_cast<size_t>(r) * head_rows * hidden;
    const size_t end =
        std::min(whole.lm_head.size(), begin + static_cast<size_t>(head_rows) * hidden);
    head_shards[r].assign(static_cast<size_t>(head_rows) * hidden, 0.0f);
    if (begin < end) {
      std::copy(whole.lm_head.begin() + begin, whole.lm_head.begin() + end, head_shards[r].begin());
    }
    rank_sources[r].lm_head = HostSource(head_shards[r]);
  }
  auto comms = std::make_unique<Comms>();
  RETURN_IF_ERROR(comms->Init(options.device, ranks));
  RETURN_IF_ERROR(comms->InitPeer(options.device, ranks, kPeerAllReduceRows * c.hidden_size));
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Stage>> stages,
                   LoadRanks(spec, options, RankConfig(c, ranks), rank_sources, *comms, head_rows));
  return std::make_unique<CudaTensorParallelStage>(std::move(comms), std::move(stages), c,
                                                   options.device);
}

}  // namespace tandem
