// A sequence's KV-cache written out by a step as the step goes, layer by layer: what a prefill
// worker's stage fills while a prompt's last step runs (Stage::OpenKvOut), so that each layer can
// leave for the decode worker while the next ones are still computed. The stage publishes each
// layer once its copy is written or queued (Written); senders wait for the layers one by one
// (Await), on other threads.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/stage.h"

namespace tandem {

class KvOut {
 public:
  // `block`: the fields and the memory (host, or the stage's device) of the positions
  // [0, block.positions) of the sequence at `place`, not yet written.
  KvOut(KvBlock block, KvPlace place);
  KvOut(const KvOut&) = delete;
  KvOut& operator=(const KvOut&) = delete;

  const KvBlock& block() const { return block_; }
  // The stage's, to write the layers it has not published yet.
  KvBlock& block_to_write() { return block_; }
  int slot() const { return place_.slot; }
  const KvPlace& place() const { return place_; }
  int positions() const { return block_.positions; }

  // The stage: layer `l` of the block (from 0, in order) is written, or will be once `ready`
  // returns OK (a copy queued on a device; empty: written now).
  void Written(int l, std::function<absl::Status()> ready = {});
  // The step failed or did not write the sequence: every wait, now and later, ends with `why`.
  void Fail(const absl::Status& why);
  // Waits until layer `l` is written (its bytes in block() final), the stage failed (its error),
  // or `deadline` passed (DEADLINE_EXCEEDED).
  absl::Status Await(int l, absl::Time deadline) const;
  absl::Status AwaitAll(absl::Time deadline) const {
    return Await(block_.num_layers - 1, deadline);
  }
  // Layers published so far.
  int published() const;
  // Every layer published, or failed.
  bool ended() const;
  // Called on the stage's thread as each layer is published, after it is (tests watch the order
  // of layers and steps with it).
  void OnPublished(std::function<void(int layer)> f) { on_published_ = std::move(f); }

 private:
  KvBlock block_;
  const KvPlace place_;
  mutable absl::Mutex mu_;
  std::vector<std::function<absl::Status()>> ready_ ABSL_GUARDED_BY(mu_);
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  std::function<void(int)> on_published_;
};

// The KvOuts a stage's next step fills: each belongs to the step's row of its slot whose
// position + num_tokens is its positions. Kept by a backend between OpenKvOut and the step.
class PendingKvOuts {
 public:
  PendingKvOuts() = default;
  PendingKvOuts(const PendingKvOuts&) = delete;
  PendingKvOuts& operator=(const PendingKvOuts&) = delete;
  ~PendingKvOuts() { FailAll(absl::CancelledError("KV write-out: the stage was released")); }
  void Add(std::shared_ptr<KvOut> out) { outs_.push_back(std::move(out)); }
  // Those of `step`'s rows; the others were opened for nothing and fail, naming the step.
  std::vector<std::shared_ptr<KvOut>> Take(const StepDescriptor& step);
  // Ends what is left of the taken ones after their step: `st` not OK fails them; otherwise
  // `finish` is asked to write each one's unpublished layers (a step path that wrote none), and
  // its error fails it. Every KvOut ends.
  static void End(std::span<const std::shared_ptr<KvOut>> taken, const absl::Status& st,
                  const std::function<absl::Status(KvOut& out, int first_unpublished)>& finish);
  // Fails every one still pending (the step did not write them, or the stage goes away).
  void FailAll(const absl::Status& why);

 private:
  std::vector<std::shared_ptr<KvOut>> outs_;
};

}  // namespace tandem
