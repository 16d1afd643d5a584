// StepRunner: receive, step, send, in the order every stage of a pipeline shares.
#include "worker/service/step_runner.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace tandem {

absl::StatusOr<std::unique_ptr<StepRunner>> StepRunner::Create(Stage& stage,
                                                               ActivationTransport* transport,
                                                               StepRunnerOptions options) {
  if (options.num_stages < 1 || options.stage < 0 || options.stage >= options.num_stages) {
    return absl::InvalidArgumentError(
        absl::StrCat("step runner: stage ", options.stage, " of ", options.num_stages));
  }
  if (options.num_stages > 1 && transport == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("step runner: stage ", options.stage, " of ",
                                                   options.num_stages, " has no transport"));
  }
  if (options.host_link && options.device_sends) {
    return absl::InvalidArgumentError(
        "step runner: device sends need a transport of device activations (not a host link)");
  }
  if (options.num_stages == 1) options.tokens_to_first = options.feed_first = false;
  if (options.tokens_to_first && options.feed_first) {
    return absl::InvalidArgumentError(
        "step runner: the last stage's tokens go to the first stage either instead of the caller "
        "(tokens_to_first) or as well (feed_first), not both");
  }
  // The last stage of a pipeline with a coordinator, unless it feeds the first, has nothing to
  // send from the device.
  if (options.stage + 1 == options.num_stages && !options.tokens_to_first &&
      !options.feed_first) {
    options.device_sends = false;
  }
  if (options.feed_first && (options.stage == 0 || options.stage + 1 == options.num_stages)) {
    RETURN_IF_ERROR(transport->SeparateTokens());
  }
  std::unique_ptr<StepRunner> runner(new StepRunner(stage, transport, std::move(options)));
  if (runner->opt_.device_sends) {
    StepRunner* r = runner.get();
    RETURN_IF_ERROR(stage.SetDecodeTail(
        [r](const StepDescriptor& step, const Activations& hidden, const int32_t* device_tokens) {
          return r->SendFromDevice(step, hidden, device_tokens);
        }));
  }
  return runner;
}

StepRunner::StepRunner(Stage& stage, ActivationTransport* transport, StepRunnerOptions options)
    : stage_(stage), transport_(transport), opt_(std::move(options)) {}

StepRunner::~StepRunner() {
  if (opt_.device_sends) (void)stage_.SetDecodeTail(nullptr);
}

absl::Status StepRunner::SendFromDevice(const StepDescriptor& step, const Activations& hidden,
                                        const int32_t* device_tokens) {
  if (!last()) {
    RETURN_IF_ERROR(transport_->Send(step.id, hidden));
  } else if (opt_.tokens_to_first || opt_.feed_first) {
    // The device holds a token for every sequence; a step with sequences that do not sample
    // (prompt chunks) sends only the sampled ones, from the host.
    for (const SequenceStep& s : step.seqs) {
      if (!s.sample) return absl::OkStatus();
    }
    RETURN_IF_ERROR(transport_->SendDeviceTokens(step.id, device_tokens,
                                                 static_cast<int64_t>(step.seqs.size())));
  } else {
    return absl::OkStatus();  // the caller returns the tokens
  }
  sent_ = true;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StepDescriptor>> StepRunner::FeedPreviousSamples(
    const StepDescriptor& step, const std::function<bool()>& cancelled) {
  if (!first() ||
      std::find(step.tokens.begin(), step.tokens.end(), kPreviousSample) == step.tokens.end()) {
    return nullptr;  // stages after the first read no tokens
  }
  if (!last() && !opt_.feed_first) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", step.id, ": a token stands for the previous sample, which only the single stage of ",
        "a pipeline, or its first stage fed by its last, holds (this is stage ", opt_.stage, " of ",
        opt_.num_stages, ")"));
  }
  if (!last()) {
    // The tokens of the newest steps that sampled the rows' slots, and of every step before them.
    uint64_t through = 0;
    size_t at = 0;
    for (const SequenceStep& row : step.seqs) {
      for (int k = 0; k < row.num_tokens && at < step.tokens.size(); ++k, ++at) {
        if (step.tokens[at] != kPreviousSample) continue;
        auto it = awaited_step_of_slot_.find(row.slot);
        if (it != awaited_step_of_slot_.end()) through = std::max(through, it->second);
      }
    }
    if (through > 0) RETURN_IF_ERROR(TakeTokens(/*wait=*/true, through, cancelled));
  }
  auto fed = std::make_unique<StepDescriptor>(step);
  size_t at = 0;
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const SequenceStep& row = step.seqs[i];
    for (int k = 0; k < row.num_tokens && at < fed->tokens.size(); ++k, ++at) {
      if (fed->tokens[at] != kPreviousSample) continue;
      const bool known = row.slot >= 0 && row.slot < static_cast<int>(last_sample_.size()) &&
                         last_sample_[row.slot] >= 0;
      if (!known) {
        return absl::InvalidArgumentError(absl::StrCat("step ", step.id, " row ", i, ": slot ",
                                                       row.slot, " sampled no token before"));
      }
      fed->tokens[at] = last_sample_[row.slot];
    }
  }
  return fed;
}

std::vector<int> StepRunner::SampledSlots(const StepDescriptor& step) {
  std::vector<int> slots;
  for (const SequenceStep& row : step.seqs) {
    if (row.sample) slots.push_back(row.slot);
  }
  return slots;
}

void StepRunner::KeepSample(int slot, int32_t token) {
  if (slot < 0) return;
  if (slot >= static_cast<int>(last_sample_.size())) last_sample_.resize(slot + 1, -1);
  last_sample_[slot] = token;
}

void StepRunner::KeepSamples(const std::vector<int>& slots, const std::vector<int32_t>& tokens) {
  for (size_t k = 0; k < slots.size() && k < tokens.size(); ++k) KeepSample(slots[k], tokens[k]);
}

void StepRunner::KeepSamples(const StepDescriptor& step, const std::vector<int32_t>& tokens) {
  size_t k = 0;
  for (const SequenceStep& row : step.seqs) {
    if (!row.sample) continue;
    if (k == tokens.size()) break;
    KeepSample(row.slot, tokens[k++]);
  }
}

absl::Status StepRunner::TakeTokens(bool wait, uint64_t through,
                                    const std::function<bool()>& cancelled) {
  while (!awaited_.empty()) {
    AwaitedTokens& front = awaited_.front();
    if (wait ? front.step_id > through : !front.posted.arrived()) break;
    absl::StatusOr<std::vector<int32_t>> tokens = front.posted.take(cancelled);
    AwaitedTokens done = std::move(front);
    awaited_.pop_front();
    if (!tokens.ok()) return tokens.status();
    KeepSamples(done.slots, *tokens);
    for (int slot : done.slots) {
      auto it = awaited_step_of_slot_.find(slot);
      if (it != awaited_step_of_slot_.end() && it->second == done.step_id) {
        awaited_step_of_slot_.erase(it);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status StepRunner::PostTokens(const StepDescriptor& step,
                                    const std::function<bool()>& cancelled) {
  if (static_cast<int>(awaited_.size()) >= kMaxPostedTokenReceives) {
    RETURN_IF_ERROR(TakeTokens(/*wait=*/true, awaited_.front().step_id, cancelled));
  }
  std::vector<int> slots = SampledSlots(step);
  ASSIGN_OR_RETURN(PostedTokens posted,
                   transport_->PostRecvTokens(step.id, static_cast<int64_t>(slots.size())));
  for (int slot : slots) awaited_step_of_slot_[slot] = step.id;
  awaited_.push_back(AwaitedTokens{step.id, std::move(slots), std::move(posted)});
  return absl::OkStatus();
}

absl::StatusOr<StepRun> StepRunner::Run(const StepDescriptor& given,
                                        const std::function<bool()>& cancelled) {
  const absl::Time t0 = absl::Now();
  const bool fed_by_last = first() && !last() && opt_.feed_first;
  if (fed_by_last) RETURN_IF_ERROR(TakeTokens(/*wait=*/false, 0, cancelled));
  ASSIGN_OR_RETURN(std::unique_ptr<StepDescriptor> fed, FeedPreviousSamples(given, cancelled));
  const StepDescriptor& step = fed != nullptr ? *fed : given;
  StepRun run;
  Activations in;
  if (!first()) {
    int64_t rows = 0;
    for (const SequenceStep& s : step.seqs) rows += s.num_tokens;
    // Posted before the step runs, so that over NCCL the step starts on the device once its input
    // lands rather than once the host has seen it arrive.
    ASSIGN_OR_RETURN(in, transport_->PostRecv(step.id, rows, cancelled));
    run.times.recv_bytes = static_cast<int64_t>(in.nbytes());
  }
  absl::Time arrived = absl::Now();  // of the input, where it was received before the step
  sent_ = false;
  absl::StatusOr<StepOutput> out = stage_.Step(step, in);
  const absl::Time stepped = absl::Now();
  if (in.arrival) {
    // The stage asked already (its result depends on the input); the answer is remembered.
    ASSIGN_OR_RETURN(arrived, in.arrival());
  }
  if (!out.ok()) return out.status();
  run.output = *std::move(out);
  run.times.recv = arrived - t0;
  run.times.compute = stepped - arrived;

  StepOutput& o = run.output;
  if (!last() && !sent_) {
    if (opt_.host_link && o.hidden.where == Where::kDevice) {
      ASSIGN_OR_RETURN(o.hidden, stage_.ToHost(o.hidden));
    }
    RETURN_IF_ERROR(transport_->Send(step.id, o.hidden));
    run.times.send_bytes = static_cast<int64_t>(o.hidden.nbytes());
  } else if (last() && (opt_.tokens_to_first || opt_.feed_first) && !sent_) {
    RETURN_IF_ERROR(transport_->SendTokens(step.id, o.tokens));
    run.times.send_bytes = static_cast<int64_t>(o.tokens.size() * sizeof(int32_t));
  }
  if (last() && !opt_.tokens_to_first) {
    run.tokens = o.tokens;
    if (first()) KeepSamples(step, run.tokens);
  } else if (first() && opt_.tokens_to_first) {
    ASSIGN_OR_RETURN(run.tokens, transport_->RecvTokens(step.id, cancelled));
  }
  if (fed_by_last) RETURN_IF_ERROR(PostTokens(step, cancelled));
  run.times.send = absl::Now() - stepped;
  return run;
}

bool StepRunner::CanLaunch(const StepDescriptor& step) const {
  return first() && last() && stage_.CanLaunchDecode(step);
}

absl::Status StepRunner::Launch(const StepDescriptor& step) {
  if (!CanLaunch(step)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", step.id, " cannot be launched ahead (stage ", opt_.stage, " of ",
        opt_.num_stages, ")"));
  }
  if (launched_.size() > 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step.id, ": two launched steps are not finished yet"));
  }
  // Rows fed by a slot that the unfinished step samples take its token on the device; the
  // others from the host, as Run's.
  StepDescriptor fed = step;
  std::vector<int> from_previous;
  if (!launched_.empty()) {
    const StepDescriptor& before = launched_.back().step;
    absl::flat_hash_map<int, int> row_of_slot;
    for (size_t r = 0; r < before.seqs.size(); ++r) {
      if (before.seqs[r].sample) row_of_slot[before.seqs[r].slot] = static_cast<int>(r);
    }
    from_previous.assign(step.seqs.size(), -1);
    for (size_t i = 0; i < step.seqs.size(); ++i) {
      if (fed.tokens[i] != kPreviousSample) continue;
      auto it = row_of_slot.find(step.seqs[i].slot);
      if (it == row_of_slot.end()) continue;
      from_previous[i] = it->second;
      fed.tokens[i] = 0;  // not read
    }
  }
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    if (fed.tokens[i] != kPreviousSample) continue;
    const int slot = step.seqs[i].slot;
    if (slot < 0 || slot >= static_cast<int>(last_sample_.size()) || last_sample_[slot] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("step ", step.id, " row ", i, ": slot ",
                                                     slot, " sampled no token before"));
    }
    fed.tokens[i] = last_sample_[slot];
  }
  RETURN_IF_ERROR(stage_.LaunchDecode(fed, from_previous));
  launched_.push_back(LaunchedStep{step, absl::Now()});
  return absl::OkStatus();
}

absl::StatusOr<StepRun> StepRunner::Finish(StepDescriptor* step) {
  if (launched_.empty()) return absl::FailedPreconditionError("no step is launched");
  LaunchedStep l = std::move(launched_.front());
  launched_.pop_front();
  absl::StatusOr<StepOutput> out = stage_.FinishDecode();
  const absl::Time now = absl::Now();
  const absl::Time began = std::max(l.at, last_finished_);
  last_finished_ = now;
  StepRun run;
  if (out.ok()) {
    run.output = *std::move(out);
    run.tokens = run.output.tokens;
    run.times.compute = now - began;
    KeepSamples(l.step, run.tokens);
  }
  if (step != nullptr) *step = std::move(l.step);
  if (!out.ok()) return out.status();
  return run;
}

}  // namespace tandem
