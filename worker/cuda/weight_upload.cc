// Weight upload: arena layout, copy jobs per stored part, and the CUDA side of the staged copy.
#include "worker/cuda/weight_upload.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/weight_convert.h"
#include "worker/fp8_weights.h"
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

namespace {

// One FP8 linear weight: its source, and where its codes and scales go in the arena.
struct Fp8Target {
  const TensorSource* src;
  int64_t cols;
  size_t codes_offset, scales_offset;
};

// Quantizes (or takes the stored codes of) each FP8 target on the host, several tensors at a
// time, and copies codes and scales into the arena.
absl::Status UploadFp8(const std::vector<Fp8Target>& targets, char* arena) {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  const size_t threads = std::min<size_t>(
      targets.size(), std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
  std::atomic<size_t> next{0};
  std::vector<absl::Status> status(threads);
  auto work = [&](size_t me) {
    if (cudaSetDevice(device) != cudaSuccess) {
      status[me] = absl::InternalError("cudaSetDevice failed in an FP8 upload thread");
      return;
    }
    for (size_t i = next++; i < targets.size() && status[me].ok(); i = next++) {
      const Fp8Target& t = targets[i];
      absl::StatusOr<Fp8Rows> q = SourceToFp8Rows(*t.src, t.cols);
      if (!q.ok()) {
        status[me] = q.status();
        return;
      }
      if (cudaMemcpy(arena + t.codes_offset, q->codes.data(), q->codes.size(),
                     cudaMemcpyHostToDevice) != cudaSuccess ||
          cudaMemcpy(arena + t.scales_offset, q->scales.data(), q->scales.size() * sizeof(float),
                     cudaMemcpyHostToDevice) != cudaSuccess) {
        status[me] = absl::InternalError(absl::StrCat("copying FP8 weight '",
                                                      t.src->parts[0].name, "' to the device"));
      }
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work, t);
  if (threads > 0) work(0);
  for (std::thread& th : pool) th.join();
  for (const absl::Status& s : status) RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DeviceWeights> UploadStageWeights(const StageSources& sources, DType dtype,
                                                 bool share_head, const UploadOptions& options,
                                                 bool fp8) {
  if (dtype != DType::kF16 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("weights are held as F16 or BF16, not ",
                                                   std::string(DTypeName(dtype))));
  }
  // Layout: each non-empty tensor at the next 256-byte boundary, in ForEachTensor's order; an FP8
  // linear weight as its codes, then its scales.
  DeviceWeights out;
  std::set<const TensorSource*> linear;
  ForEachLinearWeight(sources, sources, [&](const TensorSource& src, const TensorSource&) {
    if (!src.empty()) linear.insert(&src);
  });
  std::vector<std::pair<const TensorSource*, size_t>> placed;  // source, arena offset
  std::vector<Fp8Target> fp8_targets;
  size_t total = 0;
  const TensorSource* head = share_head ? &sources.lm_head : nullptr;
  std::vector<const void**> pointers;
  std::vector<std::pair<const void**, size_t>> fp8_pointers;  // codes, then scales
  absl::Status layout;
  ForEachTensor(sources, out.tensors, [&](const TensorSource& src, const void*& dst) {
    dst = nullptr;
    if (src.empty() || &src == head) return;
    if (src.fp8() && !fp8 && layout.ok()) {
      layout = absl::InvalidArgumentError(absl::StrCat(
          "tensor '", src.parts[0].name, "' is FP8: the stage must hold FP8 weights"));
    }
    if (fp8 && linear.count(&src) > 0) {
      // Engine layout (out, in): `in` from the first part, stored (out, in) or (in, out).
      const int64_t cols = src.transposed ? src.parts[0].shape[0] : src.parts[0].shape[1];
      const int64_t rows = src.numel() / cols;
      if (cols % 8 != 0) {
        layout = absl::InvalidArgumentError(absl::StrCat(
            "FP8 weights need an input width that is a multiple of 8; '", src.parts[0].name,
            "' has ", cols));
      }
      const size_t codes = total;
      total += Aligned(static_cast<size_t>(src.numel()));
      fp8_targets.push_back({&src, cols, codes, total});
      fp8_pointers.emplace_back(&dst, codes);
      total += Aligned(static_cast<size_t>(rows) * sizeof(float));
      return;
    }
    placed.emplace_back(&src, total);
    pointers.push_back(&dst);
    total += Aligned(static_cast<size_t>(src.numel()) * DTypeSize(dtype));
  });
  RETURN_IF_ERROR(layout);
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
  for (const auto& [dst, offset] : fp8_pointers) *dst = out.arena.as<char>() + offset;
  // Each FP8 weight's scales pointer, in the same field of `scales`.
  ForEachTensor(out.tensors, out.scales, [&](const void* const& codes, const float*& scales) {
    scales = nullptr;
    for (const Fp8Target& t : fp8_targets) {
      if (codes == out.arena.as<char>() + t.codes_offset) {
        scales = reinterpret_cast<const float*>(out.arena.as<char>() + t.scales_offset);
      }
    }
  });
  RETURN_IF_ERROR(UploadFp8(fp8_targets, out.arena.as<char>()));

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
