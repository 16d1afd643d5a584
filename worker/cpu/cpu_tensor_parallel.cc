// The CPU stage over tensor-parallel ranks (cpu_tensor_parallel.h).
//
// Threads: the caller of Step (the worker's step loop) runs rank 0; ranks 1 .. N-1 each run on a
// thread of their own ("tp-rank-<r>") that waits for the next step. The ranks meet only in the
// all-reduce, twice a layer.
#include "worker/cpu/cpu_tensor_parallel.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cpu/cpu_all_reduce.h"
#include "worker/cpu/cpu_stage.h"
#include "worker/rank_threads.h"
#include "worker/tensor_parallel.h"

namespace tandem {
namespace {

class CpuTensorParallelStage final : public Stage {
 public:
  CpuTensorParallelStage(std::unique_ptr<CpuAllReduce> all_reduce,
                         std::vector<std::unique_ptr<Stage>> ranks, ModelConfig config)
      : all_reduce_(std::move(all_reduce)),
        ranks_(std::move(ranks)),
        config_(std::move(config)),
        threads_(static_cast<int>(ranks_.size())) {}

  const ModelConfig& config() const override { return config_; }
  // Every rank holds the same positions of its own K/V heads: the pages of the smallest pool.
  int kv_pages() const override {
    int pages = ranks_[0]->kv_pages();
    for (const auto& r : ranks_) pages = std::min(pages, r->kv_pages());
    return pages;
  }

  // Every rank validates the same step against the same slot lengths, so they accept or refuse
  // it together, before any reaches the all-reduce.
  absl::StatusOr<StepOutput> Step(const StepDescriptor& step, const Activations& in) override {
    std::vector<absl::StatusOr<StepOutput>> outs(ranks_.size());
    threads_.Run([&](int r) { outs[r] = ranks_[r]->Step(step, in); });
    for (size_t r = 1; r < outs.size(); ++r) {
      if (!outs[r].ok()) return RankError(r, outs[r].status());
    }
    return std::move(outs[0]);
  }

  // A sequence's KV-cache of every K/V head: each rank's heads side by side (a head that several
  // ranks hold, from the first); a block from anywhere gives each rank its heads.
  absl::StatusOr<KvBlock> ExportKv(const KvPlace& place, int positions, int first_layer,
                                   int num_layers) const override {
    return ExportSplitKv(config_, ranks_, place, positions, first_layer, num_layers);
  }
  absl::Status ImportKv(const KvPlace& place, const KvBlock& block) override {
    return ImportSplitKv(config_, ranks_, place, block);
  }

 private:
  std::unique_ptr<CpuAllReduce> all_reduce_;  // the ranks' stages point into it
  std::vector<std::unique_ptr<Stage>> ranks_;
  const ModelConfig config_;  // the whole model's (every rank's config())
  RankThreads threads_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Stage>> MakeCpuTensorParallelStage(const StageSpec& spec,
                                                                  int ranks) {
  if (ranks == 1) return MakeCpuStage(spec);
  auto all_reduce = std::make_unique<CpuAllReduce>(ranks);
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Stage>> stages,
                   MakeCpuStageRanks(spec, *all_reduce));
  ModelConfig config = stages[0]->config();
  return std::make_unique<CpuTensorParallelStage>(std::move(all_reduce), std::move(stages),
                                                  std::move(config));
}

}  // namespace tandem
