// Weight upload: arena layout, copy jobs per stored part, and the CUDA side of the staged copy.
#include "worker/cuda/weight_upload.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/weight_convert.h"
#include "worker/staged_copy.h"

namespace tandem::cuda {
namespace {

size_t Aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Where one stored part goes: the arena byte offset of its first element, and how it lands.
struct PartTarget {
  DType from = DType::kF32;
  size_t dst_offset = 0;   // bytes into the arena
  bool transposed = false;
  int64_t in = 0, out = 0;  // stored (in, out) when transposed
};

// Pinned host slots, device staging slots (for parts that convert) and one stream per thread.
class CudaStaging final : public StagingTarget {
 public:
  CudaStaging(const std::vector<PartTarget>& targets, char* arena, DType dtype, int device,
              int threads, int slots_per_thread)
      : targets_(targets), arena_(arena), dtype_(dtype), device_(device),
        slots_per_thread_(slots_per_thread) {
    streams_ = std::make_unique<Stream[]>(threads);
    events_ = std::make_unique<Event[]>(static_cast<size_t>(threads) * slots_per_thread);
    threads_ = threads;
  }

  absl::Status Allocate(size_t slot_bytes, bool convert) {
    slot_bytes_ = slot_bytes;
    const size_t slots = static_cast<size_t>(threads_) * slots_per_thread_;
    RETURN_IF_ERROR(host_.Allocate(slots * slot_bytes));
    if (convert) RETURN_IF_ERROR(staging_.Allocate(slots * slot_bytes));
    for (int t = 0; t < threads_; ++t) RETURN_IF_ERROR(streams_[t].Create());
    for (size_t s = 0; s < slots; ++s) RETURN_IF_ERROR(events_[s].Create());
    return absl::OkStatus();
  }

  absl::Status BeginThread(int) override {
    CUDA_CHECK(cudaSetDevice(device_));
    return absl::OkStatus();
  }

  absl::Status WaitFree(int slot) override {
    CUDA_CHECK(cudaEventSynchronize(events_[slot].get()));
    return absl::OkStatus();
  }

  std::byte* Buffer(int slot) override {
    return host_.as<std::byte>() + static_cast<size_t>(slot) * slot_bytes_;
  }

  absl::Status Submit(int slot, const CopyChunk& chunk) override {
    const PartTarget& t = targets_[chunk.job];
    cudaStream_t stream = streams_[slot / slots_per_thread_].get();
    const size_t from_size = DTypeSize(t.from);
    const int64_t first = static_cast<int64_t>(chunk.offset / from_size);  // element of the part
    const int64_t n = static_cast<int64_t>(chunk.bytes / from_size);
    if (t.from == dtype_ && !t.transposed) {
      CUDA_CHECK(cudaMemcpyAsync(arena_ + t.dst_offset + chunk.offset, Buffer(slot), chunk.bytes,
                                 cudaMemcpyHostToDevice, stream));
    } else {
      void* staged = staging_.as<char>() + static_cast<size_t>(slot) * slot_bytes_;
      CUDA_CHECK(
          cudaMemcpyAsync(staged, Buffer(slot), chunk.bytes, cudaMemcpyHostToDevice, stream));
      char* dst = arena_ + t.dst_offset;
      if (t.transposed) {
        RETURN_IF_ERROR(LaunchConvertTransposed(t.from, dtype_, staged, dst, first / t.out,
                                                n / t.out, t.in, t.out, stream));
      } else {
        RETURN_IF_ERROR(LaunchConvert(t.from, dtype_, staged,
                                      dst + static_cast<size_t>(first) * DTypeSize(dtype_), n,
                                      stream));
      }
    }
    CUDA_CHECK(cudaEventRecord(events_[slot].get(), stream));
    return absl::OkStatus();
  }

  absl::Status Finish() {
    for (int t = 0; t < threads_; ++t) CUDA_CHECK(cudaStreamSynchronize(streams_[t].get()));
    return absl::OkStatus();
  }

 private:
  const std::vector<PartTarget>& targets_;
  char* arena_;
  DType dtype_;
  int device_;
  int threads_ = 0;
  int slots_per_thread_;
  size_t slot_bytes_ = 0;
  PinnedBuffer host_;
  DeviceBuffer staging_;
  std::unique_ptr<Stream[]> streams_;
  std::unique_ptr<Event[]> events_;
};

}  // namespace

absl::StatusOr<DeviceWeights> UploadStageWeights(const StageSources& sources, DType dtype,
                                                 bool share_head, const UploadOptions& options) {
  if (dtype != DType::kF16 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("weights are held as F16 or BF16, not ",
                                                   std::string(DTypeName(dtype))));
  }
  // Layout: each non-empty tensor at the next 256-byte boundary, in ForEachTensor's order.
  DeviceWeights out;
  std::vector<std::pair<const TensorSource*, size_t>> placed;  // source, arena offset
  size_t total = 0;
  const TensorSource* head = share_head ? &sources.lm_head : nullptr;
  std::vector<const void**> pointers;
  ForEachTensor(sources, out.tensors, [&](const TensorSource& src, const void*& dst) {
    dst = nullptr;
    if (src.empty() || &src == head) return;
    placed.emplace_back(&src, total);
    pointers.push_back(&dst);
    total += Aligned(static_cast<size_t>(src.numel()) * DTypeSize(dtype));
  });
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (total > free_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "weights of layers [", sources.first_layer, ", ", sources.last_layer, ") need ", total,
        " bytes of GPU memory; ", free_bytes, " of ", total_bytes, " bytes are free"));
  }
  RETURN_IF_ERROR(out.arena.Allocate(total));
  for (size_t i = 0; i < placed.size(); ++i) {
    *pointers[i] = out.arena.as<char>() + placed[i].second;
  }
  if (share_head) out.tensors.lm_head = out.tensors.tok_embedding;

  // One copy job per stored part; a transposed part is cut only between its stored rows.
  std::vector<CopyJob> jobs;
  std::vector<PartTarget> targets;
  bool convert = false;
  size_t largest_unit = 1;
  for (const auto& [src, offset] : placed) {
    size_t dst = offset;
    for (const TensorView& part : src->parts) {
      const size_t elem = DTypeSize(part.dtype);
      PartTarget t{part.dtype, dst, src->transposed};
      size_t unit = elem;
      if (src->transposed) {
        t.in = part.shape[0];
        t.out = part.shape[1];
        unit = static_cast<size_t>(t.out) * elem;
      }
      convert = convert || src->transposed || part.dtype != dtype;
      largest_unit = std::max(largest_unit, unit);
      jobs.push_back({part.data.data(), part.data.size(), unit});
      targets.push_back(t);
      dst += static_cast<size_t>(part.numel()) * DTypeSize(dtype);
    }
  }
  const size_t slot_bytes = std::max(options.slot_bytes, largest_unit);
  const std::vector<CopyChunk> chunks = SplitIntoChunks(jobs, slot_bytes);
  if (chunks.empty()) return out;
  const int threads =
      std::max(1, std::min<int>(options.threads, static_cast<int>(chunks.size())));
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CudaStaging staging(targets, out.arena.as<char>(), dtype, device, threads,
                      std::max(1, options.slots_per_thread));
  RETURN_IF_ERROR(staging.Allocate(slot_bytes, convert));
  const absl::Status copied =
      StagedCopy(jobs, chunks, threads, std::max(1, options.slots_per_thread), staging);
  // Drained even after an error: the staging buffers must outlive every queued copy.
  const absl::Status drained = staging.Finish();
  RETURN_IF_ERROR(copied);
  RETURN_IF_ERROR(drained);
  return out;
}

}  // namespace tandem::cuda
