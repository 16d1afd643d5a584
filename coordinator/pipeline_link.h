// The coordinator's end of one pipeline's Worker.Steps streams: one bidirectional stream per
// stage. Steps go to every stage in issue order; a reader thread per stage delivers results and
// notices a stream that breaks (a worker that died or failed a step). AssignPipelineStages loads
// the stages before the streams open and sets up their activation link (gRPC or NCCL).
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/tandem.grpc.pb.h"

namespace tandem {

class PipelineLink {
 public:
  struct Callbacks {
    // A result from the last stage, or an error result from any stage. Called on a reader thread.
    std::function<void(int stage, const v1::StepResult&)> on_result;
    // A stream ended without Close(): the worker died, restarted or refused the stream.
    std::function<void(int stage, const absl::Status&)> on_broken;
  };

  // Opens one Steps stream per stage; `name` prefixes the reader threads' names.
  PipelineLink(std::vector<std::shared_ptr<grpc::Channel>> channels, Callbacks callbacks,
               const std::string& name);
  ~PipelineLink();  // Close()
  PipelineLink(const PipelineLink&) = delete;
  PipelineLink& operator=(const PipelineLink&) = delete;

  // Steps leave in the order they are queued, whichever thread writes them: Queue (under the
  // lock that orders step formation) then Flush (outside it) writes every queued step to every
  // stage, stage 0 first (every stage checks the tokens against the sequences' lengths). False
  // when any stream is broken or closed.
  void Queue(v1::StepRequest step);
  bool Flush();
  // Cancels every stream and joins the readers; no callback runs after it returns. Must not be
  // called from a callback or while holding a lock that a callback takes.
  void Close();

 private:
  struct StageStream {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResult>> stream;
    absl::Mutex write_mu;
    bool broken ABSL_GUARDED_BY(write_mu) = false;
    std::thread reader;
  };
  void ReadLoop(int stage);

  bool Write(const v1::StepRequest& step);

  Callbacks callbacks_;
  std::vector<std::unique_ptr<StageStream>> stages_;
  absl::Mutex queue_mu_;
  std::deque<v1::StepRequest> queued_ ABSL_GUARDED_BY(queue_mu_);
  absl::Mutex flush_mu_;  // one writer at a time, so that queued steps leave in order
  std::atomic<bool> closing_{false};
  absl::Mutex close_mu_;
  bool closed_ ABSL_GUARDED_BY(close_mu_) = false;
};

// A failed AssignStage: which stage and the worker's answer.
struct StageAssignError {
  int stage = -1;
  grpc::Status status;
};

// Loads a pipeline's stages: `requests[s]` goes to `channels[s]`. Where every stage's worker can
// link over NCCL (`nccl_capable`: CUDA workers all), first asks stage 0's worker
// (Worker.PrepareLink) which activation link it offers; with "nccl" every request gets its
// ncclUniqueId and the stages are assigned concurrently (joining a communicator is collective),
// otherwise (and without asking where a stage cannot) over gRPC one after the other, in stage
// order. Requests that name their transport already (those of a prepare, sent again without
// `prepare`) keep it, and nothing is asked. `requests` keep the link chosen; `responses` get one
// answer per stage. On failure returns the first failed stage (the lowest index) and its status.
std::optional<StageAssignError> AssignPipelineStages(
    const std::vector<std::shared_ptr<grpc::Channel>>& channels,
    std::vector<v1::AssignStageRequest>& requests, absl::Duration timeout,
    std::vector<v1::AssignStageResponse>* responses, bool nccl_capable = true);

}  // namespace tandem
