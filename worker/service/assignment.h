// One assignment of a worker: the stage the coordinator assigned, its link to the neighbours, and
// the lock that puts KV-cache moves between its steps. Shared by the Worker service's step loop
// (worker_service.h) and its KV-cache moves (kv_moves.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/synchronization/mutex.h"
#include "worker/service/step_runner.h"
#include "worker/stage.h"
#include "worker/transport/activation_transport.h"

namespace tandem {

struct Assignment {
  uint64_t id = 0;
  int stage = 0;
  int num_stages = 1;
  int first_layer = 0;  // the model layers the stage holds, [first_layer, last_layer)
  int last_layer = 0;
  int max_seq_len = 0;
  std::unique_ptr<Stage> engine;
  std::unique_ptr<ActivationTransport> transport;
  std::unique_ptr<StepRunner> runner;  // over engine and transport; destroyed first
  // Serializes the executors of streams that overlap during a hand-over, and the KV-cache
  // exports and imports that run between steps.
  absl::Mutex run_mu;
  // Exports and imports waiting for run_mu: an executor lets them in before its next step
  // (LockForStep), so that a busy stage does not keep a hand-off waiting step after step.
  std::atomic<int> kv_waiting{0};

  // run_mu for a step (after every waiting export or import) or for one sequence's KV-cache.
  void LockForStep() ABSL_EXCLUSIVE_LOCK_FUNCTION(run_mu) {
    run_mu.LockWhen(absl::Condition(
        +[](std::atomic<int>* waiting) { return waiting->load() == 0; }, &kv_waiting));
  }
  void LockForKv() ABSL_EXCLUSIVE_LOCK_FUNCTION(run_mu) {
    kv_waiting.fetch_add(1);
    run_mu.Lock();
    kv_waiting.fetch_sub(1);
  }
};

}  // namespace tandem
