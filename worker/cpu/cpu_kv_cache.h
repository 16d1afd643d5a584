// The CPU stage's KV-cache: K and V (fp32) of every layer of the stage, in one of two layouts:
//   contiguous (page_size 0): [max_slots][layers][max_seq_len][kv_dim]; a slot holds the
//     positions of its sequence;
//   paged (page_size > 0): [layers][num_pages][page_size][kv_dim]; position p of a sequence is
//     row p % page_size of page block_table[p / page_size] (the coordinator's page owner chooses
//     the pages; slots then only name sequences and cost no KV memory).
// Every access names the sequence by its slot and block table (empty in the contiguous layout);
// tables are checked by the stage before they get here (CheckBlockTable).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
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
};

// The host memory available now (MemAvailable of /proc/meminfo; the free pages where it cannot
// be read).
int64_t HostAvailableBytes();

class CpuKvCache {
 public:
  // The cache of `layout`, its memory left uninitialised (a position is read only after it is
  // written). With page_size > 0 and num_pages 0, as many pages as max_slots x max_seq_len
  // positions take, or as budget_bytes holds if fewer (RESOURCE_EXHAUSTED naming both when it
  // holds no page). RESOURCE_EXHAUSTED (or INVALID_ARGUMENT for sizes past 64 bits) naming the
  // sizes when it does not fit the host's memory.
  static absl::StatusOr<CpuKvCache> Make(CpuKvLayout layout);

  const CpuKvLayout& layout() const { return layout_; }
  bool paged() const { return layout_.page_size > 0; }

  // The kv_dim floats of K (of V) of position `pos` of the sequence at (slot, table), layer
  // `layer` of the stage.
  float* K(int slot, std::span<const int32_t> table, int layer, int pos) {
    return k_.get() + Offset(slot, table, layer, pos);
  }
  float* V(int slot, std::span<const int32_t> table, int layer, int pos) {
    return v_.get() + Offset(slot, table, layer, pos);
  }
  // K and V of positions [0, n) of a layer as (n, kv_dim) row-major: the cache's own rows where
  // they are contiguous (a slot), otherwise copies gathered page by page into k_rows and v_rows.
  std::pair<const float*, const float*> Rows(int slot, std::span<const int32_t> table, int layer,
                                             int n, std::vector<float>& k_rows,
                                             std::vector<float>& v_rows) const;
  // Copies positions [0, n) of a layer out to k, v (n, kv_dim), or in from them.
  void Gather(int slot, std::span<const int32_t> table, int layer, int n, float* k, float* v) const;
  void Scatter(int slot, std::span<const int32_t> table, int layer, int n, const float* k,
               const float* v);

 private:
  CpuKvCache(CpuKvLayout layout, std::unique_ptr<float[]> k, std::unique_ptr<float[]> v)
      : layout_(layout), k_(std::move(k)), v_(std::move(v)) {}
  size_t Offset(int slot, std::span<const int32_t> table, int layer, int pos) const;
  // Calls f(position, run) for the runs of positions [0, n) that are contiguous in memory: one
  // run of n for a slot, one per page otherwise.
  template <typename F>
  void ForRuns(int n, F&& f) const;

  CpuKvLayout layout_;
  std::unique_ptr<float[]> k_;
  std::unique_ptr<float[]> v_;
};

}  // namespace tandem
