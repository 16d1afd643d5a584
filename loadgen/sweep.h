// tandem-loadgen sweep: a scaling study of a running deployment, driven through tandem's gRPC API
// or any OpenAI-compatible HTTP API (load_client.h). For every node count (through
// Admin.SetTopology, so one allocation sweeps 1..N), prompt/output length and load level (closed-
// loop concurrency or open-loop Poisson rate) it warms up, measures, scrapes the workers' /metrics
// before and after (energy, compute and transfer seconds) and while running (power, memory), and
// judges every greedy output against a reference run of its prompt by the agreement rule
// (greedy_agreement.h). The layout found at the start is set again at the end. sweep_report.cc
// writes the run folder.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/metrics.h"
#include "common/security/credentials.h"
#include "loadgen/greedy_agreement.h"
#include "loadgen/load_client.h"
#include "loadgen/workload.h"

namespace tandem::loadgen {

struct SweepOptions {
  // "grpc": tandem's gRPC API at `coordinator` (host:port). "openai": an OpenAI-compatible HTTP
  // server at `coordinator` (http://host:port), tandem's or another's.
  std::string api = "grpc";
  std::string coordinator = "127.0.0.1:50051";
  std::string model;  // openai: the model to name; "": the first the server lists
  // openai: tandem's gRPC address, for --nodes (Admin.SetTopology) and the vocabulary; "": none,
  // and then only --nodes 1 (the server as it runs) can be measured.
  std::string admin;
  std::vector<std::string> worker_metrics;  // host:port of each worker's /metrics
  std::vector<int> nodes = {1};             // workers per configuration
  bool data_parallel = false;               // nodes as replicas x 1 stage (default: stages)
  bool tensor_nodes = false;  // nodes as the ranks of one stage (--parallelism tensor)
  int tensor_parallel = 0;    // otherwise ranks per stage of every layout (0: each worker's own)
  // With data_parallel, a dimension of the sweep: of each node count's replicas, those that run
  // prompts only and hand the KV-cache to the others, which decode (disaggregated prefill); 0:
  // every one does both.
  std::vector<int> prefill_nodes = {0};
  std::string mode = "closed";              // "closed": concurrency; "open": Poisson arrivals
  std::vector<int> batch = {1};             // closed loop: requests in flight
  std::vector<double> rates;                // open loop: requests per second
  std::vector<int> prompt_lens = {32};
  std::vector<int> output_lens = {32};
  int requests = 32;          // measured requests per configuration (per node when weak)
  bool weak_scaling = false;  // strong (fixed work) or weak (work grows with nodes)
  int warmup = 4;             // unmeasured requests per configuration
  int prompt_pool = 16;       // distinct prompts; request i uses prompt i mod pool
  // Which requests are sent (workload.h): fixed lengths, mixed lengths whose medians are
  // prompt_lens/output_lens, or a shared system prompt before suffixes of prompt_lens.
  WorkloadSpec workload;
  uint64_t seed = 1;
  double request_timeout_s = 300;
  // gRPC: each closed-loop client on a connection of its own (open loop: each request, up to 64
  // connections), as separate users would be, instead of every request on one connection (HTTP/2
  // streams of one channel).
  bool connection_per_client = false;
  // The correctness check: a greedy output that first differs from its prompt's reference where
  // the reference's top-2 logprob gap is below this (nats) is a near-tie, not a failure; 0: every
  // output must equal its reference.
  double tie_tolerance = kDefaultTieTolerance;
  // false: no reference runs and no correctness check (capacity and soak runs, where the
  // references' one-at-a-time runs would take most of the time); every output is unchecked.
  bool check = true;
  std::filesystem::path out;  // the run folder
  // Progress on stderr: one line rewritten in place on a terminal, plain lines now and then
  // otherwise (no terminal escapes in a log).
  bool progress = true;
  // TLS and the api key (Inference; the OpenAI API's Bearer token), TLS and the admin key (Admin).
  ClientAuth inference_auth;
  ClientAuth admin_auth;
  std::string tls_ca;  // openai over https: the PEM roots of the server ("": the system's)
};

struct StageShare {
  double compute_s = 0;
  double transfer_s = 0;  // send + receive (receive includes waiting for the previous stage)
  double bytes = 0;
};

// A measured output that differs from its prompt's reference, as the check judged it.
struct Difference {
  int prompt = 0;    // the prompt's index in the pool
  int requests = 1;  // the configuration's requests that differ so (same prompt, position, tokens)
  Verdict verdict;
};

struct ConfigResult {
  int nodes = 1;
  int stages = 1;
  int replicas = 1;
  int prefill_nodes = 0;  // of the replicas, those that ran prompts only
  std::string mode;
  int batch = 0;      // closed loop
  double rate = 0;    // open loop
  std::string workload = "fixed";  // WorkloadSpec::kind
  int prompt_len = 0;  // mixed: the median; shared_prefix: the suffix after the shared prefix
  int output_len = 0;  // mixed: the median
  int requests = 0;
  int errors = 0;
  double wall_s = 0;
  double tokens = 0;  // generated
  double tokens_per_s = 0;
  double requests_per_s = 0;
  double ttft_p50 = 0, ttft_p90 = 0, ttft_p99 = 0;
  double itl_p50 = 0, itl_p90 = 0, itl_p99 = 0;
  double e2e_p50 = 0, e2e_p90 = 0, e2e_p99 = 0;
  // Each request's longest gap between two of its tokens (a stream's pause, e.g. while a lost
  // worker's requests are resumed elsewhere), over the requests.
  double pause_p50 = 0, pause_p99 = 0, pause_max = 0;
  double speedup = 0;     // tokens/s over the first node count's, same load, lengths, prefill
  double efficiency = 0;  // speedup / (nodes / first node count)
  bool has_gpu = false;
  double energy_j = 0;
  double power_w = 0;  // energy / wall
  double tokens_per_joule = 0;
  double peak_gpu_memory_bytes = 0;
  std::map<int, StageShare> stage_share;  // by stage index
  // What the workers computed in, from their tandem_worker_precision_info ("cuda f16, weights
  // fp8"; distinct settings joined by "; "); "" where no worker said.
  std::string precision;
  // The largest tensor-parallel size of the workers (the same series' tensor_parallel label); 0
  // where no worker said.
  int tensor_parallel = 0;
  bool correct = true;
  int mismatches = 0;  // outputs that differ from their reference at a clear gap (or unjudged)
  int near_ties = 0;   // outputs that differ from their reference at a near-tie
  int unchecked = 0;   // outputs the API named no token of (text without a tokenizer)
  std::vector<Difference> differences;  // every differing output, grouped
};

// A run's accuracy, where its folder has an accuracy.json (written beside the sweep, e.g. by
// `tandem-bench --agreement --json` for the workers' precision): NaN where not given.
struct RunAccuracy {
  double kl_mean = NAN;         // "agreement"."kl_mean": KL(fp16 || this precision), nats
  double top1_agreement = NAN;  // "agreement"."top1_agreement": 0..1
  double perplexity = NAN;      // "perplexity": held-out perplexity (tools/accuracy)
};

struct SweepResult {
  SweepOptions options;
  std::optional<RunAccuracy> accuracy;  // read from the run folder's accuracy.json, where present
  ServedModel server;  // the model and the server's settings, as it told them at the start
  std::vector<ConfigResult> configs;
  bool all_correct = true;
  // The reference of the correctness check: each prompt generated alone (batch 1), with top-2
  // logprobs, on the first layout, before the measured runs. False where no reference had a gap.
  bool reference_has_gaps = false;
  std::vector<std::string> warnings;  // about what the figures mean (e.g. a batch above the slots)
};

// A warning when a closed-loop `batch` is more than the sequences `replicas` pipelines of `server`
// run at once: the rest wait in the queue, so the row measures queueing as much as the batch.
// "" otherwise, or when the server did not say its slots.
std::string SlotWarning(const ServedModel& server, int batch, int replicas);

// p-th percentile (0..100, linear interpolation) of `v`; 0 for an empty vector.
double Percentile(std::vector<double> v, double p);

// GPU energy (joules) used during a configuration, from each worker's /metrics scraped before and
// after it (one entry per worker, in the same order; empty where a scrape failed): the growth of
// tandem_gpu_energy_joules_total, counted once per GPU uuid, over the GPUs of the workers whose
// tandem_stage_compute_seconds grew (the workers the topology used); over every worker's GPUs
// when none reports compute time. Nullopt when no worker reports a GPU.
std::optional<double> GpuEnergyOfActiveWorkers(const std::vector<std::vector<MetricSample>>& before,
                                               const std::vector<std::vector<MetricSample>>& after);

// The workers' precision from their /metrics (one scrape per worker): each worker's
// tandem_worker_precision_info labels as "BACKEND DTYPE, weights WEIGHTS" ("as stored" for
// as_stored), distinct ones in order joined by "; "; "" where no worker has the series.
std::string WorkerPrecision(const std::vector<std::vector<MetricSample>>& each);
// The largest tensor_parallel label of the workers' tandem_worker_precision_info; 0 where none
// has it (or it is not a positive number).
int WorkerTensorParallel(const std::vector<std::vector<MetricSample>>& each);

// Several run folders' results side by side (tandem-loadgen compare), one markdown row per run and
// configuration: the run (its folder's name), the precision the workers reported, the KV-cache
// dtype, the load, tokens/s and its ratio to the first run's configuration of the same nodes,
// load and lengths, latency, power, tokens/J, peak GPU memory, correctness, and the run's
// accuracy (KL and top-1 agreement against fp16, perplexity) where its folder has it.
std::string CompareRuns(const std::vector<SweepResult>& runs);

// A closed loop: `clients` clients that start together, each calling `send(i, client)` for the
// next request index i in [0, count) once its last has returned; `waiting`, where given, is
// called about every 100 ms meanwhile. Returns the seconds from their start until the last send
// returned (the clients' threads ending after it are not counted).
double RunClosedLoop(int clients, int count, const std::function<void(int i, int client)>& send,
                     const std::function<void()>& waiting = nullptr);
// An open loop: `count` calls of `send(i)`, each on a thread of its own, started at Poisson
// arrival times of `rate` per second (exponential gaps drawn from `seed`). Returns the seconds
// from the first start until the last send returned; `waiting` as for RunClosedLoop.
double RunOpenLoop(int count, double rate, uint64_t seed, const std::function<void(int i)>& send,
                   const std::function<void()>& waiting = nullptr);

absl::Status ValidateSweepOptions(const SweepOptions& o);
// Runs the sweep. The layout the service was asked for when it began (where the API tells it) is
// set again when it ends, also when it fails; a layout that cannot be served fails it at once with
// the coordinator's reason.
absl::StatusOr<SweepResult> RunSweep(const SweepOptions& o);
// "pass", "FAIL", or "not checked" when no output could be compared (the API named no tokens).
std::string CorrectnessWord(const SweepResult& r);
// results.csv, results.json, summary.md and the gnuplot PNGs in o.out.
absl::Status WriteReport(const SweepResult& r);
// The largest results.json that ReadResults reads: a sweep's results hold every configuration and
// difference, far less than this.
inline constexpr uintmax_t kMaxResultsJsonBytes = uintmax_t{256} << 20;
// The largest accuracy.json that ReadResults reads beside it (a few figures).
inline constexpr uintmax_t kMaxAccuracyJsonBytes = uintmax_t{1} << 20;

// A run folder's results.json read back (options.out = `dir`), so that the report and the plots
// can be made again, e.g. on a machine with gnuplot, with its accuracy.json where there is one.
// Errors name the file and the field; a results.json larger than `max_results_bytes` or an
// accuracy.json larger than kMaxAccuracyJsonBytes is refused naming the file and the limit.
absl::StatusOr<SweepResult> ReadResults(const std::filesystem::path& dir,
                                        uintmax_t max_results_bytes = kMaxResultsJsonBytes);

}  // namespace tandem::loadgen
