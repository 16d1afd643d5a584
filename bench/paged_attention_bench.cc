// tandem-paged-attention-bench: the attention kernels over the paged KV-cache (worker/cuda/
// kv_pages.h) against the contiguous cache, alone, at the llama3.1-8b shape (32 heads over 8 kv
// heads, head_dim 128, fp16): decode attention (one query per sequence at the last position, split
// as the CUDA stage splits it) and prefill attention (every position of every sequence), at batch
// 1 and 64 and contexts 512 and 8192, for page sizes 16, 32, 64 and 128 with each sequence's pages
// shuffled over the pool. Prints a markdown table of the median time of each launch and its ratio
// to the contiguous cache's, naming the prefill kernel (wgmma on compute capability 9.0).
//
// usage: tandem-paged-attention-bench [--iters 20] [--prefill=true]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/kernels.h"
#include "worker/cuda/kv_pages.h"
#include "worker/cuda/prefill_attention.h"
#include "worker/cuda/prefill_attention_sm90.h"

ABSL_FLAG(int, iters, 20, "timed launches per measurement (the median is printed)");
ABSL_FLAG(bool, prefill, true, "also time prefill attention");

namespace tandem::cuda {
namespace {

constexpr int kHeads = 32, kKvHeads = 8, kHeadDim = 128;
constexpr DType kType = DType::kF16;

absl::Status Alloc(DeviceBuffer& b, size_t bytes, int fill = 0x3c) {
  RETURN_IF_ERROR(b.Allocate(bytes));
  if (cudaMemset(b.get(), fill, bytes) != cudaSuccess) {
    return absl::InternalError("cudaMemset failed");
  }
  return absl::OkStatus();
}

// Median milliseconds of `iters` timed runs of `launch` after two untimed ones.
template <typename F>
absl::StatusOr<float> TimeMs(F launch, int iters) {
  for (int i = 0; i < 2; ++i) RETURN_IF_ERROR(launch());
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(start);
    const absl::Status s = launch();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    if (!s.ok()) return s;
    float t = 0.0f;
    cudaEventElapsedTime(&t, start, stop);
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (cudaGetLastError() != cudaSuccess) return absl::InternalError("a timed launch failed");
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// A row of the table.
void Print(const char* kernel, int batch, int context, const std::string& layout, float ms,
           float contiguous_ms) {
  std::printf("| %s | %d | %d | %s | %.1f | %.3f |\n", kernel, batch, context, layout.c_str(),
              ms * 1000.0f, ms / contiguous_ms);
}

absl::Status Run(int iters, bool prefill) {
  int device = 0, sms = 0, count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(
        "no usable CUDA device; run the benchmark on a GPU machine (scripts/gpu-check packs it)");
  }
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, device);
  std::printf("%s, %d heads over %d kv heads, head_dim %d, fp16, median of %d launches\n\n",
              prop.name, kHeads, kKvHeads, kHeadDim, iters);
  std::printf("| kernel | batch | context | layout | us | vs contiguous |\n");
  std::printf("|---|---|---|---|---|---|\n");
  const AttentionParams params{1.0f / 11.3137085f, 0};
  for (int context : {512, 8192}) {
    for (int batch : {1, 64}) {
      const size_t cache_elems = size_t(batch) * kKvHeads * context * kHeadDim;
      DeviceBuffer k, v, pool_k, pool_v;
      RETURN_IF_ERROR(Alloc(k, cache_elems * 2));
      RETURN_IF_ERROR(Alloc(v, cache_elems * 2));
      RETURN_IF_ERROR(Alloc(pool_k, cache_elems * 2));
      RETURN_IF_ERROR(Alloc(pool_v, cache_elems * 2));
      std::vector<int32_t> seqs(batch), last(batch, context - 1);
      std::iota(seqs.begin(), seqs.end(), 0);
      DeviceBuffer d_seqs, d_last;
      RETURN_IF_ERROR(d_seqs.Allocate(batch * 4));
      RETURN_IF_ERROR(d_last.Allocate(batch * 4));
      cudaMemcpy(d_seqs.get(), seqs.data(), batch * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(d_last.get(), last.data(), batch * 4, cudaMemcpyHostToDevice);

      // Decode: one row per sequence at its last position.
      DeviceBuffer q, out, partials, counters;
      RETURN_IF_ERROR(Alloc(q, size_t(batch) * kHeads * kHeadDim * 2));
      RETURN_IF_ERROR(Alloc(out, size_t(batch) * kHeads * kHeadDim * 2));
      const int blocks = batch * kKvHeads;
      const int splits = std::max(1, std::min({(2 * sms + blocks - 1) / blocks, 16, context / 64}));
      RETURN_IF_ERROR(
          Alloc(partials, AttentionPartialFloats(batch, kHeads, kHeadDim, splits) * 4, 0));
      RETURN_IF_ERROR(Alloc(counters, size_t(batch) * kKvHeads * 4, 0));
      ASSIGN_OR_RETURN(const float contiguous,
                       TimeMs(
                           [&] {
                             return LaunchAttention(kType, q.get(), k.get(), v.get(),
                                                    d_last.as<int32_t>(), d_seqs.as<int32_t>(),
                                                    partials.as<float>(), out.get(), batch, kHeads,
                                                    kKvHeads, kHeadDim, context, splits, params,
                                                    nullptr, counters.as<uint32_t>());
                           },
                           iters));
      Print("decode", batch, context, absl::StrCat("contiguous, ", splits, " splits"), contiguous,
            contiguous);
      std::vector<KvPages> paged;
      std::vector<DeviceBuffer> tables;
      for (int page_size : {16, 32, 64, 128}) {
        // Each sequence's pages drawn from a shuffle of the whole pool.
        const int per_seq = context / page_size, num_pages = batch * per_seq;
        std::vector<int32_t> table(num_pages);
        std::iota(table.begin(), table.end(), 0);
        std::shuffle(table.begin(), table.end(), std::mt19937(page_size));
        DeviceBuffer d_table;
        RETURN_IF_ERROR(d_table.Allocate(table.size() * 4));
        cudaMemcpy(d_table.get(), table.data(), table.size() * 4, cudaMemcpyHostToDevice);
        paged.push_back(KvPages{pool_k.get(), pool_v.get(), num_pages, page_size,
                                d_table.as<int32_t>(), per_seq});
        tables.push_back(std::move(d_table));
        ASSIGN_OR_RETURN(const float ms, TimeMs(
                                             [&] {
                                               return LaunchAttentionPaged(
                                                   kType, q.get(), paged.back(),
                                                   d_last.as<int32_t>(), d_seqs.as<int32_t>(),
                                                   partials.as<float>(), out.get(), batch, kHeads,
                                                   kKvHeads, kHeadDim, splits, params, nullptr,
                                                   counters.as<uint32_t>());
                                             },
                                             iters));
        Print("decode", batch, context, absl::StrCat("pages of ", page_size), ms, contiguous);
      }
      if (!prefill) continue;

      // Prefill: every position of every sequence.
      const int rows = batch * context;
      std::vector<int32_t> pos(rows), row_seq(rows);
      for (int r = 0; r < rows; ++r) {
        pos[r] = r % context;
        row_seq[r] = r / context;
      }
      DeviceBuffer d_pos, d_row_seq, pq, pout;
      RETURN_IF_ERROR(d_pos.Allocate(size_t(rows) * 4));
      RETURN_IF_ERROR(d_row_seq.Allocate(size_t(rows) * 4));
      cudaMemcpy(d_pos.get(), pos.data(), size_t(rows) * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(d_row_seq.get(), row_seq.data(), size_t(rows) * 4, cudaMemcpyHostToDevice);
      RETURN_IF_ERROR(Alloc(pq, size_t(rows) * kHeads * kHeadDim * 2));
      RETURN_IF_ERROR(Alloc(pout, size_t(rows) * kHeads * kHeadDim * 2));
      const int prefill_iters = std::max(3, iters / 4);
      ASSIGN_OR_RETURN(const float pc, TimeMs(
                                           [&] {
                                             return LaunchPrefillAttention(
                                                 kType, pq.get(), k.get(), v.get(),
                                                 d_pos.as<int32_t>(), d_row_seq.as<int32_t>(),
                                                 pout.get(), rows, kHeads, kKvHeads, kHeadDim,
                                                 context, params, nullptr);
                                           },
                                           prefill_iters));
      const bool sm90 = PrefillAttentionSm90Usable(kHeadDim, pq.get(), k.get(), v.get());
      Print("prefill", batch, context,
            absl::StrCat("contiguous (", sm90 ? "wgmma" : "mma.sync", ")"), pc, pc);
      for (const KvPages& pages : paged) {
        ASSIGN_OR_RETURN(const float ms, TimeMs(
                                             [&] {
                                               return LaunchPrefillAttentionPaged(
                                                   kType, pq.get(), pages, d_pos.as<int32_t>(),
                                                   d_row_seq.as<int32_t>(), pout.get(), rows,
                                                   kHeads, kKvHeads, kHeadDim, params, nullptr);
                                             },
                                             prefill_iters));
        const bool paged_sm90 = pages.page_size >= kMinSm90PageSize &&
                                PrefillAttentionSm90Usable(kHeadDim, pq.get(), pages.k, pages.v);
        Print("prefill", batch, context,
              absl::StrCat("pages of ", pages.page_size, " (", paged_sm90 ? "wgmma" : "mma.sync",
                           ")"),
              ms, pc);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace tandem::cuda

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const absl::Status s =
      tandem::cuda::Run(std::max(1, absl::GetFlag(FLAGS_iters)), absl::GetFlag(FLAGS_prefill));
  if (!s.ok()) {
    std::fprintf(stderr, "tandem-paged-attention-bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
