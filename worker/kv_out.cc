// KvOut and PendingKvOuts (worker/kv_out.h).
#include "worker/kv_out.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace tandem {

KvOut::KvOut(KvBlock block, int slot) : block_(std::move(block)), slot_(slot) {}

void KvOut::Written(int l, std::function<absl::Status()> ready) {
  {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok() || l != static_cast<int>(ready_.size()) || l >= block_.num_layers) return;
    ready_.push_back(std::move(ready));
  }
  if (on_published_) on_published_(l);
}

void KvOut::Fail(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  const bool whole = block_.num_layers > 0 && static_cast<int>(ready_.size()) == block_.num_layers;
  if (failed_.ok() && !whole) failed_ = why.ok() ? absl::InternalError("KV write-out failed") : why;
}

absl::Status KvOut::Await(int l, absl::Time deadline) const {
  std::function<absl::Status()> ready;
  {
    absl::MutexLock lock(&mu_);
    if (l < 0 || l >= block_.num_layers) {
      if (!failed_.ok()) return failed_;
      return absl::InvalidArgumentError(
          absl::StrCat("KV write-out: layer ", l, " of ", block_.num_layers));
    }
    auto here = [this, l]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return static_cast<int>(ready_.size()) > l || !failed_.ok();
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&here), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "KV write-out: layer ", l, " not written in time (", ready_.size(), " of ",
          block_.num_layers, " were)"));
    }
    if (static_cast<int>(ready_.size()) <= l) return failed_;
    ready = ready_[l];
  }
  return ready ? ready() : absl::OkStatus();
}

int KvOut::published() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(ready_.size());
}

bool KvOut::ended() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(ready_.size()) == block_.num_layers || !failed_.ok();
}

std::vector<std::pair<std::shared_ptr<KvOut>, int>> PendingKvOuts::Take(
    const StepDescriptor& step) {
  std::vector<std::pair<std::shared_ptr<KvOut>, int>> taken;
  std::erase_if(outs_, [&](const std::shared_ptr<KvOut>& out) {
    for (int i = 0; i < static_cast<int>(step.seqs.size()); ++i) {
      const SequenceStep& s = step.seqs[i];
      if (s.slot == out->slot() && s.position + s.num_tokens == out->positions()) {
        taken.emplace_back(out, i);
        return true;
      }
    }
    return false;
  });
  return taken;
}

void PendingKvOuts::End(
    std::span<const std::pair<std::shared_ptr<KvOut>, int>> taken, const absl::Status& st,
    const std::function<absl::Status(KvOut& out, int first_unpublished)>& finish) {
  for (const auto& [out, row] : taken) {
    if (!st.ok()) {
      out->Fail(st);
      continue;
    }
    const int first = out->published();
    if (first == out->block().num_layers) continue;
    if (absl::Status written = finish(*out, first); !written.ok()) out->Fail(written);
  }
}

void PendingKvOuts::FailAll(const absl::Status& why) {
  for (const std::shared_ptr<KvOut>& out : outs_) out->Fail(why);
  outs_.clear();
}

}  // namespace tandem
