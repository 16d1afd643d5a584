// Stage's defaults (worker/stage.h): the checks of decode steps launched ahead that every backend
// makes, the default that runs each step as it is launched, and the answers of a stage without a
// device.
#include <cstdint>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/stage.h"

namespace tandem {

bool Stage::CanLaunchDecode(const StepDescriptor& step) const {
  if (step.seqs.empty() || step.return_logits || step.tokens.size() != step.seqs.size()) {
    return false;
  }
  for (const SequenceStep& s : step.seqs) {
    if (s.num_tokens != 1 || s.kv_out_key != 0) return false;  // a write-out runs as a step
  }
  return true;
}

absl::Status Stage::CheckLaunch(const StepDescriptor& step, std::span<const int> from_previous,
                                int unfinished, const StepDescriptor* previous) const {
  if (!CanLaunchDecode(step)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", step.id, " cannot be launched ahead: only steps of one token per sequence that "
        "return no logits can, on a stage that embeds and samples"));
  }
  if (unfinished >= kMaxLaunchedDecodes) {
    return absl::FailedPreconditionError(absl::StrCat("step ", step.id, ": ", unfinished,
                                                      " launched steps are not finished yet"));
  }
  if (!from_previous.empty() && from_previous.size() != step.seqs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step.id, ": ", from_previous.size(),
                                                   " rows take tokens from the step before, of ",
                                                   step.seqs.size()));
  }
  for (size_t i = 0; i < from_previous.size(); ++i) {
    const int r = from_previous[i];
    if (r == -1) continue;
    if (previous == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", step.id, " row ", i, ": takes a token from the step before, but none runs"));
    }
    if (r < -1 || r >= static_cast<int>(previous->seqs.size()) || !previous->seqs[r].sample) {
      return absl::InvalidArgumentError(absl::StrCat("step ", step.id, " row ", i,
                                                     ": takes the token of row ", r, " of step ",
                                                     previous->id, ", which samples none"));
    }
  }
  return absl::OkStatus();
}

absl::Status Stage::LaunchDecode(const StepDescriptor& step, std::span<const int> from_previous) {
  const Launched* previous = launched_.empty() ? nullptr : &launched_.back();
  RETURN_IF_ERROR(CheckLaunch(step, from_previous, static_cast<int>(launched_.size()),
                              previous != nullptr ? &previous->step : nullptr));
  StepDescriptor fed = step;
  for (size_t i = 0; i < from_previous.size(); ++i) {
    if (from_previous[i] < 0) continue;
    if (!previous->output.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", step.id, " row ", i, ": the step it takes its token from failed: ",
          previous->output.status().message()));
    }
    size_t sampled = 0;  // the row's index among the previous step's sampled rows
    for (int r = 0; r < from_previous[i]; ++r) sampled += previous->step.seqs[r].sample ? 1 : 0;
    if (sampled >= previous->output->tokens.size()) {
      return absl::InternalError(absl::StrCat("step ", previous->step.id, " returned ",
                                              previous->output->tokens.size(), " tokens"));
    }
    fed.tokens[i] = previous->output->tokens[sampled];
  }
  Launched l{step, Step(fed, Activations{})};
  launched_.push_back(std::move(l));
  return absl::OkStatus();
}

absl::StatusOr<StepOutput> Stage::FinishDecode() {
  if (launched_.empty()) return absl::FailedPreconditionError("no decode step is launched");
  absl::StatusOr<StepOutput> out = std::move(launched_.front().output);
  launched_.pop_front();
  return out;
}

namespace {
absl::Status NoDevice(const char* what) {
  return absl::UnimplementedError(
      absl::StrCat(what, ": this backend's stages run on the host, without a device"));
}
}  // namespace

absl::StatusOr<Activations> Stage::ToHost(const Activations& a) const {
  if (a.where == Where::kHost) return a;
  return NoDevice("a copy of device activations to the host");
}

absl::StatusOr<void*> Stage::DeviceStream() const { return NoDevice("a device stream"); }

absl::Status Stage::SetDecodeTail(DecodeTail tail) {
  (void)tail;
  return NoDevice("a decode tail");
}

absl::Status Stage::SetStreamWatch(std::function<absl::Status()> watch) {
  (void)watch;
  return NoDevice("a stream watch");
}

absl::Status Stage::SetDecodeObserver(DecodeObserver* observer) {
  (void)observer;
  return NoDevice("a decode observer");
}

absl::StatusOr<int> Stage::DecodeGraphCount() const { return NoDevice("decode graphs"); }

}  // namespace tandem
