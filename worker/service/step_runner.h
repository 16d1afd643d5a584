// The one step driver of a pipeline stage: tandem-worker's step loop and tandem-pipeline-bench both
// run every step through a StepRunner. Per step, in this order:
//   1. stages after the first post the receive of the step's input (or wait for it on the host),
//   2. the stage runs the step (queued behind a posted receive on the device),
//   3. stages before the last send their output on; the last stage returns its sampled tokens,
//      to the caller or, in a pipeline without a coordinator, over the link to the first stage,
//      which receives them.
// With device sends (a stage whose transport shares its stream: NCCL on the stage's stream), a
// decode step's send is queued right behind its forward pass from inside Stage::Step, so it starts
// when the forward pass ends rather than once the host has seen the step finish.
//
// A pipeline's single stage, which both embeds and samples, feeds a token kPreviousSample
// (common/step.h) of a row as the token its slot sampled in the step before, so that the
// coordinator can send a decode step before it has seen the token it feeds. In a pipeline of
// several stages with `feed_first`, the last stage also sends every step's sampled tokens to the
// first over the transport, which posts the receive of each step's tokens once it has run the
// step and feeds kPreviousSample from them, waiting only for the steps whose tokens a row feeds;
// the stages between ignore the token.
//
// A single stage also launches decode steps ahead (Launch, Finish; Stage::LaunchDecode): a step
// is queued behind the one before it without waiting for it, and a row whose token stands for
// the previous sample of a slot that the unfinished step samples takes that token on the device,
// so that the host's turn between two steps (the sampled tokens back, the next step's inputs out)
// happens while the device runs.
//
// One thread runs a runner's steps (the worker's "steps" executor, the benchmark's main thread).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/stage.h"
#include "worker/transport/activation_transport.h"

namespace tandem {

// Work queued behind a decode step's forward pass, inside Stage::Step (Stage::SetDecodeTail).
using DecodeSend = DecodeTail;

struct StepRunnerOptions {
  int stage = 0;       // this stage's index in its pipeline
  int num_stages = 1;  // stages in the pipeline
  // The last stage sends each step's sampled tokens to the first stage over the transport, whose
  // Run returns them (a pipeline without a coordinator); false: the last stage's Run returns them.
  bool tokens_to_first = false;
  // A pipeline of several stages whose coordinator sends steps ahead of their input tokens: the
  // last stage returns each step's sampled tokens to the caller and sends them to the first stage
  // too, which feeds kPreviousSample tokens from them (ActivationTransport::PostRecvTokens).
  bool feed_first = false;
  // The transport carries host activations only (gRPC): device outputs are copied to the host
  // (Stage::ToHost) first.
  bool host_link = true;
  // The transport's work shares the stage's stream (ActivationTransport::BindStage): decode steps
  // send their output from the device, through the stage's decode tail (Stage::SetDecodeTail).
  // False: every send is made once the step has finished.
  bool device_sends = false;
};

// Where one step's time went on the host, and what it moved.
struct StepTimes {
  absl::Duration recv;     // from the step's start until its input was there
  absl::Duration compute;  // from then until Stage::Step returned
  absl::Duration send;     // sending on (and, on the first stage, waiting for the tokens back)
  int64_t recv_bytes = 0;
  int64_t send_bytes = 0;  // 0 where a device send made it
};

struct StepRun {
  StepOutput output;            // the stage's output (tokens and logprobs on the last stage)
  std::vector<int32_t> tokens;  // the step's sampled tokens where this stage returns them
  StepTimes times;
};

class StepRunner {
 public:
  // `transport` may be null for a single stage; it must outlive the runner, as must `stage`.
  // Installs the decode tail where `options.device_sends` is set (and clears it on
  // destruction). INVALID_ARGUMENT for options that describe no stage of a pipeline.
  static absl::StatusOr<std::unique_ptr<StepRunner>> Create(Stage& stage,
                                                            ActivationTransport* transport,
                                                            StepRunnerOptions options);
  ~StepRunner();
  StepRunner(const StepRunner&) = delete;
  StepRunner& operator=(const StepRunner&) = delete;

  // Runs step `step` on this stage. A wait for the input or the tokens ends with CANCELLED once
  // `cancelled()` returns true. An error leaves the runner usable for the next step (the
  // transport may have aborted itself, and then fails that one too). INVALID_ARGUMENT for a
  // kPreviousSample token on the first stage of several without `feed_first`, or in a row whose
  // slot sampled nothing before.
  absl::StatusOr<StepRun> Run(const StepDescriptor& step, const std::function<bool()>& cancelled);

  bool first() const { return opt_.stage == 0; }
  bool last() const { return opt_.stage + 1 == opt_.num_stages; }
  bool device_sends() const { return opt_.device_sends; }
  // Steps whose tokens stand for the previous samples (kPreviousSample) run on this stage's
  // pipeline: a single stage, or stages whose first is fed by the last.
  bool feeds_previous_samples() const { return opt_.num_stages == 1 || opt_.feed_first; }

  // Whether `step` may be launched ahead: a single stage whose backend can launch it
  // (Stage::CanLaunchDecode).
  bool CanLaunch(const StepDescriptor& step) const;
  // Launches `step` behind the unfinished one, if any (at most one may be; FAILED_PRECONDITION
  // otherwise). INVALID_ARGUMENT as Run's for a kPreviousSample token of a slot that sampled
  // nothing before, or for a step CanLaunch refuses. Nothing is launched on an error.
  absl::Status Launch(const StepDescriptor& step);
  // Steps launched and not finished (0, 1 or 2).
  int launched() const { return static_cast<int>(launched_.size()); }
  // Whether Finish would return without waiting (true when none is launched).
  bool LaunchedDone() const { return launched_.empty() || stage_.DecodeDone(); }
  // Waits for the oldest launched step and returns it as Run would have, and the step itself in
  // `step` where given; its compute time runs from its launch, or from the step before it
  // finished where that is later.
  absl::StatusOr<StepRun> Finish(StepDescriptor* step = nullptr);

 private:
  StepRunner(Stage& stage, ActivationTransport* transport, StepRunnerOptions options);
  // The decode tail: sends the step's output from the device; marks it sent.
  absl::Status SendFromDevice(const StepDescriptor& step, const Activations& hidden,
                              const int32_t* device_tokens);
  // `step`'s tokens with every kPreviousSample replaced by its slot's last sampled token; null
  // when `step` has none or this stage does not embed. A first stage fed by the last takes the
  // tokens of the steps the rows feed from first.
  absl::StatusOr<std::unique_ptr<StepDescriptor>> FeedPreviousSamples(
      const StepDescriptor& step, const std::function<bool()>& cancelled);
  // Remembers the tokens that the step whose sampled rows are in `slots` sampled, by slot; or
  // those of `step`'s sampled rows.
  void KeepSamples(const std::vector<int>& slots, const std::vector<int32_t>& tokens);
  void KeepSamples(const StepDescriptor& step, const std::vector<int32_t>& tokens);
  void KeepSample(int slot, int32_t token);
  // The slots of `step`'s sampled rows, in order.
  static std::vector<int> SampledSlots(const StepDescriptor& step);
  // A first stage fed by the last: takes the posted token receives in order, while they have
  // arrived (`wait` false) or through step `through` (`wait` true).
  absl::Status TakeTokens(bool wait, uint64_t through, const std::function<bool()>& cancelled);
  // ... and posts the receive of `step`'s tokens once the step has run.
  absl::Status PostTokens(const StepDescriptor& step, const std::function<bool()>& cancelled);

  Stage& stage_;
  ActivationTransport* const transport_;
  const StepRunnerOptions opt_;
  bool sent_ = false;  // the running step's output went out from the device
  std::vector<int32_t> last_sample_;  // by slot: the token it sampled last; -1: none
  // Steps launched ahead and not finished, oldest first, with the time each was launched; and
  // when the last one finished.
  struct LaunchedStep {
    StepDescriptor step;
    absl::Time at;
  };
  std::deque<LaunchedStep> launched_;
  absl::Time last_finished_ = absl::InfinitePast();
  // A first stage fed by the last: the posted receives of the steps it ran, oldest first, with
  // the slots of their sampled rows, and by slot the newest step whose token it still awaits.
  struct AwaitedTokens {
    uint64_t step_id = 0;
    std::vector<int> slots;
    PostedTokens posted;
  };
  std::deque<AwaitedTokens> awaited_;
  absl::flat_hash_map<int, uint64_t> awaited_step_of_slot_;
};

}  // namespace tandem
