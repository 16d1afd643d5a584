// tandem-loadgen: scaling studies of a running deployment.
//   tandem-loadgen sweep --addr HOST:PORT --worker_metrics H:P,H:P --nodes 1,2 --batch 1,2,4,8
//                        [--mode open --rates 1,2,4] [--scaling weak] --out runs/NAME
//   tandem-loadgen report runs/NAME   (summary.md and plots again from its results.json)
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/flags_usage.h"
#include "common/security/credentials.h"
#include "common/security/tls_flags.h"
#include "loadgen/sweep.h"

ABSL_FLAG(std::string, addr, "127.0.0.1:50051",
          "the coordinator's host:port (--api openai: the server's http://host:port or "
          "https://host:port)");
ABSL_FLAG(std::string, api, "grpc", "grpc (tandem's API) or openai (any OpenAI-compatible server)");
ABSL_FLAG(std::string, model, "", "--api openai: the model to name (default: the first listed)");
ABSL_FLAG(std::string, admin, "",
          "--api openai: tandem's gRPC host:port, for --nodes and the vocabulary");
ABSL_FLAG(std::vector<std::string>, worker_metrics, {},
          "the workers' /metrics host:port, comma-separated (energy, stage times, GPU memory)");
ABSL_FLAG(std::vector<std::string>, nodes, {"1"},
          "node counts, comma-separated; the first is "
          "the baseline of speedup, and the correctness check's reference runs are made on it");
ABSL_FLAG(std::string, parallelism, "pipeline",
          "how nodes are used: pipeline (stages), data (replicas of one stage) or tensor (ranks of "
          "one stage: GPUs of one worker started with --tensor_parallel of at least the largest "
          "node count)");
ABSL_FLAG(int, tensor_parallel, 0,
          "with --parallelism pipeline or data: ranks each stage is split over (0: each worker's "
          "own --tensor_parallel)");
ABSL_FLAG(std::vector<std::string>, prefill_nodes, {"0"},
          "--parallelism data: of each node count's replicas, those that run prompts only and "
          "hand the KV-cache to the others, which decode, comma-separated (0: every replica does "
          "both; the first, with the first node count, is where the correctness check's "
          "reference runs are made)");
ABSL_FLAG(std::string, mode, "closed", "closed (fixed concurrency) or open (Poisson arrivals)");
ABSL_FLAG(std::vector<std::string>, batch, std::vector<std::string>({"1", "2", "4", "8"}), "closed loop: requests in flight");
ABSL_FLAG(std::vector<std::string>, rates, {}, "open loop: arrival rates, requests/s");
ABSL_FLAG(std::vector<std::string>, prompt_lens, {"32"}, "prompt lengths in tokens");
ABSL_FLAG(std::vector<std::string>, output_lens, {"32"}, "generated tokens per request");
ABSL_FLAG(int, requests, 32, "measured requests per configuration (per node with weak scaling)");
ABSL_FLAG(std::string, scaling, "strong", "strong (fixed work) or weak (work grows with nodes)");
ABSL_FLAG(int, warmup, 4, "unmeasured requests before each configuration");
ABSL_FLAG(int, prompt_pool, 16, "distinct prompts");
ABSL_FLAG(std::string, workload, "fixed",
          "fixed (every prompt of --prompt_lens), mixed (prompt and output lengths from seeded "
          "lognormals whose medians are --prompt_lens/--output_lens, clipped to the context) or "
          "shared_prefix (a --shared_prefix_len system prompt shared by every request, then a "
          "suffix of --prompt_lens tokens of each request's own)");
ABSL_FLAG(double, length_sigma, 1.0,
          "--workload mixed: sigma of the lognormal lengths (1: a tail to ~10x the median)");
ABSL_FLAG(int, shared_prefix_len, 1000, "--workload shared_prefix: tokens of the system prompt");
ABSL_FLAG(uint64_t, seed, 1, "prompt seed");
ABSL_FLAG(double, request_timeout_s, 300, "deadline of one request");
ABSL_FLAG(bool, connection_per_client, false,
          "gRPC: each closed-loop client on a connection of its own, as separate users would be "
          "(open loop: each request, up to 64 connections); default: every request on one");
ABSL_FLAG(double, tie_tolerance, tandem::loadgen::kDefaultTieTolerance,
          "the correctness check: a greedy output that first differs from its prompt's reference "
          "run where the reference's top-2 logprob gap is below this many nats is a near-tie (fp16 "
          "reduction order), listed but not a failure; 0: outputs must be identical");
ABSL_FLAG(bool, check, true,
          "the correctness check against reference runs of each prompt; --check=false skips the "
          "reference runs (capacity runs), and the outputs are reported as not checked");
ABSL_FLAG(std::string, out, "", "run folder (default: runs/sweep-YYYYmmdd-HHMMSS)");
ABSL_FLAG(
    bool, progress, true,
    "show progress on stderr: a line rewritten in place on a terminal, plain lines otherwise");
ABSL_FLAG(std::string, api_key, "",
          "key for Inference (and the OpenAI API's Bearer token) (env TANDEM_API_KEY)");
ABSL_FLAG(std::string, admin_key, "",
          "key for Admin, for --nodes (env TANDEM_ADMIN_KEY; empty: the --api_key)");

namespace {

template <typename T>
bool ParseList(const char* flag, const std::vector<std::string>& in, std::vector<T>* out) {
  out->clear();
  for (const std::string& s : in) {
    T v{};
    bool ok;
    if constexpr (std::is_same_v<T, int>) {
      ok = absl::SimpleAtoi(s, &v);
    } else {
      ok = absl::SimpleAtod(s, &v);
    }
    if (!ok) {
      std::fprintf(stderr, "error: --%s: '%s' is not a number\n", flag, s.c_str());
      return false;
    }
    out->push_back(v);
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  tandem::SetProgramUsage(
      "tandem-loadgen sweep --addr HOST:PORT [--worker_metrics H:P,...] [--nodes 1,2] "
      "[--batch 1,2,4,8 | --mode open --rates 1,2] [--out DIR]");
  std::vector<char*> args = tandem::ParseFlags(argc, argv);
  if (args.size() == 3 && std::string(args[1]) == "report") {
    // The report and plots of an existing run folder, made again from its results.json.
    absl::StatusOr<tandem::loadgen::SweepResult> r = tandem::loadgen::ReadResults(args[2]);
    if (!r.ok()) {
      std::fprintf(stderr, "error: %s\n", std::string(r.status().message()).c_str());
      return 2;
    }
    if (absl::Status s = tandem::loadgen::WriteReport(*r); !s.ok()) {
      std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
      return 1;
    }
    std::printf("run folder: %s\n", args[2]);
    return 0;
  }
  if (args.size() >= 3 && std::string(args[1]) == "compare") {
    // Run folders side by side (e.g. one sweep per precision), as a markdown table on stdout.
    std::vector<tandem::loadgen::SweepResult> runs;
    for (size_t i = 2; i < args.size(); ++i) {
      absl::StatusOr<tandem::loadgen::SweepResult> r = tandem::loadgen::ReadResults(args[i]);
      if (!r.ok()) {
        std::fprintf(stderr, "error: %s\n", std::string(r.status().message()).c_str());
        return 2;
      }
      runs.push_back(*std::move(r));
    }
    std::fputs(tandem::loadgen::CompareRuns(runs).c_str(), stdout);
    return 0;
  }
  if (args.size() != 2 || std::string(args[1]) != "sweep") {
    std::fprintf(stderr,
                 "usage: tandem-loadgen sweep [flags] (see --help)\n"
                 "       tandem-loadgen report RUN_FOLDER (summary.md and plots from its "
                 "results.json)\n"
                 "       tandem-loadgen compare RUN_FOLDER... (the runs side by side, e.g. one "
                 "per precision: a markdown table on stdout)\n");
    return 2;
  }
  tandem::loadgen::SweepOptions o;
  o.coordinator = absl::GetFlag(FLAGS_addr);
  o.api = absl::GetFlag(FLAGS_api);
  o.model = absl::GetFlag(FLAGS_model);
  o.admin = absl::GetFlag(FLAGS_admin);
  o.worker_metrics = absl::GetFlag(FLAGS_worker_metrics);
  if (!ParseList("nodes", absl::GetFlag(FLAGS_nodes), &o.nodes) ||
      !ParseList("batch", absl::GetFlag(FLAGS_batch), &o.batch) ||
      !ParseList("rates", absl::GetFlag(FLAGS_rates), &o.rates) ||
      !ParseList("prompt_lens", absl::GetFlag(FLAGS_prompt_lens), &o.prompt_lens) ||
      !ParseList("output_lens", absl::GetFlag(FLAGS_output_lens), &o.output_lens)) {
    return 2;
  }
  const std::string parallelism = absl::GetFlag(FLAGS_parallelism);
  if (parallelism != "pipeline" && parallelism != "data" && parallelism != "tensor") {
    std::fprintf(stderr, "error: --parallelism: '%s' is none of pipeline, data, tensor\n",
                 parallelism.c_str());
    return 2;
  }
  o.data_parallel = parallelism == "data";
  o.tensor_nodes = parallelism == "tensor";
  o.tensor_parallel = absl::GetFlag(FLAGS_tensor_parallel);
  if (o.tensor_parallel < 0 || (o.tensor_nodes && o.tensor_parallel > 0)) {
    std::fprintf(stderr,
                 "error: --tensor_parallel %d: must be >= 0, and is the node count itself with "
                 "--parallelism tensor\n",
                 o.tensor_parallel);
    return 2;
  }
  if (!ParseList("prefill_nodes", absl::GetFlag(FLAGS_prefill_nodes), &o.prefill_nodes)) return 2;
  o.mode = absl::GetFlag(FLAGS_mode);
  const std::string scaling = absl::GetFlag(FLAGS_scaling);
  if (scaling != "strong" && scaling != "weak") {
    std::fprintf(stderr, "error: --scaling: '%s' is neither strong nor weak\n", scaling.c_str());
    return 2;
  }
  o.weak_scaling = scaling == "weak";
  o.requests = absl::GetFlag(FLAGS_requests);
  o.warmup = absl::GetFlag(FLAGS_warmup);
  o.prompt_pool = absl::GetFlag(FLAGS_prompt_pool);
  o.workload.kind = absl::GetFlag(FLAGS_workload);
  o.workload.length_sigma = absl::GetFlag(FLAGS_length_sigma);
  o.workload.shared_prefix_len = absl::GetFlag(FLAGS_shared_prefix_len);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.request_timeout_s = absl::GetFlag(FLAGS_request_timeout_s);
  o.connection_per_client = absl::GetFlag(FLAGS_connection_per_client);
  o.progress = absl::GetFlag(FLAGS_progress);
  o.tie_tolerance = absl::GetFlag(FLAGS_tie_tolerance);
  o.check = absl::GetFlag(FLAGS_check);
  o.out = absl::GetFlag(FLAGS_out);
  {
    const std::string api_key = tandem::FlagOrEnv(absl::GetFlag(FLAGS_api_key), "TANDEM_API_KEY");
    std::string admin_key = tandem::FlagOrEnv(absl::GetFlag(FLAGS_admin_key), "TANDEM_ADMIN_KEY");
    if (admin_key.empty()) admin_key = api_key;
    const tandem::TlsFiles tls = tandem::TlsFilesFromFlags();
    absl::StatusOr<tandem::ClientAuth> inference = tandem::MakeClientAuth(tls, api_key);
    absl::StatusOr<tandem::ClientAuth> admin = tandem::MakeClientAuth(tls, admin_key);
    if (!inference.ok() || !admin.ok()) {
      std::fprintf(stderr, "error: %s\n",
                   std::string((inference.ok() ? admin : inference).status().message()).c_str());
      return 2;
    }
    o.inference_auth = *std::move(inference);
    o.admin_auth = *std::move(admin);
    o.tls_ca = tls.ca;
  }
  if (o.out.empty()) {
    o.out = absl::StrCat("runs/sweep-",
                         absl::FormatTime("%Y%m%d-%H%M%S", absl::Now(), absl::LocalTimeZone()));
  }
  if (absl::Status s = tandem::loadgen::ValidateSweepOptions(o); !s.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  absl::StatusOr<tandem::loadgen::SweepResult> r = tandem::loadgen::RunSweep(o);
  if (!r.ok()) {
    std::fprintf(stderr, "error: %s\n", r.status().ToString().c_str());
    return 1;
  }
  if (absl::Status s = tandem::loadgen::WriteReport(*r); !s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  }
  int outputs = 0, unchecked = 0, near_ties = 0;
  for (const tandem::loadgen::ConfigResult& c : r->configs) {
    outputs += c.requests - c.errors;
    unchecked += c.unchecked;
    near_ties += c.near_ties;
  }
  std::string detail;
  if (near_ties > 0) detail = absl::StrCat(near_ties, " near-ties");
  if (unchecked > 0) {
    absl::StrAppend(&detail, detail.empty() ? "" : ", ", unchecked, " of ", outputs,
                    " outputs not checked");
  }
  std::printf("run folder: %s\ncorrectness: %s%s\n", o.out.string().c_str(),
              tandem::loadgen::CorrectnessWord(*r).c_str(),
              detail.empty() ? "" : absl::StrCat(" (", detail, "; see summary.md)").c_str());
  return r->all_correct ? 0 : 3;
}
