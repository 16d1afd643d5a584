// Metric families (prometheus-cpp) and the /metrics endpoint (cpp-httplib).
#include "common/metrics.h"

#include "common/httplib.h"
#include <sys/socket.h>

#include <algorithm>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "prometheus/histogram.h"
#include "prometheus/text_serializer.h"

namespace tandem {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;
using prometheus::Histogram;

// Bucket upper bounds, seconds. Latencies of a CPU test model and of a 13B model on GPUs both
// fall inside.
const Histogram::BucketBoundaries& LatencyBuckets() {
  static const Histogram::BucketBoundaries b = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                0.25,  0.5,    1,     2.5,  5,     10,   30,
                                                60,    120};
  return b;
}
const Histogram::BucketBoundaries& StepBuckets() {
  static const Histogram::BucketBoundaries b = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                                0.01,   0.025,   0.05,   0.1,   0.25,   0.5,
                                                1,      2.5,     5,      10};
  return b;
}
const Histogram::BucketBoundaries& BatchBuckets() {
  static const Histogram::BucketBoundaries b = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  return b;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address, std::shared_ptr<prometheus::Registry> registry) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "': expected host:port"));
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->registry_ = std::move(registry);
  server->http_ = std::make_unique<httplib::Server>();
  // A connection holds one thread until it closes: a client that connects and sends nothing, or
  // reads nothing, gives it back after these timeouts, and kMetricsThreads of them leave the
  // scraper room. (Two threads with httplib's 5 s defaults let two idle clients stall it.)
  server->http_->new_task_queue = [] { return new httplib::ThreadPool(kMetricsThreads); };
  server->http_->set_keep_alive_timeout(kMetricsIdleSeconds);
  server->http_->set_keep_alive_max_count(kMetricsRequestsPerConnection);
  server->http_->set_read_timeout(kMetricsIdleSeconds, 0);
  server->http_->set_write_timeout(kMetricsIdleSeconds, 0);
  server->http_->Get("/metrics", [reg = server->registry_](const httplib::Request&,
                                                           httplib::Response& res) {
    res.set_content(prometheus::TextSerializer().Serialize(reg->Collect()),
                    "text/plain; version=0.0.4; charset=utf-8");
  });
  std::string host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);  // [::1]:9464
  }
  const int bound = BindHttpServer(*server->http_, host, port);
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat("metrics address '", address,
                                               "': cannot serve: the address cannot be bound"));
  }
  server->port_ = bound;
  server->thread_ = std::thread([http = server->http_.get()] { http->listen_after_bind(); });
  // stop() only ends a server that is already listening: wait for it, so that the destructor
  // cannot stop it before it starts.
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!server->http_->is_running() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  return server;
}

MetricsServer::~MetricsServer() {
  if (http_) http_->stop();
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<std::string> FetchMetricsPage(const std::string& host_port,
                                             absl::Duration timeout) {
  return HttpGet(host_port, "/metrics", timeout);
}

absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path,
                                    absl::Duration timeout) {
  const size_t colon = host_port.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(host_port.substr(colon + 1), &port)) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", host_port,
                                                   "': expected host:port"));
  }
  std::string host = host_port.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  httplib::Client client(host, port);
  const int64_t us = absl::ToInt64Microseconds(timeout);
  client.set_connection_timeout(us / 1000000, us % 1000000);
  client.set_read_timeout(us / 1000000, us % 1000000);
  client.set_url_encode(false);  // `path` comes encoded
  httplib::Result res = client.Get(path);
  if (!res) {
    return absl::UnavailableError(absl::StrCat("metrics address '", host_port,
                                               "': ", httplib::to_string(res.error())));
  }
  if (res->status != 200) {
    return absl::InternalError(
        absl::StrCat("metrics address '", host_port, "': HTTP status ", res->status));
  }
  return res->body;
}

absl::StatusOr<std::vector<MetricSample>> ParseMetricsText(const std::string& text) {
  std::vector<MetricSample> out;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    auto bad = [&](const char* why) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics text line ", line_no, ": ", why, ": ", std::string(line)));
    };
    MetricSample s;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    s.name = std::string(line.substr(0, i));
    if (s.name.empty()) return bad("no metric name");
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        const size_t eq = line.find('=', i);
        if (eq == absl::string_view::npos || eq + 1 >= line.size() || line[eq + 1] != '"') {
          return bad("malformed label");
        }
        std::string key(absl::StripAsciiWhitespace(line.substr(i, eq - i)));
        std::string value;
        size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\' && j + 1 < line.size()) {
            ++j;
            value.push_back(line[j] == 'n' ? '\n' : line[j]);
          } else {
            value.push_back(line[j]);
          }
        }
        if (j >= line.size()) return bad("unterminated label value");
        s.labels[key] = value;
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      if (i >= line.size()) return bad("unterminated label set");
      ++i;
    }
    std::vector<absl::string_view> rest =
        absl::StrSplit(absl::StripAsciiWhitespace(line.substr(i)), ' ', absl::SkipEmpty());
    if (rest.empty()) return bad("no value");
    const std::string v(rest[0]);
    if (v == "+Inf") {
      s.value = std::numeric_limits<double>::infinity();
    } else if (v == "-Inf") {
      s.value = -std::numeric_limits<double>::infinity();
    } else if (v == "NaN") {
      s.value = std::numeric_limits<double>::quiet_NaN();
    } else if (!absl::SimpleAtod(v, &s.value)) {
      return bad("value is not a number");
    }
    out.push_back(std::move(s));
  }
  return out;
}

double SumSamples(const std::vector<MetricSample>& samples, const std::string& name,
                  const std::map<std::string, std::string>& match) {
  double sum = 0;
  for (const MetricSample& s : samples) {
    if (s.name != name) continue;
    bool ok = true;
    for (const auto& [k, v] : match) {
      auto it = s.labels.find(k);
      ok &= it != s.labels.end() && it->second == v;
    }
    if (ok) sum += s.value;
  }
  return sum;
}

std::string OutcomeLabel(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kOk: return "ok";
    case absl::StatusCode::kCancelled: return "cancelled";
    case absl::StatusCode::kDeadlineExceeded: return "deadline_exceeded";
    case absl::StatusCode::kResourceExhausted: return "resource_exhausted";
    case absl::StatusCode::kUnavailable: return "unavailable";
    case absl::StatusCode::kInvalidArgument: return "invalid_argument";
    default: return "error";
  }
}

// ---------------------------------------------------------------------------------------------

CoordinatorMetrics::CoordinatorMetrics(prometheus::Registry& r)
    : request_duration(BuildHistogram()
                           .Name("tandem_request_duration_seconds")
                           .Help("Time from a request's arrival to its end, in seconds")
                           .Register(r)
                           .Add({}, LatencyBuckets())),
      time_to_first_token(BuildHistogram()
                              .Name("tandem_time_to_first_token_seconds")
                              .Help("Time from a request's arrival to its first generated token, "
                                    "in seconds")
                              .Register(r)
                              .Add({}, LatencyBuckets())),
      inter_token_latency(BuildHistogram()
                              .Name("tandem_inter_token_latency_seconds")
                              .Help("Time between consecutive generated tokens of a sequence, "
                                    "in seconds")
                              .Register(r)
                              .Add({}, LatencyBuckets())),
      queue_time(BuildHistogram()
                     .Name("tandem_queue_time_seconds")
                     .Help("Time a request waited before admission into a pipeline, in seconds")
                     .Register(r)
                     .Add({}, LatencyBuckets())),
      prompt_tokens(BuildCounter()
                        .Name("tandem_prompt_tokens_total")
                        .Help("Prompt tokens of admitted requests")
                        .Register(r)
                        .Add({})),
      generated_tokens(BuildCounter()
                           .Name("tandem_generated_tokens_total")
                           .Help("Tokens generated")
                           .Register(r)
                           .Add({})),
      batch_size(BuildHistogram()
                     .Name("tandem_batch_size")
                     .Help("Sequences in one pipeline step (micro-batch)")
                     .Register(r)
                     .Add({}, BatchBuckets())),
      running_sequences(BuildGauge()
                            .Name("tandem_running_sequences")
                            .Help("Sequences admitted into a pipeline and not finished")
                            .Register(r)
                            .Add({})),
      waiting_sequences(BuildGauge()
                            .Name("tandem_waiting_sequences")
                            .Help("Requests waiting for admission")
                            .Register(r)
                            .Add({})),
      recomputed_sequences(BuildCounter()
                               .Name("tandem_sequences_recomputed_total")
                               .Help("Running sequences whose pipeline was lost and that continued "
                                     "on another after recomputing their KV-cache")
                               .Register(r)
                               .Add({})),
      recomputed_tokens(BuildCounter()
                            .Name("tandem_recomputed_tokens_total")
                            .Help("Tokens fed again to rebuild the KV-cache of resumed sequences")
                            .Register(r)
                            .Add({})),
      migrated_sequences(BuildCounter()
                             .Name("tandem_sequences_migrated_total")
                             .Help("Running sequences moved with their KV-cache to the stages of "
                                   "a new layout, without recomputation")
                             .Register(r)
                             .Add({})),
      kv_transfer_bytes(BuildCounter()
                            .Name("tandem_kv_transfer_bytes_total")
                            .Help("KV-cache bytes written into stages by moves and prefill "
                                  "hand-offs")
                            .Register(r)
                            .Add({})),
      kv_move_seconds(BuildHistogram()
                          .Name("tandem_kv_move_seconds")
                          .Help("Pause of a layout change that moved sequences with their "
                                "KV-cache: from the pause to the last import, seconds")
                          .Register(r)
                          .Add({}, LatencyBuckets())),
      prefill_handoffs(BuildCounter()
                           .Name("tandem_prefill_handoffs_total")
                           .Help("Sequences whose prompt ran in a prefill pipeline and whose "
                                 "KV-cache went on to a decode pipeline")
                           .Register(r)
                           .Add({})),
      prefill_handoff_seconds(BuildHistogram()
                                  .Name("tandem_prefill_handoff_seconds")
                                  .Help("Prefill to decode hand-offs: from the first token to the "
                                        "KV-cache in the decode slot, seconds")
                                  .Register(r)
                                  .Add({}, LatencyBuckets())),
      kv_streams(BuildCounter()
                     .Name("tandem_kv_streams_total")
                     .Help("Prompts whose KV-cache a decode pipeline imported while their last "
                           "prefill step ran, layer by layer as it was written")
                     .Register(r)
                     .Add({})),
      kv_stream_seconds(BuildHistogram()
                            .Name("tandem_kv_stream_seconds")
                            .Help("KV streams of prompts to decode pipelines: from the start of "
                                  "the import (the prefill step formed) to its end, seconds")
                            .Register(r)
                            .Add({}, LatencyBuckets())),
      kv_preemptions(BuildCounter()
                         .Name("tandem_kv_preemptions_total")
                         .Help("Running sequences preempted for want of KV-cache pages, to be "
                               "recomputed when pages free")
                         .Register(r)
                         .Add({})),
      prefix_cache_queries(BuildCounter()
                               .Name("tandem_prefix_cache_queries_total")
                               .Help("Admissions that looked their prompt up in the prefix cache")
                               .Register(r)
                               .Add({})),
      prefix_cache_hits(BuildCounter()
                            .Name("tandem_prefix_cache_hits_total")
                            .Help("Admissions that found cached pages for their prompt")
                            .Register(r)
                            .Add({})),
      prefix_cache_query_tokens(BuildCounter()
                                    .Name("tandem_prefix_cache_query_tokens_total")
                                    .Help("Prompt tokens looked up in the prefix cache")
                                    .Register(r)
                                    .Add({})),
      prefix_cache_hit_tokens(BuildCounter()
                                  .Name("tandem_prefix_cache_hit_tokens_total")
                                  .Help("Prompt tokens found in the prefix cache, whose prefill "
                                        "was skipped")
                                  .Register(r)
                                  .Add({})),
      prefix_cache_hit_rate(BuildGauge()
                                .Name("tandem_prefix_cache_hit_rate")
                                .Help("Prompt tokens found in the prefix cache over those looked "
                                      "up, since the start (0 to 1)")
                                .Register(r)
                                .Add({})),
      requests_(BuildCounter()
                    .Name("tandem_requests_total")
                    .Help("Generation requests that ended, by outcome")
                    .Register(r)),
      worker_up_(BuildGauge()
                     .Name("tandem_worker_up")
                     .Help("1 when a registered worker is up, 0 when it is down or drained")
                     .Register(r)),
      kv_used_(BuildGauge()
                   .Name("tandem_kv_slots_used")
                   .Help("KV-cache slots (sequences) in use on a pipeline stage")
                   .Register(r)),
      kv_total_(BuildGauge()
                    .Name("tandem_kv_slots_capacity")
                    .Help("KV-cache slots (sequences) a pipeline stage holds")
                    .Register(r)),
      kv_pages_(BuildGauge()
                    .Name("tandem_kv_pages")
                    .Help("KV-cache pages of a pipeline (each of its stages holds as many), by "
                          "state: used by running sequences, cached (evictable), free")
                    .Register(r)) {
  // Every outcome exists from the start, so that rate() sees the first request of each.
  for (const char* o : {"ok", "cancelled", "deadline_exceeded", "resource_exhausted",
                        "unavailable", "invalid_argument", "error"}) {
    requests_.Add({{"outcome", o}});
  }
}

void CoordinatorMetrics::CountRequest(const absl::Status& outcome) {
  requests_.Add({{"outcome", OutcomeLabel(outcome)}}).Increment();
}

void CoordinatorMetrics::CountPrefixLookup(int tokens, int hit) {
  prefix_cache_queries.Increment();
  if (hit > 0) prefix_cache_hits.Increment();
  prefix_cache_query_tokens.Increment(tokens);
  prefix_cache_hit_tokens.Increment(hit);
  const double asked = prefix_cache_query_tokens.Value();
  prefix_cache_hit_rate.Set(asked > 0 ? prefix_cache_hit_tokens.Value() / asked : 0);
}

void CoordinatorMetrics::SetKvPages(const std::vector<KvPageUse>& uses) {
  absl::MutexLock lock(&mu_);
  // Retired pipelines disappear rather than report stale numbers.
  for (const prometheus::MetricFamily& mf : kv_pages_.Collect()) {
    for (const prometheus::ClientMetric& m : mf.metric) {
      prometheus::Labels labels;
      for (const auto& l : m.label) labels[l.name] = l.value;
      kv_pages_.Remove(&kv_pages_.Add(labels));
    }
  }
  for (const KvPageUse& u : uses) {
    const std::string pipeline = absl::StrCat(u.pipeline);
    kv_pages_.Add({{"pipeline", pipeline}, {"state", "used"}}).Set(static_cast<double>(u.used));
    kv_pages_.Add({{"pipeline", pipeline}, {"state", "cached"}})
        .Set(static_cast<double>(u.cached));
    kv_pages_.Add({{"pipeline", pipeline}, {"state", "free"}})
        .Set(static_cast<double>(u.total - u.used - u.cached));
  }
}

void CoordinatorMetrics::SetWorkersUp(const std::map<std::string, bool>& up) {
  absl::MutexLock lock(&mu_);
  for (const auto& [worker, is_up] : up) {
    worker_up_.Add({{"worker", worker}}).Set(is_up ? 1 : 0);
  }
}

void CoordinatorMetrics::SetKvSlots(const std::vector<KvUse>& uses) {
  absl::MutexLock lock(&mu_);
  // Stages of retired pipelines disappear rather than report stale numbers.
  std::vector<prometheus::Gauge*> keep;
  for (const KvUse& u : uses) {
    const prometheus::Labels labels = {{"pipeline", absl::StrCat(u.pipeline)},
                                       {"stage", absl::StrCat(u.stage)}};
    prometheus::Gauge& used = kv_used_.Add(labels);
    prometheus::Gauge& total = kv_total_.Add(labels);
    used.Set(u.used);
    total.Set(u.total);
    keep.push_back(&used);
    keep.push_back(&total);
  }
  for (prometheus::Family<prometheus::Gauge>* family : {&kv_used_, &kv_total_}) {
    std::vector<prometheus::Gauge*> drop;
    for (const prometheus::MetricFamily& mf : family->Collect()) {
      for (const prometheus::ClientMetric& m : mf.metric) {
        prometheus::Labels labels;
        for (const auto& l : m.label) labels[l.name] = l.value;
        prometheus::Gauge& g = family->Add(labels);
        if (std::find(keep.begin(), keep.end(), &g) == keep.end()) drop.push_back(&g);
      }
    }
    for (prometheus::Gauge* g : drop) family->Remove(g);
  }
}

// ---------------------------------------------------------------------------------------------

WorkerMetrics::WorkerMetrics(prometheus::Registry& r)
    : compute_(BuildHistogram()
                   .Name("tandem_stage_compute_seconds")
                   .Help("Time a stage spent computing one step, in seconds")
                   .Register(r)),
      transfer_(BuildHistogram()
                    .Name("tandem_stage_transfer_seconds")
                    .Help("Time a stage spent sending or receiving one step's activations "
                          "(recv includes waiting for the previous stage), in seconds")
                    .Register(r)),
      transfer_bytes_(BuildCounter()
                          .Name("tandem_stage_transfer_bytes_total")
                          .Help("Activation bytes a stage sent or received")
                          .Register(r)),
      steps_(BuildCounter()
                 .Name("tandem_stage_steps_total")
                 .Help("Steps a stage executed")
                 .Register(r)) {}

void WorkerMetrics::ObserveCompute(int stage, double seconds) {
  compute_.Add({{"stage", absl::StrCat(stage)}}, StepBuckets()).Observe(seconds);
}

void WorkerMetrics::ObserveTransfer(int stage, const char* direction, double seconds,
                                    double bytes) {
  const prometheus::Labels labels = {{"stage", absl::StrCat(stage)}, {"direction", direction}};
  transfer_.Add(labels, StepBuckets()).Observe(seconds);
  transfer_bytes_.Add(labels).Increment(bytes);
}

void WorkerMetrics::CountStep(int stage) { steps_.Add({{"stage", absl::StrCat(stage)}}).Increment(); }

// ---------------------------------------------------------------------------------------------

GpuMetrics::GpuMetrics(prometheus::Registry& r)
    : power_(BuildGauge()
                 .Name("tandem_gpu_power_watts")
                 .Help("GPU power draw, in watts (NVML)")
                 .Register(r)),
      energy_(BuildCounter()
                  .Name("tandem_gpu_energy_joules_total")
                  .Help("GPU energy consumed since this process started sampling, in joules "
                        "(NVML total energy consumption)")
                  .Register(r)),
      utilization_(BuildGauge()
                       .Name("tandem_gpu_utilization_ratio")
                       .Help("Fraction of the last sample period a GPU kernel was running (NVML)")
                       .Register(r)),
      memory_used_(BuildGauge()
                       .Name("tandem_gpu_memory_used_bytes")
                       .Help("GPU memory in use, in bytes (NVML)")
                       .Register(r)),
      memory_total_(BuildGauge()
                        .Name("tandem_gpu_memory_total_bytes")
                        .Help("GPU memory installed, in bytes (NVML)")
                        .Register(r)) {}

void GpuMetrics::Record(const Reading& g) {
  const prometheus::Labels labels = {{"gpu", absl::StrCat(g.index)}, {"uuid", g.uuid}};
  power_.Add(labels).Set(g.power_watts);
  energy_.Add(labels).Increment(g.energy_joules_delta);
  utilization_.Add(labels).Set(g.utilization_ratio);
  memory_used_.Add(labels).Set(g.memory_used_bytes);
  memory_total_.Add(labels).Set(g.memory_total_bytes);
}

}  // namespace tandem
