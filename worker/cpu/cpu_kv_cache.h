// The CPU stage's KV-cache: K and V of every layer of the stage, fp32 or (fp8) E4M3 codes over
// each layer's scales (common/fp8_quantize.h EncodeKvE4M3, one byte per element), in one of two
// layouts:
//   contiguous (page_size 0): [max_slots][layers][max_seq_len][kv_dim]; a slot holds the
//     positions of its sequence;
//   paged (page_size > 0): [layers][num_pages][page_size][kv_dim]; position p of a sequence is
//     row p % page_size of page block_table[p / page_size] (the coordinator's page owner chooses
//     the pages; slots then only name sequences and cost no KV memory).
// Every access names the sequence by its slot and block table (empty in the contiguous layout);
// tables are checked by the stage before they get here (CheckBlockTable). Attention reads K and V
// as floats (Rows: the codes times their scales); moves copy the stored elements as they are.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "worker/kv_scales.h"
#include "worker/stage.h"

namespace tandem {

struct CpuKvLayout {
  int layers = 0;       // of the stage
  int kv_dim = 0;       // num_kv_heads * head_dim
  int max_slots = 0;    // sequences named at once
  int max_seq_len = 0;  // positions per sequence
  int page_size = 0;    // 0: contiguous slots
  int num_pages = 0;    // with page_size > 0
  // With page_size > 0 and num_pages 0: the pool's bytes at most (0: no bound but the host's).
  int64_t budget_bytes = 0;
  bool fp8 = false;  // elements are E4M3 codes over the layers' scales, not fp32
  size_t element_bytes() const { return fp8 ? 1 : sizeof(float); }
};

// The host memory available now (MemAvailable of /proc/meminfo; the free pages where it cannot
// be read).
int64_t HostAvailableBytes();

class CpuKvCache {
 public:
  // The cache of `layout`, its memory left uninitialised (a position is read only after it is
  // written). With page_size > 0 and num_pages 0, as many pages as max_slots x max_seq_len
  // positions take, or as budget_bytes holds if fewer (RESOURCE_EXHAUSTED naming both when it
  // holds no page), at element_bytes() per element: fp8 pages hold 4 times the positions of fp32
  // ones in the same bytes. RESOURCE_EXHAUSTED (or INVALID_ARGUMENT for sizes past 64 bits)
  // naming the sizes when it does not fit the host's memory. With layout.fp8, `scales` holds a
  // pair per layer of the stage (INVALID_ARGUMENT otherwise); without, none.
  static absl::StatusOr<CpuKvCache> Make(CpuKvLayout layout, std::vector<KvScales> scales = {});

  const CpuKvLayout& layout() const { return layout_; }
  bool paged() const { return layout_.page_size > 0; }
  // How the elements are stored: kF32, or kF8E4M3 codes over scales().
  DType dtype() const { return layout_.fp8 ? DType::kF8E4M3 : DType::kF32; }
  // Per layer of the stage with fp8; empty otherwise.
  const std::vector<KvScales>& scales() const { return scales_; }

  // Writes the kv_dim values of K and of V of position `pos` of the sequence at (slot, table),
  // layer `layer` of the stage: as they are, or with fp8 as codes over the layer's scales.
  void Write(int slot, std::span<const int32_t> table, int layer, int pos, const float* k,
             const float* v);
  // K and V of positions [0, n) of a layer as floats, (n, kv_dim) row-major: the cache's own rows
  // where they are contiguous fp32 (a slot), otherwise copies into k_rows and v_rows, gathered
  // page by page and, with fp8, decoded (code times scale).
  std::pair<const float*, const float*> Rows(int slot, std::span<const int32_t> table, int layer,
                                             int n, std::vector<float>& k_rows,
                                             std::vector<float>& v_rows) const;
  // Copies positions [0, n) of a layer out to k, v (n x kv_dim elements as stored: fp32, or
  // codes), or in from them.
  void Gather(int slot, std::span<const int32_t> table, int layer, int n, uint8_t* k,
              uint8_t* v) const;
  void Scatter(int slot, std::span<const int32_t> table, int layer, int n, const uint8_t* k,
               const uint8_t* v);

 private:
  CpuKvCache(CpuKvLayout layout, std::vector<KvScales> scales, std::unique_ptr<std::byte[]> k,
             std::unique_ptr<std::byte[]> v)
      : layout_(layout), scales_(std::move(scales)), k_(std::move(k)), v_(std::move(v)) {}
  // The byte offset of position `pos` of the sequence at (slot, table), layer `layer`.
  size_t Offset(int slot, std::span<const int32_t> table, int layer, int pos) const;
  // Calls f(position, run) for the runs of positions [0, n) that are contiguous in memory: one
  // run of n for a slot, one per page otherwise.
  template <typename F>
  void ForRuns(int n, F&& f) const;

  CpuKvLayout layout_;
  std::vector<KvScales> scales_;
  // Elements of element_bytes() each (fp32 objects, or codes), in the layout's order.
  std::unique_ptr<std::byte[]> k_;
  std::unique_ptr<std::byte[]> v_;
};

}  // namespace tandem
