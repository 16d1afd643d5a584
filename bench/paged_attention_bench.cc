// tandem-paged-attention-bench: the attention kernels over the paged KV-cache (worker/cuda/
// kv_pages.h) against the contiguous cache, alone, at the llama3.1-8b shape (32 heads over 8 kv
// heads, head_dim 128, fp16): decode attention (one query per sequence at the last position, split
// as the CUDA stage splits it) and prefill attention (every position of every sequence), at batch
// 1 and 64 and contexts 512, 2048 and 8192, for page sizes 16, 32, 64 and 128 with each
// sequence's pages shuffled over the pool. Prints a markdown table of the median time of each
// launch, the K and V read per second and its ratio to the contiguous cache's, naming the prefill
// kernel (wgmma on compute capability 9.0).
//
// usage: tandem-paged-attention-bench [--iters 20] [--prefill=true] [--heads 32 --kv_heads 8
//        --head_dim 128] [--dtype f16] [--contexts 512,2048,8192] [--batches 1,64]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/flags_usage.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/kernels.h"
#include "worker/cuda/kv_pages.h"
#include "worker/cuda/prefill_attention.h"
#include "worker/cuda/prefill_attention_sm90.h"

ABSL_FLAG(int, iters, 20, "timed launches per measurement (the median is printed)");
ABSL_FLAG(bool, prefill, true, "also time prefill attention");
ABSL_FLAG(int, heads, 32, "query heads (32: the 8B shape; openllama-3b: 32)");
ABSL_FLAG(int, kv_heads, 8, "kv heads (8: the 8B shape; openllama-3b: 32)");
ABSL_FLAG(int, head_dim, 128, "head size (128: the 8B shape; openllama-3b: 100)");
ABSL_FLAG(std::string, dtype, "f16", "f16 or bf16");
ABSL_FLAG(std::vector<std::string>, contexts, std::vector<std::string>({"512", "2048", "8192"}),
          "contexts (positions per sequence)");
ABSL_FLAG(std::vector<std::string>, batches, std::vector<std::string>({"1", "64"}),
          "batches (sequences)");

namespace tandem::cuda {
namespace {

// The attention shape and dtype the flags name.
struct Shape {
  int heads = 32, kv_heads = 8, head_dim = 128;
  DType type = DType::kF16;
};
Shape shape;

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

// A row of the table; the K and V of the batch's contexts over the time, as read bandwidth.
// element_bytes: 2, or 1 for FP8 codes.
void Print(const char* kernel, int batch, int context, const std::string& layout, float ms,
           float contiguous_ms, int element_bytes = 2) {
  const double bytes = 2.0 * batch * shape.kv_heads * context * shape.head_dim * element_bytes;
  std::printf("| %s | %d | %d | %s | %.1f | %.0f | %.3f |\n", kernel, batch, context,
              layout.c_str(), ms * 1000.0f, bytes / (ms * 1e-3) / 1e9, ms / contiguous_ms);
}

absl::Status Run(int iters, bool prefill, const std::vector<int>& contexts,
                 const std::vector<int>& batches) {
  int device = 0, sms = 0, count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(
        "no usable CUDA device; run the benchmark on a GPU machine (scripts/gpu-check packs it)");
  }
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, device);
  std::printf("%s, %d heads over %d kv heads, head_dim %d, %s, median of %d launches\n\n",
              prop.name, shape.heads, shape.kv_heads, shape.head_dim,
              shape.type == DType::kF16 ? "fp16" : "bf16", iters);
  std::printf("| kernel | batch | context | layout | us | K+V GB/s | vs contiguous |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  const AttentionParams params{1.0f / std::sqrt(static_cast<float>(shape.head_dim)), 0};
  for (int context : contexts) {
    for (int batch : batches) {
      const size_t cache_elems = size_t(batch) * shape.kv_heads * context * shape.head_dim;
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
      RETURN_IF_ERROR(Alloc(q, size_t(batch) * shape.heads * shape.head_dim * 2));
      RETURN_IF_ERROR(Alloc(out, size_t(batch) * shape.heads * shape.head_dim * 2));
      const int splits = AttentionSplits(batch, shape.kv_heads, context, sms);
      RETURN_IF_ERROR(Alloc(
          partials, AttentionPartialFloats(batch, shape.heads, shape.head_dim, splits) * 4, 0));
      RETURN_IF_ERROR(Alloc(counters, size_t(batch) * shape.kv_heads * 4, 0));
      ASSIGN_OR_RETURN(const float contiguous,
                       TimeMs(
                           [&] {
                             return LaunchAttention(
                                 shape.type, q.get(), k.get(), v.get(), d_last.as<int32_t>(),
                                 d_seqs.as<int32_t>(), partials.as<float>(), out.get(), batch,
                                 shape.heads, shape.kv_heads, shape.head_dim, context, splits,
                                 params, nullptr, counters.as<uint32_t>());
                           },
                           iters));
      Print("decode", batch, context, absl::StrCat("contiguous, ", splits, " splits"), contiguous,
            contiguous);
      std::vector<KvPages> paged;
      std::vector<DeviceBuffer> tables;
      KvPages fp8_prefill;  // pages of 16 as FP8 codes
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
        ASSIGN_OR_RETURN(const float ms,
                         TimeMs(
                             [&] {
                               return LaunchAttentionPaged(
                                   shape.type, q.get(), paged.back(), d_last.as<int32_t>(),
                                   d_seqs.as<int32_t>(), partials.as<float>(), out.get(), batch,
                                   shape.heads, shape.kv_heads, shape.head_dim, splits, params,
                                   nullptr, counters.as<uint32_t>());
                             },
                             iters));
        Print("decode", batch, context, absl::StrCat("pages of ", page_size), ms, contiguous);
        // The same pages as FP8 codes (KvPages::fp8): half the bytes (0x3c codes: 1.5).
        KvPages codes = paged.back();
        codes.fp8 = true;
        ASSIGN_OR_RETURN(const float fp8_ms,
                         TimeMs(
                             [&] {
                               return LaunchAttentionPaged(
                                   shape.type, q.get(), codes, d_last.as<int32_t>(),
                                   d_seqs.as<int32_t>(), partials.as<float>(), out.get(), batch,
                                   shape.heads, shape.kv_heads, shape.head_dim, splits, params,
                                   nullptr, counters.as<uint32_t>());
                             },
                             iters));
        Print("decode", batch, context, absl::StrCat("FP8 pages of ", page_size), fp8_ms,
              contiguous, 1);
        if (prefill && page_size == 16) {
          fp8_prefill = codes;
        }
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
      RETURN_IF_ERROR(Alloc(pq, size_t(rows) * shape.heads * shape.head_dim * 2));
      RETURN_IF_ERROR(Alloc(pout, size_t(rows) * shape.heads * shape.head_dim * 2));
      const int prefill_iters = std::max(3, iters / 4);
      ASSIGN_OR_RETURN(const float pc, TimeMs(
                                           [&] {
                                             return LaunchPrefillAttention(
                                                 shape.type, pq.get(), k.get(), v.get(),
                                                 d_pos.as<int32_t>(), d_row_seq.as<int32_t>(),
                                                 pout.get(), rows, shape.heads, shape.kv_heads,
                                                 shape.head_dim, context, params, nullptr);
                                           },
                                           prefill_iters));
      const bool sm90 = PrefillAttentionSm90Usable(shape.head_dim, pq.get(), k.get(), v.get());
      Print("prefill", batch, context,
            absl::StrCat("contiguous (", sm90 ? "wgmma" : "mma.sync", ")"), pc, pc);
      for (const KvPages& pages : paged) {
        ASSIGN_OR_RETURN(const float ms, TimeMs(
                                             [&] {
                                               return LaunchPrefillAttentionPaged(
                                                   shape.type, pq.get(), pages, d_pos.as<int32_t>(),
                                                   d_row_seq.as<int32_t>(), pout.get(), rows,
                                                   shape.heads, shape.kv_heads, shape.head_dim,
                                                   params, nullptr);
                                             },
                                             prefill_iters));
        const bool paged_sm90 =
            pages.page_size >= kMinSm90PageSize &&
            PrefillAttentionSm90Usable(shape.head_dim, pq.get(), pages.k, pages.v);
        Print("prefill", batch, context,
              absl::StrCat("pages of ", pages.page_size, " (", paged_sm90 ? "wgmma" : "mma.sync",
                           ")"),
              ms, pc);
      }
      ASSIGN_OR_RETURN(const float fp8_ms, TimeMs(
                                               [&] {
                                                 return LaunchPrefillAttentionPaged(
                                                     shape.type, pq.get(), fp8_prefill,
                                                     d_pos.as<int32_t>(), d_row_seq.as<int32_t>(),
                                                     pout.get(), rows, shape.heads, shape.kv_heads,
                                                     shape.head_dim, params, nullptr);
                                               },
                                               prefill_iters));
      Print("prefill", batch, context, "FP8 pages of 16 (mma.sync)", fp8_ms, pc, 1);
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace tandem::cuda

// The positive integers of a list flag, or an empty list where one is not.
std::vector<int> Positive(const std::vector<std::string>& items) {
  std::vector<int> out;
  for (const std::string& item : items) {
    int v = 0;
    if (!absl::SimpleAtoi(item, &v) || v < 1) return {};
    out.push_back(v);
  }
  return out;
}

int main(int argc, char** argv) {
  tandem::SetProgramUsage(
      "tandem-paged-attention-bench [--contexts 512,2048,8192] [--batches 1,64] [--heads 32] "
      "[--kv_heads 8] [--head_dim 128] [--dtype f16|bf16] [--prefill=true] [--iters 20]");
  tandem::ParseFlags(argc, argv);
  tandem::cuda::shape = {
      absl::GetFlag(FLAGS_heads), absl::GetFlag(FLAGS_kv_heads), absl::GetFlag(FLAGS_head_dim),
      absl::GetFlag(FLAGS_dtype) == "bf16" ? tandem::DType::kBF16 : tandem::DType::kF16};
  const std::vector<int> contexts = Positive(absl::GetFlag(FLAGS_contexts));
  const std::vector<int> batches = Positive(absl::GetFlag(FLAGS_batches));
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (contexts.empty() || batches.empty() || (dtype != "f16" && dtype != "bf16")) {
    std::fprintf(stderr,
                 "tandem-paged-attention-bench: --contexts and --batches take positive integers, "
                 "--dtype f16 or bf16\n");
    return 2;
  }
  const absl::Status s = tandem::cuda::Run(std::max(1, absl::GetFlag(FLAGS_iters)),
                                           absl::GetFlag(FLAGS_prefill), contexts, batches);
  if (!s.ok()) {
    std::fprintf(stderr, "tandem-paged-attention-bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
