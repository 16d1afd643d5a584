// Prometheus metrics of tandem's programs: an HTTP endpoint serving /metrics, and one plain struct
// of metric objects per program (CoordinatorMetrics, WorkerMetrics, GpuMetrics). Names follow
// Prometheus' conventions: tandem_ prefix, base units (seconds, bytes, joules, watts, ratios),
// counters end in _total. deploy/grafana/dashboards/tandem.json is built on exactly these names.
//
// Metric objects are thread-safe (prometheus-cpp uses atomics); the structs only hand them out.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace tandem {

// The /metrics server's connection threads, how long a connection may stay silent (seconds, for
// each read, write and keep-alive wait) and how many requests one connection may make.
inline constexpr int kMetricsThreads = 8;
inline constexpr int kMetricsIdleSeconds = 2;
inline constexpr int kMetricsRequestsPerConnection = 16;

// Serves one registry at http://address/metrics until destroyed.
class MetricsServer {
 public:
  // `address` is host:port; port 0 picks a free port (see port()). INVALID_ARGUMENT for a
  // malformed address, UNAVAILABLE when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address, std::shared_ptr<prometheus::Registry> registry);
  ~MetricsServer();  // stops serving and joins the server's thread
  int port() const { return port_; }

 private:
  MetricsServer() = default;
  std::shared_ptr<prometheus::Registry> registry_;
  // cpp-httplib rather than prometheus-cpp's civetweb Exposer: civetweb starts its threads with a
  // fixed small stack, which pthread_create refuses (EINVAL) once a process has loaded libraries
  // with large static TLS (cuBLASLt, OpenBLAS), as a GPU worker has.
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  int port_ = 0;
};

// Reads http://host:port/metrics: what a scraper sees. HttpGet reads any
// path (query string included, already URL-encoded). UNAVAILABLE when the
// endpoint cannot be reached, INTERNAL for a response that is not 200.
absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path,
                                    absl::Duration timeout = absl::Seconds(5));
absl::StatusOr<std::string> FetchMetricsPage(const std::string& host_port,
                                             absl::Duration timeout = absl::Seconds(5));

// One sample of Prometheus' text exposition format: name{labels} value.
struct MetricSample {
  std::string name;  // with its suffix (_bucket, _sum, _count) where it has one
  std::map<std::string, std::string> labels;
  double value = 0;
};
// Parses the text exposition format (comments skipped). INVALID_ARGUMENT names the bad line.
absl::StatusOr<std::vector<MetricSample>> ParseMetricsText(const std::string& text);
// Sum of the samples called `name` whose labels include every pair of `match`.
double SumSamples(const std::vector<MetricSample>& samples, const std::string& name,
                  const std::map<std::string, std::string>& match = {});

// The label value of tandem_requests_total{outcome} for a request that ended with `s`:
// ok, cancelled, deadline_exceeded, resource_exhausted, unavailable, invalid_argument or error.
std::string OutcomeLabel(const absl::Status& s);

// The coordinator's request, scheduler and KV-cache metrics.
struct CoordinatorMetrics {
  explicit CoordinatorMetrics(prometheus::Registry& registry);

  prometheus::Histogram& request_duration;     // arrival to the end, seconds
  prometheus::Histogram& time_to_first_token;  // arrival to the first generated token, seconds
  prometheus::Histogram& inter_token_latency;  // between consecutive tokens of a sequence, seconds
  prometheus::Histogram& queue_time;           // arrival to admission into a pipeline, seconds
  prometheus::Counter& prompt_tokens;
  prometheus::Counter& generated_tokens;
  prometheus::Histogram& batch_size;  // sequences per step (micro-batch)
  prometheus::Gauge& running_sequences;
  prometheus::Gauge& waiting_sequences;
  // Sequences that lost their pipeline and went back to the queue, and the tokens (prompt and
  // generated) the pipeline that took them fed again to rebuild their KV-cache.
  prometheus::Counter& recomputed_sequences;
  prometheus::Counter& recomputed_tokens;
  // Sequences moved with their KV-cache to the stages of a new layout (no recomputation), the KV
  // bytes written into the new stages, and how long each move paused its sequences (from the
  // pause to the last import).
  prometheus::Counter& migrated_sequences;
  prometheus::Counter& kv_transfer_bytes;
  prometheus::Histogram& kv_move_seconds;
  // Sequences whose prompt ran in a prefill pipeline and whose KV-cache then went to a decode
  // pipeline, and how long each batch of hand-offs took (export, fetch and import).
  prometheus::Counter& prefill_handoffs;
  prometheus::Histogram& prefill_handoff_seconds;
  // Prompts whose KV-cache a decode pipeline imported while their last prefill step ran (layer
  // by layer as it was written), and how long each such import took from its start (mostly the
  // prefill step it waits for).
  prometheus::Counter& kv_streams;
  prometheus::Histogram& kv_stream_seconds;
  // A paged KV-cache (coordinator/kv_pages.h): sequences preempted for want of pages (and
  // recomputed later), admissions looked up in the prefix cache, those that found cached pages,
  // the prompt tokens looked up and found (whose prefill was skipped), and the hit rate: prompt
  // tokens found over those looked up, since the start.
  prometheus::Counter& kv_preemptions;
  prometheus::Counter& prefix_cache_queries;
  prometheus::Counter& prefix_cache_hits;
  prometheus::Counter& prefix_cache_query_tokens;
  prometheus::Counter& prefix_cache_hit_tokens;
  prometheus::Gauge& prefix_cache_hit_rate;
  // Adds one admission's prefix lookup: `tokens` looked up, `hit` of them cached.
  void CountPrefixLookup(int tokens, int hit);

  void CountRequest(const absl::Status& outcome);
  // Replaces the set of known workers: tandem_worker_up{worker=address} is 1 or 0.
  void SetWorkersUp(const std::map<std::string, bool>& up);
  struct KvUse {
    int pipeline = 0;
    int stage = 0;
    int used = 0;
    int total = 0;
  };
  // Replaces the set of serving stages: tandem_kv_slots_used / _capacity{pipeline, stage}.
  void SetKvSlots(const std::vector<KvUse>& uses);
  struct KvPageUse {
    int pipeline = 0;
    int64_t total = 0;   // pages each stage of the pipeline holds
    int64_t used = 0;    // held by running sequences
    int64_t cached = 0;  // held only by the prefix cache (evictable)
  };
  // Replaces the set of paged pipelines: tandem_kv_pages{pipeline, state=used|cached|free}.
  void SetKvPages(const std::vector<KvPageUse>& uses);

 private:
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Gauge>& worker_up_;
  prometheus::Family<prometheus::Gauge>& kv_used_;
  prometheus::Family<prometheus::Gauge>& kv_total_;
  prometheus::Family<prometheus::Gauge>& kv_pages_;
  absl::Mutex mu_;  // serializes the Set* replacements
};

// One worker's per-stage timings and traffic. The stage label is the worker's current stage
// index in its pipeline; direction is "send" or "recv".
struct WorkerMetrics {
  explicit WorkerMetrics(prometheus::Registry& registry);

  void ObserveCompute(int stage, double seconds);
  void ObserveTransfer(int stage, const char* direction, double seconds, double bytes);
  void CountStep(int stage);

 private:
  prometheus::Family<prometheus::Histogram>& compute_;
  prometheus::Family<prometheus::Histogram>& transfer_;
  prometheus::Family<prometheus::Counter>& transfer_bytes_;
  prometheus::Family<prometheus::Counter>& steps_;
};

// GPU readings from NVML (common/nvml.h), labelled {gpu=index, uuid}.
struct GpuMetrics {
  explicit GpuMetrics(prometheus::Registry& registry);

  struct Reading {
    int index = 0;
    std::string uuid;
    double power_watts = 0;
    double energy_joules_delta = 0;  // added to the energy counter
    double utilization_ratio = 0;    // 0..1
    double memory_used_bytes = 0;
    double memory_total_bytes = 0;
  };
  void Record(const Reading& r);

 private:
  prometheus::Family<prometheus::Gauge>& power_;
  prometheus::Family<prometheus::Counter>& energy_;
  prometheus::Family<prometheus::Gauge>& utilization_;
  prometheus::Family<prometheus::Gauge>& memory_used_;
  prometheus::Family<prometheus::Gauge>& memory_total_;
};

}  // namespace tandem
