// Running a sweep: topology changes, load generation, scrapes and the correctness check.
#include "loadgen/sweep.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/metrics.h"
#include "loadgen/load_client.h"
#include "loadgen/workload.h"

namespace tandem::loadgen {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

// All workers' samples; a worker that cannot be read contributes none.
// Each worker's samples, in `workers` order (empty where the scrape failed).
std::vector<std::vector<MetricSample>> ScrapeEach(const std::vector<std::string>& workers) {
  std::vector<std::vector<MetricSample>> each(workers.size());
  for (size_t i = 0; i < workers.size(); ++i) {
    absl::StatusOr<std::string> page = FetchMetricsPage(workers[i], absl::Seconds(2));
    if (!page.ok()) continue;
    absl::StatusOr<std::vector<MetricSample>> s = ParseMetricsText(*page);
    if (s.ok()) each[i] = *std::move(s);
  }
  return each;
}

std::vector<MetricSample> Flatten(const std::vector<std::vector<MetricSample>>& each) {
  std::vector<MetricSample> all;
  for (const auto& s : each) all.insert(all.end(), s.begin(), s.end());
  return all;
}

std::vector<MetricSample> ScrapeAll(const std::vector<std::string>& workers) {
  return Flatten(ScrapeEach(workers));
}

std::map<int, StageShare> Shares(const std::vector<MetricSample>& s) {
  std::map<int, StageShare> out;
  for (const MetricSample& m : s) {
    auto it = m.labels.find("stage");
    if (it == m.labels.end()) continue;
    const int stage = std::atoi(it->second.c_str());
    if (m.name == "tandem_stage_compute_seconds_sum") out[stage].compute_s += m.value;
    if (m.name == "tandem_stage_transfer_seconds_sum") out[stage].transfer_s += m.value;
    if (m.name == "tandem_stage_transfer_bytes_total") out[stage].bytes += m.value;
  }
  return out;
}

// Reads the workers' power and memory while a configuration runs.
class Poller {
 public:
  explicit Poller(std::vector<std::string> workers) : workers_(std::move(workers)) {
    if (workers_.empty()) return;
    thread_ = std::thread([this] {
      while (!stop_.load()) {
        for (const MetricSample& m : ScrapeAll(workers_)) {
          if (m.name == "tandem_gpu_memory_used_bytes") {
            absl::MutexLock lock(&mu_);
            peak_memory_ = std::max(peak_memory_, m.value);
          }
        }
        for (int i = 0; i < 10 && !stop_.load(); ++i) absl::SleepFor(absl::Milliseconds(25));
      }
    });
  }
  ~Poller() { Stop(); }
  void Stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  double peak_memory() {
    absl::MutexLock lock(&mu_);
    return peak_memory_;
  }

 private:
  const std::vector<std::string> workers_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  absl::Mutex mu_;
  double peak_memory_ = 0;
};

// Progress on stderr. On a terminal one line is rewritten in place (a carriage return and an
// erase-line escape); anywhere else (a log file, a pipe) plain lines, one for each new phase and
// otherwise at most one per kPlainInterval, so that a log holds neither escapes nor a line per
// 100 ms.
class Progress {
 public:
  Progress(bool on, bool terminal) : on_(on), terminal_(terminal) {}
  // `line`: the state now. `news`: a new phase, written at once also when not on a terminal.
  void Show(const std::string& line, bool news = false) {
    if (!on_) return;
    if (terminal_) {
      std::fprintf(stderr, "\r\033[K%s", line.c_str());
      std::fflush(stderr);
      shown_ = true;
      return;
    }
    const Clock::time_point now = Clock::now();
    if (!news && now - last_ < kPlainInterval) return;
    last_ = now;
    std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  }
  void Done() {
    if (on_ && terminal_ && shown_) std::fprintf(stderr, "\n");
  }

 private:
  static constexpr std::chrono::seconds kPlainInterval{10};
  const bool on_;
  const bool terminal_;
  bool shown_ = false;
  Clock::time_point last_;
};

}  // namespace

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = p / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

std::string WorkerPrecision(const std::vector<std::vector<MetricSample>>& each) {
  std::vector<std::string> seen;
  for (const std::vector<MetricSample>& samples : each) {
    for (const MetricSample& m : samples) {
      if (m.name != "tandem_worker_precision_info" || m.value <= 0) continue;
      auto label = [&](const char* key) {
        auto it = m.labels.find(key);
        return it == m.labels.end() ? std::string("?") : it->second;
      };
      const std::string weights = label("weights");
      const std::string p = absl::StrCat(label("backend"), " ", label("dtype"), ", weights ",
                                         weights == "as_stored" ? "as stored" : weights);
      if (std::find(seen.begin(), seen.end(), p) == seen.end()) seen.push_back(p);
    }
  }
  return absl::StrJoin(seen, "; ");
}

int WorkerTensorParallel(const std::vector<std::vector<MetricSample>>& each) {
  int most = 0;
  for (const std::vector<MetricSample>& samples : each) {
    for (const MetricSample& m : samples) {
      if (m.name != "tandem_worker_precision_info" || m.value <= 0) continue;
      auto it = m.labels.find("tensor_parallel");
      int n = 0;
      if (it != m.labels.end() && absl::SimpleAtoi(it->second, &n) && n > 0)
        most = std::max(most, n);
    }
  }
  return most;
}

std::optional<double> GpuEnergyOfActiveWorkers(
    const std::vector<std::vector<MetricSample>>& before,
    const std::vector<std::vector<MetricSample>>& after) {
  auto compute = [](const std::vector<MetricSample>& s) {
    return SumSamples(s, "tandem_stage_compute_seconds_sum");
  };
  std::vector<bool> active(after.size(), false);
  bool any_active = false;
  for (size_t i = 0; i < after.size(); ++i) {
    const double was = i < before.size() ? compute(before[i]) : 0;
    active[i] = compute(after[i]) > was;
    any_active |= active[i];
  }
  // joules by GPU uuid, before and after (several workers may report one GPU)
  std::map<std::string, double> e0, e1;
  auto collect = [](const std::vector<MetricSample>& s, std::map<std::string, double>& out) {
    for (const MetricSample& m : s) {
      if (m.name != "tandem_gpu_energy_joules_total") continue;
      auto uuid = m.labels.find("uuid");
      out[uuid != m.labels.end() ? uuid->second : ""] = m.value;
    }
  };
  for (size_t i = 0; i < after.size(); ++i) {
    if (any_active && !active[i]) continue;
    collect(after[i], e1);
    if (i < before.size()) collect(before[i], e0);
  }
  if (e1.empty()) return std::nullopt;
  double joules = 0;
  for (const auto& [uuid, j] : e1) joules += j - (e0.count(uuid) ? e0.at(uuid) : 0);
  return joules;
}

absl::Status ValidateSweepOptions(const SweepOptions& o) {
  if (o.api != "grpc" && o.api != "openai") {
    return absl::InvalidArgumentError(
        absl::StrCat("--api: '", o.api, "' is neither grpc nor openai"));
  }
  if (o.api == "openai" && !absl::StartsWith(o.coordinator, "http://") &&
      !absl::StartsWith(o.coordinator, "https://")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--addr: '", o.coordinator,
                     "' must be http://host:port or https://host:port with --api openai"));
  }
  if (o.api == "openai" && o.admin.empty() &&
      std::any_of(o.nodes.begin(), o.nodes.end(), [](int n) { return n != 1; })) {
    return absl::InvalidArgumentError(
        "--nodes: an OpenAI server cannot be re-partitioned without tandem's gRPC Admin; give "
        "--admin HOST:PORT or --nodes 1");
  }
  if (o.nodes.empty()) return absl::InvalidArgumentError("--nodes: empty");
  for (int n : o.nodes) {
    if (n < 1) return absl::InvalidArgumentError(absl::StrCat("--nodes: ", n, " is < 1"));
  }
  if (o.prefill_nodes.empty()) return absl::InvalidArgumentError("--prefill_nodes: empty");
  for (int p : o.prefill_nodes) {
    if (p < 0) return absl::InvalidArgumentError(absl::StrCat("--prefill_nodes: ", p, " is < 0"));
    if (p == 0) continue;
    if (!o.data_parallel) {
      return absl::InvalidArgumentError(
          "--prefill_nodes: prompts run on replicas of their own; needs --parallelism data");
    }
    for (int n : o.nodes) {
      if (n <= p) {
        return absl::InvalidArgumentError(
            absl::StrCat("--prefill_nodes: ", p, " leaves none of --nodes ", n, " to decode"));
      }
    }
  }
  if (o.mode != "closed" && o.mode != "open") {
    return absl::InvalidArgumentError(
        absl::StrCat("--mode: '", o.mode, "' is neither closed nor open"));
  }
  if (o.mode == "closed" && o.batch.empty()) return absl::InvalidArgumentError("--batch: empty");
  for (int b : o.batch) {
    if (b < 1) return absl::InvalidArgumentError(absl::StrCat("--batch: ", b, " is < 1"));
  }
  if (o.mode == "open" && o.rates.empty()) return absl::InvalidArgumentError("--rates: empty");
  for (double r : o.rates) {
    if (!(r > 0)) return absl::InvalidArgumentError(absl::StrCat("--rates: ", r, " is not > 0"));
  }
  if (o.prompt_lens.empty() || o.output_lens.empty()) {
    return absl::InvalidArgumentError("--prompt_lens/--output_lens: empty");
  }
  for (int n : o.prompt_lens) {
    if (n < 1) return absl::InvalidArgumentError(absl::StrCat("--prompt_lens: ", n, " is < 1"));
  }
  for (int n : o.output_lens) {
    if (n < 1) return absl::InvalidArgumentError(absl::StrCat("--output_lens: ", n, " is < 1"));
  }
  if (o.requests < 1) return absl::InvalidArgumentError("--requests: must be >= 1");
  if (o.warmup < 0) return absl::InvalidArgumentError("--warmup: must be >= 0");
  if (o.prompt_pool < 1) return absl::InvalidArgumentError("--prompt_pool: must be >= 1");
  if (absl::Status s = ValidateWorkload(o.workload); !s.ok()) return s;
  if (!(o.tie_tolerance >= 0) || std::isinf(o.tie_tolerance)) {
    return absl::InvalidArgumentError(absl::StrCat("--tie_tolerance: ", o.tie_tolerance,
                                                   " is not a gap in nats >= 0 (0: outputs must be "
                                                   "identical)"));
  }
  if (o.out.empty()) return absl::InvalidArgumentError("--out: the run folder is required");
  return absl::OkStatus();
}

namespace {

// Prompt ids stay below this when the server says nothing of its vocabulary.
constexpr int kForeignVocab = 1000;

// Every prompt + output length pair fits the model's context (where the server says it); with
// a shared prefix, after it. Mixed lengths are clipped to the context instead.
absl::Status CheckLengthsFit(const SweepOptions& o, const ServedModel& info) {
  if (info.context_length <= 0 || o.workload.kind == "mixed") return absl::OkStatus();
  const int prefix = o.workload.kind == "shared_prefix" ? o.workload.shared_prefix_len : 0;
  for (int p : o.prompt_lens) {
    for (int g : o.output_lens) {
      if (prefix + p + g > info.context_length) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "--shared_prefix_len/--prompt_lens/--output_lens: %d + %d + %d exceeds the model's "
            "context of %d",
            prefix, p, g, info.context_length));
      }
    }
  }
  return absl::OkStatus();
}

// One configuration's place in the sweep, for its requests and its progress line.
struct Point {
  int index = 0;  // 1-based, in sweep order
  std::string label;
};

// The requests of one run: what each returned and which pooled prompt it sent.
struct LoadRun {
  std::vector<RequestRecord> records;
  std::vector<int> prompt_ids;
  double wall_s = 0;  // first request sent to last answer
};

// Sends `count` requests of configuration `c`: closed loop, c.batch clients each sending its next
// request when the last is answered; open loop, Poisson arrivals at c.rate requests per second.
LoadRun DriveLoad(LoadClient& client, const SweepOptions& o, const ConfigResult& c,
                  const Point& point, const std::vector<WorkloadItem>& pool, int count,
                  Progress* progress) {
  LoadRun run;
  run.records.assign(count, {});
  run.prompt_ids.assign(count, 0);
  std::atomic<int> done{0};
  // With o.connection_per_client, each closed-loop client, and each open-loop request up to a
  // pool of them, on a connection of its own.
  constexpr int kOpenLoopConnections = 64;
  auto one = [&](int i, int connection) {
    const int pid = i % o.prompt_pool;
    run.prompt_ids[i] = pid;
    run.records[i] = client.Generate(pool[pid].prompt, pool[pid].output_len,
                                     o.connection_per_client ? connection : 0, 0);
    done.fetch_add(1);
  };
  const Clock::time_point t0 = Clock::now();
  std::function<void()> waiting;
  if (progress != nullptr) {
    waiting = [&] {
      progress->Show(absl::StrFormat("%s: %d/%d requests, %.1f s", point.label, done.load(), count,
                                     Since(t0, Clock::now())));
    };
  }
  if (o.mode == "closed") {
    run.wall_s = RunClosedLoop(std::min(c.batch, count), count, one, waiting);
  } else {
    run.wall_s = RunOpenLoop(count, c.rate, o.seed + point.index,
                             [&](int i) { one(i, i % kOpenLoopConnections); }, waiting);
  }
  return run;
}

// The reference of the correctness check, by (prompt_len, output_len, prompt index).
using References = std::map<std::tuple<int, int, int>, GreedyOutput>;

// The most requests one configuration measures.
int MaxRequests(const SweepOptions& o) {
  const int most_nodes = *std::max_element(o.nodes.begin(), o.nodes.end());
  return std::max(o.requests * (o.weak_scaling ? most_nodes / o.nodes.front() : 1), 1);
}

// Every prompt the measured requests send, generated alone (one request at a time) on the layout
// that serves (the first), with top-2 logprobs: the reference each measured output is judged
// against. Its requests are not measured, so asking for logprobs costs the measured ones
// nothing. A request that fails fails the sweep: the service cannot serve what it is asked.
absl::StatusOr<References> RunReferences(LoadClient& client, const SweepOptions& o, int vocab,
                                         Progress& progress, SweepResult& result) {
  const int prompts = std::min(o.prompt_pool, MaxRequests(o));
  const int total = prompts * static_cast<int>(o.prompt_lens.size() * o.output_lens.size());
  References refs;
  int tokens = 0, unnamed = 0;
  progress.Show(
      absl::StrFormat("reference: %d prompt(s), one at a time, with top-2 logprobs", total), true);
  for (int prompt_len : o.prompt_lens) {
    for (int output_len : o.output_lens) {
      const std::vector<WorkloadItem> pool =
          MakeWorkloadPool(o.workload, o.seed, prompt_len, output_len, o.prompt_pool, vocab,
                           result.server.context_length);
      for (int pid = 0; pid < prompts; ++pid) {
        progress.Show(absl::StrFormat("reference: %d/%d", refs.size(), total));
        RequestRecord r = client.Generate(pool[pid].prompt, pool[pid].output_len, 0, 2);
        if (!r.ok) {
          return absl::UnavailableError(
              absl::StrFormat("the reference run of prompt %d (%d + %d tokens) failed: %s", pid,
                              pool[pid].prompt.size(), pool[pid].output_len, r.error));
        }
        tokens += r.num_tokens;
        unnamed += static_cast<int>(std::count(r.unnamed.begin(), r.unnamed.end(), true));
        refs.emplace(std::make_tuple(prompt_len, output_len, pid),
                     GreedyOutput{.tokens = std::move(r.tokens),
                                  .top2_gaps = std::move(r.top2_gaps),
                                  .unnamed = std::move(r.unnamed)});
      }
    }
  }
  if (unnamed > 0) {
    const std::string warning = absl::StrFormat(
        "the OpenAI API names tokens by their text only, and %d of the reference's %d tokens have "
        "none (ids the model's tokenizer does not decode): an output whose first visible "
        "difference follows such a token is not checked (the difference may have begun there), "
        "so the check is partial; --api grpc compares token ids",
        unnamed, tokens);
    std::fprintf(stderr, "warning: %s\n", warning.c_str());
    result.warnings.push_back(warning);
  }
  return refs;
}

// Counts `v` (a differing output of prompt `prompt`) in `c`, grouped with the same difference.
void AddDifference(int prompt, const Verdict& v, ConfigResult& c) {
  for (Difference& d : c.differences) {
    if (d.prompt == prompt && d.verdict.position == v.position && d.verdict.token == v.token &&
        d.verdict.reference_token == v.reference_token) {
      ++d.requests;
      return;
    }
  }
  c.differences.push_back({.prompt = prompt, .requests = 1, .verdict = v});
}

// Token counts, rates, latency percentiles, errors and the correctness check of a measured run:
// each output judged against its prompt's reference.
void SummarizeRequests(const LoadRun& run, const SweepOptions& o, const Point& point,
                       const References& references, ConfigResult& c) {
  std::vector<double> ttft, itl, e2e, pause;
  std::set<std::string> error_kinds;  // a few distinct messages, so failures say why
  for (size_t i = 0; i < run.records.size(); ++i) {
    const RequestRecord& r = run.records[i];
    if (!r.ok) {
      ++c.errors;
      if (error_kinds.size() < 3) error_kinds.insert(r.error);
      continue;
    }
    c.tokens += r.num_tokens;
    ttft.push_back(r.ttft);
    e2e.push_back(r.e2e);
    itl.insert(itl.end(), r.gaps.begin(), r.gaps.end());
    pause.push_back(r.gaps.empty() ? 0.0 : *std::max_element(r.gaps.begin(), r.gaps.end()));
    auto ref = references.find(std::make_tuple(c.prompt_len, c.output_len, run.prompt_ids[i]));
    if (ref == references.end()) {
      if (!o.check) ++c.unchecked;
      continue;
    }
    const Verdict v = JudgeGreedy(ref->second, r.tokens, o.tie_tolerance);
    switch (v.agreement) {
      case Agreement::kIdentical:
        break;
      case Agreement::kUnchecked:
        ++c.unchecked;
        if (v.position >= 0) AddDifference(run.prompt_ids[i], v, c);
        break;
      case Agreement::kNearTie:
        ++c.near_ties;
        AddDifference(run.prompt_ids[i], v, c);
        break;
      case Agreement::kDiffers:
      case Agreement::kNoGap:
        ++c.mismatches;
        AddDifference(run.prompt_ids[i], v, c);
        break;
    }
  }
  for (const std::string& e : error_kinds) {
    std::fprintf(stderr, "%s: %d of %d requests failed, e.g.: %s\n", point.label.c_str(),
                 c.errors, c.requests, e.c_str());
  }
  c.correct = c.mismatches == 0 && c.errors == 0;
  c.tokens_per_s = c.wall_s > 0 ? c.tokens / c.wall_s : 0;
  c.requests_per_s = c.wall_s > 0 ? (c.requests - c.errors) / c.wall_s : 0;
  c.ttft_p50 = Percentile(ttft, 50);
  c.ttft_p90 = Percentile(ttft, 90);
  c.ttft_p99 = Percentile(ttft, 99);
  c.itl_p50 = Percentile(itl, 50);
  c.itl_p90 = Percentile(itl, 90);
  c.itl_p99 = Percentile(itl, 99);
  c.e2e_p50 = Percentile(e2e, 50);
  c.e2e_p90 = Percentile(e2e, 90);
  c.e2e_p99 = Percentile(e2e, 99);
  c.pause_p50 = Percentile(pause, 50);
  c.pause_p99 = Percentile(pause, 99);
  c.pause_max = Percentile(pause, 100);
}

// GPU energy, power and peak memory, and each stage's compute and transfer time and bytes, from
// the workers' /metrics scraped before and after a measured run (and polled during it).
void AddResourceUse(const std::vector<std::vector<MetricSample>>& before_each,
                    const std::vector<std::vector<MetricSample>>& after_each,
                    double peak_memory_bytes, ConfigResult& c) {
  const std::optional<double> energy = GpuEnergyOfActiveWorkers(before_each, after_each);
  c.has_gpu = energy.has_value();
  c.energy_j = energy.value_or(0);
  if (c.has_gpu && c.wall_s > 0) c.power_w = c.energy_j / c.wall_s;
  if (c.energy_j > 0) c.tokens_per_joule = c.tokens / c.energy_j;
  c.peak_gpu_memory_bytes = peak_memory_bytes;
  c.precision = WorkerPrecision(before_each);
  c.tensor_parallel = WorkerTensorParallel(before_each);
  const std::map<int, StageShare> s0 = Shares(Flatten(before_each)),
                                  s1 = Shares(Flatten(after_each));
  for (const auto& [stage, sh] : s1) {
    StageShare d = sh;
    if (auto it = s0.find(stage); it != s0.end()) {
      d.compute_s -= it->second.compute_s;
      d.transfer_s -= it->second.transfer_s;
      d.bytes -= it->second.bytes;
    }
    // Only the stages this topology has (a worker keeps its old stage's series).
    if (stage < c.stages && d.compute_s > 0) c.stage_share[stage] = d;
  }
}

// One configuration on the current topology: warm-up at the same load (not measured), then the
// measured requests between two scrapes of the workers.
ConfigResult MeasureConfig(LoadClient& client, const SweepOptions& o,
                           const std::vector<WorkloadItem>& pool, ConfigResult c,
                           const Point& point, Progress& progress, const References& references) {
  progress.Show(absl::StrCat(point.label, o.warmup > 0 ? ": warm-up" : ": measuring"), true);
  if (o.warmup > 0) DriveLoad(client, o, c, point, pool, o.warmup, nullptr);
  const std::vector<std::vector<MetricSample>> before_each = ScrapeEach(o.worker_metrics);
  Poller poller(o.worker_metrics);
  const LoadRun run = DriveLoad(client, o, c, point, pool, c.requests, &progress);
  poller.Stop();
  const std::vector<std::vector<MetricSample>> after_each = ScrapeEach(o.worker_metrics);
  c.wall_s = run.wall_s;
  SummarizeRequests(run, o, point, references, c);
  AddResourceUse(before_each, after_each, poller.peak_memory(), c);
  progress.Show(absl::StrFormat("%s: %d requests in %.1f s, %.1f tokens/s, %d failed, %d differ "
                                "(%d at near-ties)",
                                point.label, c.requests, c.wall_s, c.tokens_per_s, c.errors,
                                c.mismatches + c.near_ties, c.near_ties),
                true);
  return c;
}

// Speedup and efficiency of every configuration against the first node count's at the same load
// and lengths.
void AddScaling(const SweepOptions& o, std::vector<ConfigResult>& configs) {
  for (ConfigResult& c : configs) {
    for (const ConfigResult& b : configs) {
      if (b.nodes == o.nodes.front() && b.prefill_nodes == c.prefill_nodes &&
          b.batch == c.batch && b.rate == c.rate &&
          b.prompt_len == c.prompt_len && b.output_len == c.output_len && b.tokens_per_s > 0) {
        c.speedup = c.tokens_per_s / b.tokens_per_s;
        c.efficiency = c.speedup / (static_cast<double>(c.nodes) / b.nodes);
      }
    }
  }
}

}  // namespace

std::string SlotWarning(const ServedModel& server, int batch, int replicas) {
  const int64_t slots = static_cast<int64_t>(server.max_slots) * replicas;
  if (server.max_slots <= 0 || batch <= slots) return "";
  return absl::StrFormat(
      "batch %d is more than the %d sequences the server runs at once (%d pipeline(s) x %d KV "
      "slots, the coordinator's --max_slots): the other %d requests wait in its queue, so this "
      "row measures queueing, not a batch of %d; give the coordinator --max_slots %d",
      batch, slots, replicas, server.max_slots, batch - slots, batch,
      (batch + replicas - 1) / replicas);
}

namespace {

// The clients' or requests' threads of a load: each call of `send` marks when it returned.
class Answers {
 public:
  void Mark() {
    absl::MutexLock lock(&mu_);
    ++answered_;
    last_ = std::max(last_, Clock::now());
  }
  // Calls `waiting` about every 100 ms until `count` have been answered (nothing without it).
  void Wait(int count, const std::function<void()>& waiting) {
    auto all = [&] { return answered_ >= count; };
    while (waiting) {
      {
        absl::MutexLock lock(&mu_);
        if (mu_.AwaitWithTimeout(absl::Condition(&all), absl::Milliseconds(100))) return;
      }
      waiting();
    }
  }
  // Seconds from `t0` to the last answer; 0 when none came.
  double Since(Clock::time_point t0) {
    absl::MutexLock lock(&mu_);
    return answered_ > 0 ? std::max(0.0, loadgen::Since(t0, last_)) : 0.0;
  }

 private:
  absl::Mutex mu_;
  int answered_ ABSL_GUARDED_BY(mu_) = 0;
  Clock::time_point last_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

double RunOpenLoop(int count, double rate, uint64_t seed, const std::function<void(int i)>& send,
                   const std::function<void()>& waiting) {
  Answers answers;
  std::vector<std::thread> threads;
  // Poisson arrivals: exponential gaps at `rate` requests per second.
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap(rate);
  const Clock::time_point t0 = Clock::now();
  double at = 0;
  for (int i = 0; i < count; ++i) {
    std::this_thread::sleep_until(
        t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(at)));
    threads.emplace_back([&, i] {
      send(i);
      answers.Mark();
    });
    at += gap(rng);
  }
  answers.Wait(count, waiting);
  for (std::thread& t : threads) t.join();
  return answers.Since(t0);
}

double RunClosedLoop(int clients, int count, const std::function<void(int i, int client)>& send,
                     const std::function<void()>& waiting) {
  std::atomic<int> next{0};
  Answers answers;
  // The clients start together, once every thread is up: the first round arrives as one burst,
  // as the rounds after it do, not spread over the threads' start-up.
  absl::BlockingCounter up(clients);
  absl::Notification go;
  std::vector<std::thread> threads;
  for (int k = 0; k < clients; ++k) {
    threads.emplace_back([&, k] {
      up.DecrementCount();
      go.WaitForNotification();
      for (int i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
        send(i, k);
        answers.Mark();
      }
    });
  }
  up.Wait();
  const Clock::time_point t0 = Clock::now();
  go.Notify();
  answers.Wait(count, waiting);
  for (std::thread& t : threads) t.join();
  return answers.Since(t0);
}

namespace {

std::string LayoutName(const Layout& l) {
  return absl::StrFormat("%d stage(s) x %d replica(s)%s%s", l.stages, l.replicas,
                         l.prefill > 0 ? absl::StrFormat(", %d of them prefill", l.prefill) : "",
                         l.tensor_parallel.value_or(0) > 0
                             ? absl::StrFormat(", %d rank(s) a stage", *l.tensor_parallel)
                             : "");
}

// The configurations of the sweep, in order, into `result`. `last_set`: the last layout asked
// of the service (so that the one found at the start can be set again).
absl::Status RunConfigs(LoadClient& client, const SweepOptions& o, Progress& progress,
                        SweepResult& result, std::optional<Layout>& last_set) {
  const ServedModel& info = result.server;
  const int vocab = info.vocab_size > 0 ? info.vocab_size : kForeignVocab;
  std::optional<References> references;
  const std::vector<double> loads =
      o.mode == "closed" ? std::vector<double>(o.batch.begin(), o.batch.end()) : o.rates;
  const int total = static_cast<int>(o.nodes.size() * o.prefill_nodes.size() * loads.size() *
                                     o.prompt_lens.size() * o.output_lens.size());
  int index = 0;
  for (int nodes : o.nodes) {
    // --parallelism tensor: the nodes are the ranks of one stage (GPUs of one worker).
    const int stages = o.data_parallel || o.tensor_nodes ? 1 : nodes;
    const int replicas = o.data_parallel ? nodes : 1;
    // Unset where not asked: the service keeps the size it has (its coordinator's flag).
    const std::optional<int> tensor_parallel = o.tensor_nodes ? std::optional<int>(nodes)
                                               : o.tensor_parallel > 0
                                                   ? std::optional<int>(o.tensor_parallel)
                                                   : std::nullopt;
    for (int prefill : o.prefill_nodes) {
      last_set = Layout{.stages = stages,
                        .replicas = replicas,
                        .prefill = prefill,
                        .tensor_parallel = tensor_parallel};
      if (absl::Status s = client.SetTopology(*last_set); !s.ok()) return s;
      if (!references.has_value() && !o.check) references = References{};
      if (!references.has_value()) {
        absl::StatusOr<References> refs = RunReferences(client, o, vocab, progress, result);
        if (!refs.ok()) return refs.status();
        references = *std::move(refs);
        for (const auto& [key, ref] : *references) {
          result.reference_has_gaps |= std::any_of(ref.top2_gaps.begin(), ref.top2_gaps.end(),
                                                   [](double g) { return !std::isnan(g); });
        }
      }
      for (int prompt_len : o.prompt_lens) {
        for (int output_len : o.output_lens) {
          for (double load : loads) {
            ConfigResult c;
            c.nodes = nodes;
            c.stages = stages;
            c.replicas = replicas;
            c.prefill_nodes = prefill;
            c.mode = o.mode;
            if (o.mode == "closed") c.batch = static_cast<int>(load);
            const std::string warning = SlotWarning(info, c.batch, replicas - prefill);
            if (!warning.empty() && std::find(result.warnings.begin(), result.warnings.end(),
                                              warning) == result.warnings.end()) {
              std::fprintf(stderr, "warning: %s\n", warning.c_str());
              result.warnings.push_back(warning);
            }
            if (o.mode == "open") c.rate = load;
            c.prompt_len = prompt_len;
            c.output_len = output_len;
            c.requests = std::max(o.requests * (o.weak_scaling ? nodes / o.nodes.front() : 1), 1);
            ++index;
            const Point point{
                .index = index,
                .label = absl::StrFormat(
                    "[%d/%d]%s nodes=%d%s %s=%g prompt=%d output=%d", index, total,
                    o.workload.kind == "fixed" ? "" : absl::StrCat(" ", o.workload.kind), nodes,
                    prefill > 0 ? absl::StrCat(" (", prefill, " prefill)") : "",
                    o.mode == "closed" ? "batch" : "rate", load, prompt_len, output_len)};
            c.workload = o.workload.kind;
            const std::vector<WorkloadItem> pool =
                MakeWorkloadPool(o.workload, o.seed, prompt_len, output_len, o.prompt_pool, vocab,
                                 info.context_length);
            c = MeasureConfig(client, o, pool, std::move(c), point, progress, *references);
            // The ranks asked for, where asked: a worker's metrics give its largest size.
            if (tensor_parallel) c.tensor_parallel = *tensor_parallel;
            result.all_correct &= c.correct;
            result.configs.push_back(std::move(c));
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SweepResult> RunSweep(const SweepOptions& o) {
  if (absl::Status s = ValidateSweepOptions(o); !s.ok()) return s;
  std::unique_ptr<LoadClient> client =
      o.api == "openai"
          ? NewOpenAiClient(o.coordinator, o.model, o.admin, o.request_timeout_s, o.inference_auth,
                            o.admin_auth, o.tls_ca)
          : NewGrpcClient(o.coordinator, o.request_timeout_s, o.inference_auth, o.admin_auth);
  absl::StatusOr<ServedModel> info = client->Info();
  if (!info.ok()) return info.status();
  if (absl::Status s = CheckLengthsFit(o, *info); !s.ok()) return s;
  // The layout to set again at the end; none where the API cannot tell it (nor change it).
  const absl::StatusOr<Layout> initial = client->GetLayout();
  SweepResult result;
  result.options = o;
  result.server = *info;
  Progress progress(o.progress, isatty(STDERR_FILENO) == 1);
  std::optional<Layout> last_set;
  absl::Status status = RunConfigs(*client, o, progress, result, last_set);
  progress.Done();
  if (initial.ok() && last_set.has_value() && *last_set != *initial) {
    if (absl::Status s = client->SetTopology(*initial); !s.ok()) {
      const std::string message =
          absl::StrCat("the layout found at the start (", LayoutName(*initial),
                       ") could not be set again: ", s.message());
      if (!status.ok())
        return absl::Status(status.code(), absl::StrCat(status.message(), "; ", message));
      std::fprintf(stderr, "warning: %s\n", message.c_str());
      result.warnings.push_back(message);
    } else {
      std::fprintf(stderr, "the layout found at the start serves again: %s\n",
                   LayoutName(*initial).c_str());
    }
  }
  if (!status.ok()) return status;
  AddScaling(o, result.configs);
  return result;
}

std::string CorrectnessWord(const SweepResult& r) {
  if (!r.all_correct) return "FAIL";
  int outputs = 0, unchecked = 0;
  for (const ConfigResult& c : r.configs) {
    outputs += c.requests - c.errors;
    unchecked += c.unchecked;
  }
  return outputs > 0 && unchecked == outputs ? "not checked" : "pass";
}

}  // namespace tandem::loadgen
