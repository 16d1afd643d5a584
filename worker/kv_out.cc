// KvOut and PendingKvOuts (worker/kv_out.h).
#include "worker/kv_out.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tandem {

KvOut::KvOut(KvBlock block, KvPlace place) : block_(std::move(block)), place_(std::move(place)) {}

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
      return absl::DeadlineExceededError(absl::StrCat("KV write-out: layer ", l,
                                                      " not written in time (", ready_.size(),
                                                      " of ", block_.num_layers, " were)"));
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

std::vector<std::shared_ptr<KvOut>> PendingKvOuts::Take(const StepDescriptor& step) {
  std::vector<std::shared_ptr<KvOut>> taken;
  std::erase_if(outs_, [&](const std::shared_ptr<KvOut>& out) {
    const bool ends = std::any_of(step.seqs.begin(), step.seqs.end(), [&](const SequenceStep& s) {
      return s.slot == out->slot() && s.position + s.num_tokens == out->positions();
    });
    if (ends) taken.push_back(out);
    return ends;
  });
  if (!outs_.empty()) {
    FailAll(absl::FailedPreconditionError(
        absl::StrCat("KV write-out: step ", step.id, " has no row that ends it")));
  }
  return taken;
}

void PendingKvOuts::End(
    std::span<const std::shared_ptr<KvOut>> taken, const absl::Status& st,
    const std::function<absl::Status(KvOut& out, int first_unpublished)>& finish) {
  for (const std::shared_ptr<KvOut>& out : taken) {
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
