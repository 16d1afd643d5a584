// The coordinator's settings: read from YAML, then overridden by flags (main.cc), then validated
// once. Nothing else in the coordinator reads flags or the environment.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace tandem {

struct CoordinatorConfig {
  // Inference, Admin, Registry and health on one port; loopback unless told otherwise.
  std::string listen = "127.0.0.1:50051";
  std::filesystem::path model_dir;        // HF folder every worker can read at the same path
  int stages = 1;                         // pipeline stages per replica
  int replicas = 1;                       // data-parallel pipelines
  int max_batch = 16;                     // sequences in one step (micro-batch)
  int max_slots = 16;                     // KV-cache slots (concurrent sequences) per pipeline
  int max_seq_len = 0;                    // KV-cache positions per slot; 0: the model's context
  int micro_batches = 0;                  // steps in flight per pipeline; 0: = stages
  // Requests held beyond the KV slots (Scheduler::CheckRoom); beyond: RESOURCE_EXHAUSTED. Unset:
  // as many as the slots of the replicas that decode (a round waits behind the one that runs),
  // at least 128 (kMinDefaultWaiting).
  std::optional<int> max_waiting;
  int prefill_chunk = 512;                // prompt tokens per sequence per step
  int prefill_budget = 0;                 // prompt tokens per step, all sequences; 0: no bound
  bool decode_ahead = true;               // one stage: the next decode step sent while one runs
  double decode_ahead_ms = 1.0;           // ... and as many more as fit in this much step time
  int max_resumes = 3;                    // a running request's pipeline lost: resumed this often
  // New requests are admitted once neither has a request arrived nor a sequence ended for
  // admission_quiet_ms, and not while a quarter or more of a pipeline's sequences are about to
  // end by length; at most admission_wait_ms after the oldest arrived, and at once when
  // max_batch wait (SchedulerOptions::admission_quiet): prompts that arrive together share a
  // step. 0: admitted at once.
  double admission_quiet_ms = 0.5;
  double admission_wait_ms = 20.0;
  // Replicas that run prompts only, handing each sequence's KV-cache to the others (which then
  // only decode) after its first token; 0: every replica does both.
  int prefill_replicas = 0;
  // Topology change with the old stages alive: running sequences move to the new layout with
  // their KV-cache (worker to worker) and continue; false: they drain (drain_timeout_s).
  bool move_kv = true;
  int heartbeat_interval_ms = 1000;       // told to workers when they register
  // A silent worker is down after this: ten beats, so that a busy host's scheduling delays are
  // not taken for a death (a worker declared down by mistake registers again).
  int heartbeat_timeout_ms = 10000;
  double drain_timeout_s = 60;            // topology change: wait this long for running requests
  std::string http_listen;                // OpenAI-compatible HTTP API host:port; empty: off
  int http_threads = 4;                   // its event threads (epoll); 0: 4
  // Open HTTP connections; beyond them a new connection is closed at once.
  int http_max_connections = 4096;
  // Total time a client has for a request's headers (counted from the connection's start or the
  // previous response, so also an idle keep-alive connection's life) and for its body.
  int http_header_timeout_s = 10;
  int http_body_timeout_s = 60;
  std::string served_model_name;          // the model's id in that API; empty: model_dir's name
  // Threads the gRPC server keeps for request streams once they end (0: RequestThreads). A
  // synchronous gRPC server keeps two idle ones by default: when a closed loop's round of
  // streams ends together, the threads of all but two exit, and the next round's streams wait
  // for threads made one after another (a few milliseconds for 64), arriving spread out.
  int grpc_threads = 0;
};

// Requests the service may hold at once (every replica's slots and the waiting queue), plus 8:
// the default of grpc_threads.
int RequestThreads(const CoordinatorConfig& c);

// Parses YAML text; `source` names the file in errors. Unknown keys are errors (a typo should not
// silently fall back to a default).
absl::StatusOr<CoordinatorConfig> ParseCoordinatorConfig(std::string_view yaml_text,
                                                         std::string_view source);
absl::StatusOr<CoordinatorConfig> LoadCoordinatorConfig(const std::filesystem::path& path);
// Checks ranges and names the field that is wrong.
absl::Status ValidateCoordinatorConfig(const CoordinatorConfig& c);
// That `dir` is a folder holding a config.json: NOT_FOUND or INVALID_ARGUMENT saying which of
// the two it is not, and what a checkpoint folder holds.
absl::Status CheckModelDir(const std::filesystem::path& dir);

}  // namespace tandem
