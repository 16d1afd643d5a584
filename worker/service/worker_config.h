// The worker's settings, each declared once in TANDEM_WORKER_SETTINGS: given by flags (main.cc),
// validated once. Keys and TLS are flags of their own (common/security/tls_flags.h): they are
// secrets, not settings.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "common/settings.h"

namespace tandem {

// Every worker setting, once: X(type, name, default, least, help) (common/settings.h). The name
// is the flag's; the help is what --help prints. Values with a fixed set of choices (backend,
// dtype, transport, launch_ahead) are checked where they are read, which names the choices.
#define TANDEM_WORKER_SETTINGS(X)                                                              \
  X(std::string, coordinator, "127.0.0.1:50051", ::tandem::kAnyValue,                          \
    "the coordinator's host:port")                                                             \
  X(std::string, listen, "127.0.0.1:0", ::tandem::kAnyValue,                                   \
    "host:port to serve on (0.0.0.0:PORT: every interface, needed when the coordinator or "    \
    "other workers run elsewhere, with --cluster_secret, --tls_ca or --allow_insecure; "       \
    "port 0: any free port)")                                                                  \
  X(std::string, advertise_host, "127.0.0.1", ::tandem::kAnyValue,                             \
    "host name the coordinator and the other workers use to reach this worker")                \
  X(std::string, backend, "cpu", ::tandem::kAnyValue,                                          \
    "compute backend: cpu or cuda (CUDA builds)")                                              \
  X(int, cpu_threads, 1, ::tandem::kAnyValue,                                                  \
    "cpu: threads of the GEMMs (OpenBLAS), process-wide; more speed up long prompts on a "     \
    "host of many cores, and take cores from whatever else runs there")                        \
  X(int, tensor_parallel, 1, 1,                                                                \
    "ranks each stage is split over (Megatron: heads and MLP columns per rank, an all-reduce "  \
    "after the attention output and the MLP); cpu: one thread per rank, at most the cores; "   \
    "cuda: one GPU per rank, --gpu and the next ones; the model's heads must divide by it")   \
  X(int, gpu, 0, ::tandem::kAnyValue, "cuda: the CUDA device index")                           \
  X(std::string, dtype, "f16", ::tandem::kAnyValue,                                            \
    "cuda: weights, activations and KV-cache type, f16 or bf16")                               \
  X(std::string, quantization, "", ::tandem::kAnyValue,                                       \
    "linear-layer weights: fp8 (E4M3, quantized at load with one scale per output channel) or " \
    "empty (as the checkpoint stores them; FP8 checkpoints stay FP8)")                         \
  X(double, kv_memory_fraction, 0.9, ::tandem::kAnyValue,                                      \
    "share of the memory left after the weights that the KV-cache takes (cuda: the GPU's; "   \
    "cpu: the host's available memory, for a paged cache whose page count is not given)")      \
  X(std::string, transport, "auto", ::tandem::kAnyValue,                                       \
    "activations to the next stage: grpc (host bytes over StageLink), nccl (cuda backend; "    \
    "offered when this worker is a pipeline's first stage) or auto (nccl with "                \
    "--backend=cuda, grpc otherwise)")                                                         \
  X(bool, kv_over_nccl, true, ::tandem::kAnyValue,                                             \
    "cuda: move KV-cache to and from other CUDA workers over NCCL between the GPUs (false: "   \
    "through host memory and gRPC)")                                                           \
  X(bool, batch_invariant, false, ::tandem::kAnyValue,                                         \
    "cuda: results independent of the batch (greedy outputs equal at every batch size and "    \
    "node count), slower at small batches")                                                    \
  X(std::string, step_trace, "", ::tandem::kAnyValue,                                          \
    "file to append one line per step to (end time in us, step id, sequences, tokens, "        \
    "sequences feeding a prompt chunk, receive / compute / send ms); empty: none")             \
  X(std::string, launch_ahead, "auto", ::tandem::kAnyValue,                                    \
    "a single stage's decode steps queued behind the one running, their tokens fed from its "  \
    "samples: auto (where the stage runs them on a GPU while the host goes on), always (a "    \
    "CPU stage too: it runs each at once, and a step's result leaves after the next has "      \
    "run) or off (each step ends before the next starts)")                                     \
  X(int, recv_timeout_s, 300, 1, "how long a stage waits for its input before failing a step") \
  X(std::string, metrics_address, "127.0.0.1:0", ::tandem::kAnyValue,                          \
    "host:port serving Prometheus /metrics (0.0.0.0:PORT: every interface; port 0: any free "  \
    "port, printed; empty: off)")                                                              \
  X(bool, allow_insecure, false, ::tandem::kAnyValue,                                          \
    "serve --listen on an address other hosts reach without --cluster_secret or --tls_ca "     \
    "(any process that reaches the port can then send this worker steps and read its "         \
    "results): for a network where every host is trusted")                                     \
  X(std::string, model_root, "", ::tandem::kAnyValue,                                          \
    "folder that every checkpoint the coordinator assigns must lie in (empty: anywhere)")

struct WorkerConfig {
  TANDEM_WORKER_SETTINGS(TANDEM_SETTING_FIELD)
};

// Calls visit(name, field, least) for each of the config's settings (common/settings.h).
TANDEM_DEFINE_SETTING_VISITOR(TANDEM_WORKER_SETTINGS, ForEachWorkerSetting)

// Checks each setting's bound; the message names the flag ("--recv_timeout_s must be >= 1").
absl::Status ValidateWorkerConfig(const WorkerConfig& c);

}  // namespace tandem
