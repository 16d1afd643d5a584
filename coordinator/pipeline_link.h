// The coordinator's end of one pipeline's Worker.Steps streams: one bidirectional stream per
// stage. Steps go to every stage in issue order; a reader thread per stage delivers results and
// notices a stream that breaks (a worker that died or failed a step).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
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

  // Writes `step` to every stage, stage 0 first (every stage checks the tokens against the
  // sequences' lengths). False when any stream is broken or closed. Calls must come from one thread (that keeps the order).
  bool Send(const v1::StepRequest& step);
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

  Callbacks callbacks_;
  std::vector<std::unique_ptr<StageStream>> stages_;
  std::atomic<bool> closing_{false};
  absl::Mutex close_mu_;
  bool closed_ ABSL_GUARDED_BY(close_mu_) = false;
};

// Sets the calling thread's name as shown by ps/top/gdb (at most 15 characters).
void SetThreadName(const std::string& name);

}  // namespace tandem
