// The coordinator's settings, each declared once in TANDEM_COORDINATOR_SETTINGS: read from YAML,
// then overridden by flags (main.cc), then validated once. Nothing else in the coordinator reads
// flags or the environment.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/settings.h"

namespace tandem {

// Every coordinator setting, once: X(type, name, default, least, help) (common/settings.h). The
// name is the flag's and the YAML key's; the help is what --help prints.
#define TANDEM_COORDINATOR_SETTINGS(X)                                                           \
  /* Inference, Admin, Registry and health on one port; loopback unless told otherwise. */       \
  X(std::string, listen, "127.0.0.1:50051", ::tandem::kAnyValue,                                 \
    "host:port of Inference, Admin and Registry (0.0.0.0:PORT: every interface, for "            \
    "workers on other hosts, with --cluster_secret, --tls_ca or --allow_insecure)")              \
  /* Workers are sent this path: every worker must read the folder at the same path. */          \
  X(std::filesystem::path, model_dir, "", ::tandem::kAnyValue, "Hugging Face checkpoint folder") \
  X(int, stages, 1, 1, "pipeline stages per replica")                                            \
  X(int, replicas, 1, 1, "data-parallel pipelines")                                              \
  /* MaxBatch(). */                                                                              \
  X(int, max_batch, 0, 0,                                                                        \
    "sequences per step (0: max_slots with --kv_page_size, 16 with contiguous slots)")           \
  /* MaxSlots(): with pages a slot holds no KV-cache, so it bounds concurrent sequences only. */ \
  X(int, max_slots, 0, 0,                                                                        \
    "concurrent sequences (KV slots) per pipeline (0: 16 with contiguous slots, 256 with "       \
    "--kv_page_size)")                                                                           \
  X(int, max_seq_len, 0, 0, "KV-cache positions per sequence (0: model)")                        \
  /* docs/paged-kv.md. */                                                                        \
  /* WithModelDefaults() resolves -1. */                                                         \
  X(int, kv_page_size, -1, -1,                                                                   \
    "tokens per KV-cache page: sequences hold pages as they grow, admission and preemption go "  \
    "by free pages (0: each slot reserves --max_seq_len positions; -1: 16, or 0 where the CUDA " \
    "backend cannot page the model's heads, e.g. a head_dim not a multiple of 4)")               \
  /* vLLM's --kv-cache-dtype; KvCacheDTypeOf(). */                                               \
  X(std::string, kv_cache_dtype, "auto", ::tandem::kAnyValue,                                    \
    "the KV-cache's element type: auto (the model's dtype as each backend computes it) or fp8 "  \
    "(= fp8_e4m3: E4M3 codes over per-layer scales, the checkpoint's k_scale/v_scale or 1; "     \
    "pages hold about twice the tokens of fp16; needs --kv_page_size)")                          \
  X(std::optional<int>, kv_pages, std::nullopt, 1,                                               \
    "with --kv_page_size, KV-cache pages per stage (unset: as many as the stage's memory holds)") \
  X(bool, prefix_caching, true, ::tandem::kAnyValue,                                             \
    "with --kv_page_size, keep full pages of computed prompts and reuse them for prompts that "  \
    "start with the same tokens (false: every prompt is computed, for measurement)")             \
  X(int, micro_batches, 0, 0, "steps in flight per pipeline (0: stages)")                        \
  /* Scheduler::CheckRoom; unset: at least 128 (kMinDefaultWaiting). */                          \
  X(std::optional<int>, max_waiting, std::nullopt, 0,                                            \
    "requests held beyond the KV slots, running or waiting; beyond them RESOURCE_EXHAUSTED "     \
    "(-1: as many as the slots of the replicas that decode, at least 128)")                      \
  X(int, prefill_chunk, 512, 1, "prompt tokens per sequence per step")                           \
  /* PrefillBudget(). */                                                                         \
  X(std::optional<int>, prefill_budget, std::nullopt, 0,                                         \
    "prompt tokens per step across its sequences (0: no bound; unset: 8192 with "                \
    "--kv_page_size, no bound with contiguous slots)")                                           \
  X(bool, decode_ahead, true, ::tandem::kAnyValue,                                               \
    "send a sequence's next decode step while the step before runs (one-stage pipelines, "       \
    "and NCCL pipelines, whose first stage gets the last one's tokens over the link)")           \
  X(double, decode_ahead_ms, 1.0, 0,                                                             \
    "with --decode_ahead, a sequence goes as many steps ahead as fit in this much of its "       \
    "pipeline's measured step time (at least 1, at most 16)")                                    \
  X(int, max_resumes, 3, 0,                                                                      \
    "times a running request whose pipeline is lost (a worker down) continues on another, "      \
    "its KV-cache recomputed, before it fails (0: fails at once)")                               \
  /* SchedulerOptions::admission_quiet. */                                                       \
  X(double, admission_quiet_ms, 0.5, 0,                                                          \
    "new requests are admitted once neither has a request arrived nor a sequence ended for "     \
    "this long, and not while a quarter of a pipeline's sequences are about to end by "          \
    "length (at most --admission_wait_ms; at once when --max_batch wait), so that prompts "      \
    "arriving together share one prompt step (0: admitted at once)")                             \
  X(double, admission_wait_ms, 20.0, 0,                                                          \
    "the longest a new request is held back for others to arrive")                               \
  X(int, prefill_replicas, 0, 0,                                                                 \
    "replicas that run prompts only and hand each sequence's KV-cache to the other replicas, "   \
    "which decode (0: every replica does both)")                                                 \
  X(int, tensor_parallel, 0, 0,                                                                  \
    "ranks (GPUs or threads) each stage is split over, on workers started with at least so "     \
    "many (--tensor_parallel of tandem-worker); 0: each worker's own")                           \
  X(bool, move_kv, true, ::tandem::kAnyValue,                                                    \
    "on a topology change, move running requests with their KV-cache to the new layout "         \
    "(false: let them finish on the old one, up to --drain_timeout_s)")                          \
  /* Told to workers when they register. */                                                      \
  X(int, heartbeat_interval_ms, 1000, 10, "worker heartbeat period")                             \
  /* Ten beats, so that a busy host's scheduling delays are not taken for a death (a worker      \
     declared down by mistake registers again). */                                               \
  X(int, heartbeat_timeout_ms, 10000, 50, "silence before a worker is declared down")            \
  X(double, drain_timeout_s, 60.0, 0, "topology change drain limit")                             \
  X(std::string, http_listen, "", ::tandem::kAnyValue,                                           \
    "host:port of the OpenAI-compatible HTTP API (port 0: any free port; empty: off)")           \
  X(int, http_threads, 4, 0, "HTTP event threads (epoll; each serves many connections; 0: 4)")   \
  X(int, http_max_connections, 4096, 1,                                                          \
    "open HTTP connections at most; beyond them a new one is closed at once")                    \
  X(int, http_header_timeout_s, 10, 1,                                                           \
    "seconds a client has for a request's headers, counted from the connection's start or "      \
    "the previous response (so also an idle keep-alive connection's life)")                      \
  X(int, http_body_timeout_s, 60, 1,                                                             \
    "seconds a client has for a request's body once its headers are in")                         \
  X(std::string, served_model_name, "", ::tandem::kAnyValue,                                     \
    "the model's id in the HTTP API (empty: the name of --model_dir)")                           \
  X(std::string, tool_call_parser, "", ::tandem::kAnyValue,                                      \
    "how the model writes tool calls: llama3_json, hermes or mistral (empty: from the chat "     \
    "template's markers; none there: requests with tools are refused)")                          \
  X(std::string, reasoning_parser, "", ::tandem::kAnyValue,                                      \
    "split a reasoning model's <think> block into the chat reply's reasoning_content: qwen3 "    \
    "or deepseek_r1 (vLLM's names; empty: off)")                                                 \
  /* A synchronous gRPC server keeps two idle threads by default: when a closed loop's round of  \
     streams ends together, the threads of all but two exit, and the next round's streams wait   \
     for threads made one after another (a few milliseconds for 64), arriving spread out. */     \
  X(int, grpc_threads, 0, 0,                                                                     \
    "threads the gRPC server keeps for request streams once they end, so that a burst of "       \
    "new ones does not wait for threads to be made (0: running slots + waiting queue + 8)")

struct CoordinatorConfig {
  TANDEM_COORDINATOR_SETTINGS(TANDEM_SETTING_FIELD)
};

// Calls visit(name, field, least) for each of the config's settings (common/settings.h).
TANDEM_DEFINE_SETTING_VISITOR(TANDEM_COORDINATOR_SETTINGS, ForEachCoordinatorSetting)

// The config with the settings that depend on the model decided: kv_page_size -1 becomes 16,
// or 0 (contiguous slots) where the CUDA backend cannot page the model's heads (head_dim, and
// `group` query heads to a kv head: CudaPagesTakeHeads) and neither kv_pages nor an FP8
// kv_cache_dtype (both need pages) is given.
CoordinatorConfig WithModelDefaults(CoordinatorConfig c, int head_dim, int group);
// Whether the KV-cache is paged (kv_page_size -1, not yet resolved, counts as paged).
inline bool Paged(const CoordinatorConfig& c) { return c.kv_page_size != 0; }
// The KV-cache's element type kv_cache_dtype names (kAuto where it names none: a config that
// ValidateCoordinatorConfig refuses).
KvCacheDType KvCacheDTypeOf(const CoordinatorConfig& c);

// Concurrent sequences per pipeline: --max_slots, or its default for the KV layout (vLLM's
// max_num_seqs with pages).
int MaxSlots(const CoordinatorConfig& c);
// Sequences per step: --max_batch, or its default for the KV layout (with pages, every running
// sequence: MaxSlots, as vLLM's max_num_seqs bounds both).
int MaxBatch(const CoordinatorConfig& c);
// Prompt tokens per step (0: no bound): --prefill_budget, or its default for the KV layout (with
// pages, vLLM's max_num_batched_tokens of 8192, so that hundreds of prompts arriving together
// do not make one step of hundreds of thousands of rows).
int PrefillBudget(const CoordinatorConfig& c);
// Rows of the largest step a pipeline's stages are sent: every sequence of a step with a prompt
// chunk, or the prompt budget plus a decode row for each of the others.
int64_t MaxStepRows(const CoordinatorConfig& c);

// Requests the service may hold at once (every replica's slots and the waiting queue), plus 8:
// the default of grpc_threads.
int RequestThreads(const CoordinatorConfig& c);

// Parses YAML text; `source` names the file in errors. Unknown keys are errors (a typo should not
// silently fall back to a default).
absl::StatusOr<CoordinatorConfig> ParseCoordinatorConfig(std::string_view yaml_text,
                                                         std::string_view source);
absl::StatusOr<CoordinatorConfig> LoadCoordinatorConfig(const std::filesystem::path& path);
// Checks each setting's bound and the settings that depend on each other, and names the field
// that is wrong.
absl::Status ValidateCoordinatorConfig(const CoordinatorConfig& c);
// That `dir` is a folder holding a config.json: NOT_FOUND or INVALID_ARGUMENT saying which of
// the two it is not, and what a checkpoint folder holds.
absl::Status CheckModelDir(const std::filesystem::path& dir);

}  // namespace tandem
