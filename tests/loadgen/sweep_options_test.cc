// Sweep options are checked before anything runs; percentiles interpolate like numpy's default;
// GPU energy is counted over the GPUs the configuration used; a closed or open loop's wall time
// ends at its last answer.
#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "loadgen/sweep.h"

namespace tandem::loadgen {
namespace {

using ::testing::HasSubstr;

SweepOptions Good() {
  SweepOptions o;
  o.out = "/tmp/x";
  return o;
}

TEST(SweepOptionsTest, DefaultsWithAnOutputFolderAreValid) {
  EXPECT_TRUE(ValidateSweepOptions(Good()).ok());
}

TEST(SweepOptionsTest, AnOpenAiServerIsSweptOverNodesOnlyThroughTandemsAdmin) {
  SweepOptions o = Good();
  o.api = "openai";
  o.coordinator = "http://127.0.0.1:8000";
  EXPECT_TRUE(ValidateSweepOptions(o).ok());
  o.nodes = {1, 2};
  o.admin = "127.0.0.1:50051";
  EXPECT_TRUE(ValidateSweepOptions(o).ok());
}

TEST(SweepOptionsTest, EachBadFieldIsNamed) {
  struct Case {
    const char* field;
    void (*mutate)(SweepOptions&);
  };
  const Case cases[] = {
      {"--nodes", [](SweepOptions& o) { o.nodes = {}; }},
      {"--nodes", [](SweepOptions& o) { o.nodes = {1, 0}; }},
      {"--mode", [](SweepOptions& o) { o.mode = "half-open"; }},
      {"--batch", [](SweepOptions& o) { o.batch = {}; }},
      {"--batch", [](SweepOptions& o) { o.batch = {4, -1}; }},
      {"--rates", [](SweepOptions& o) { o.mode = "open"; }},
      {"--rates", [](SweepOptions& o) {
         o.mode = "open";
         o.rates = {0};
       }},
      {"--prompt_lens", [](SweepOptions& o) { o.prompt_lens = {0}; }},
      {"--output_lens", [](SweepOptions& o) { o.output_lens = {-3}; }},
      {"--requests", [](SweepOptions& o) { o.requests = 0; }},
      {"--warmup", [](SweepOptions& o) { o.warmup = -1; }},
      {"--prompt_pool", [](SweepOptions& o) { o.prompt_pool = 0; }},
      {"--out", [](SweepOptions& o) { o.out.clear(); }},
      {"--api", [](SweepOptions& o) { o.api = "rest"; }},
      {"--addr", [](SweepOptions& o) { o.api = "openai"; }},
      {"--prefill_nodes", [](SweepOptions& o) { o.prefill_nodes = {}; }},
      {"--prefill_nodes", [](SweepOptions& o) { o.prefill_nodes = {0, -1}; }},
      {"--prefill_nodes", [](SweepOptions& o) { o.prefill_nodes = {1}; }},  // needs data
      {"--prefill_nodes", [](SweepOptions& o) {
         o.data_parallel = true;
         o.nodes = {2, 1};
         o.prefill_nodes = {0, 1};  // leaves nothing to decode at 1 node
       }},
      {"--nodes", [](SweepOptions& o) {
         o.api = "openai";
         o.coordinator = "http://127.0.0.1:8000";
         o.nodes = {1, 2};
       }},
  };
  for (const Case& c : cases) {
    SweepOptions o = Good();
    c.mutate(o);
    absl::Status s = ValidateSweepOptions(o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.field));
  }
}

TEST(SlotWarningTest, WarnsOnlyForABatchAboveEveryPipelinesSlots) {
  ServedModel server;
  server.max_slots = 16;
  const std::string w = SlotWarning(server, 32, 1);
  EXPECT_THAT(w, HasSubstr("batch 32 is more than the 16 sequences"));
  EXPECT_THAT(w, HasSubstr("--max_slots 32"));
  EXPECT_EQ(SlotWarning(server, 16, 1), "");  // exactly the slots: every request runs
  EXPECT_EQ(SlotWarning(server, 32, 2), "");  // two pipelines of 16
  EXPECT_THAT(SlotWarning(server, 33, 2), HasSubstr("the other 1 requests wait"));
  server.max_slots = 0;  // a server that did not say
  EXPECT_EQ(SlotWarning(server, 1000, 1), "");
}

TEST(PercentileTest, InterpolatesBetweenRanks) {
  EXPECT_EQ(Percentile({}, 50), 0);
  EXPECT_EQ(Percentile({7}, 99), 7);
  EXPECT_DOUBLE_EQ(Percentile({4, 1, 3, 2}, 50), 2.5);
  EXPECT_DOUBLE_EQ(Percentile({1, 2, 3, 4, 5}, 90), 4.6);
  EXPECT_DOUBLE_EQ(Percentile({1, 2, 3, 4, 5}, 100), 5);
}

// A worker's page: its GPU's energy counter and its stage's compute seconds.
std::vector<MetricSample> Page(const std::string& uuid, double joules, double compute_s) {
  std::vector<MetricSample> s;
  s.push_back({"tandem_gpu_energy_joules_total", {{"gpu", "0"}, {"uuid", uuid}}, joules});
  s.push_back({"tandem_stage_compute_seconds_sum", {{"stage", "0"}}, compute_s});
  return s;
}

TEST(WorkerPrecisionTest, NamesEachDistinctSettingOnce) {
  auto info = [](std::string backend, std::string dtype, std::string weights) {
    return MetricSample{"tandem_worker_precision_info",
                        {{"backend", backend}, {"dtype", dtype}, {"weights", weights}},
                        1};
  };
  EXPECT_EQ(WorkerPrecision({{info("cuda", "f16", "fp8")}, {info("cuda", "f16", "fp8")}}),
            "cuda f16, weights fp8");
  EXPECT_EQ(
      WorkerPrecision(
          {{info("cuda", "f16", "fp8")}, Page("GPU-a", 1, 1), {info("cpu", "f32", "as_stored")}}),
      "cuda f16, weights fp8; cpu f32, weights as stored");
  // No worker has the series (or a scrape failed): nothing said.
  EXPECT_EQ(WorkerPrecision({Page("GPU-a", 1, 1), {}}), "");
  // A series at 0 is not the worker's setting.
  MetricSample off = info("cuda", "bf16", "as_stored");
  off.value = 0;
  EXPECT_EQ(WorkerPrecision({{off, info("cuda", "f16", "as_stored")}}),
            "cuda f16, weights as stored");
}

TEST(WorkerTensorParallelTest, TakesTheLargestSizeTheWorkersSay) {
  auto info = [](std::string tp) {
    return MetricSample{
        "tandem_worker_precision_info",
        {{"backend", "cuda"}, {"dtype", "f16"}, {"weights", "as_stored"}, {"tensor_parallel", tp}},
        1};
  };
  EXPECT_EQ(WorkerTensorParallel({{info("1")}, {info("2")}}), 2);
  EXPECT_EQ(WorkerTensorParallel({{info("4")}, Page("GPU-a", 1, 1)}), 4);
  // Not said (an older worker), not a number, or no worker at all: 0.
  MetricSample old = info("1");
  old.labels.erase("tensor_parallel");
  EXPECT_EQ(WorkerTensorParallel({{old}}), 0);
  EXPECT_EQ(WorkerTensorParallel({{info("two")}}), 0);
  EXPECT_EQ(WorkerTensorParallel({}), 0);
}

TEST(GpuEnergyTest, CountsOnlyTheGpusOfWorkersThatComputed) {
  // Worker 0 computed (2 -> 5 s) and used 300 J; worker 1 sat idle and used 80 J.
  const std::optional<double> j =
      GpuEnergyOfActiveWorkers({Page("GPU-a", 1000, 2), Page("GPU-b", 500, 1)},
                               {Page("GPU-a", 1300, 5), Page("GPU-b", 580, 1)});
  ASSERT_TRUE(j.has_value());
  EXPECT_DOUBLE_EQ(*j, 300);
  // Both computed: both GPUs.
  EXPECT_DOUBLE_EQ(*GpuEnergyOfActiveWorkers({Page("GPU-a", 1000, 2), Page("GPU-b", 500, 1)},
                                             {Page("GPU-a", 1300, 5), Page("GPU-b", 580, 3)}),
                   380);
}

TEST(GpuEnergyTest, OneGpuReportedByTwoWorkersIsCountedOnce) {
  EXPECT_DOUBLE_EQ(*GpuEnergyOfActiveWorkers({Page("GPU-a", 1000, 2), Page("GPU-a", 1000, 1)},
                                             {Page("GPU-a", 1300, 5), Page("GPU-a", 1300, 4)}),
                   300);
}

TEST(GpuEnergyTest, WithoutComputeTimesEveryGpuCountsAndWithoutGpusThereIsNone) {
  std::vector<MetricSample> a = {{"tandem_gpu_energy_joules_total", {{"uuid", "GPU-a"}}, 10}};
  std::vector<MetricSample> a2 = {{"tandem_gpu_energy_joules_total", {{"uuid", "GPU-a"}}, 25}};
  std::vector<MetricSample> b = {{"tandem_gpu_energy_joules_total", {{"uuid", "GPU-b"}}, 5}};
  std::vector<MetricSample> b2 = {{"tandem_gpu_energy_joules_total", {{"uuid", "GPU-b"}}, 9}};
  EXPECT_DOUBLE_EQ(*GpuEnergyOfActiveWorkers({a, b}, {a2, b2}), 19);
  std::vector<MetricSample> cpu = {{"tandem_stage_compute_seconds_sum", {{"stage", "0"}}, 1}};
  std::vector<MetricSample> cpu2 = {{"tandem_stage_compute_seconds_sum", {{"stage", "0"}}, 2}};
  EXPECT_FALSE(GpuEnergyOfActiveWorkers({cpu}, {cpu2}).has_value());
  // A failed scrape (empty page) is no worker's GPU.
  EXPECT_FALSE(GpuEnergyOfActiveWorkers({{}}, {{}}).has_value());
}

// The closed loop's wall time runs from the clients' start to the last answer: each client sends
// its requests one after another, and a client thread that takes long to end after its last
// answer (here a thread-local whose destructor sleeps 1 s) adds nothing.
TEST(ClosedLoopTest, WallEndsAtTheLastAnswer) {
  struct SlowExit {
    ~SlowExit() { std::this_thread::sleep_for(std::chrono::seconds(1)); }
  };
  std::mutex mu;
  std::map<int, std::vector<int>> sent_by_client;
  int waited = 0;
  const double wall = RunClosedLoop(
      4, 12,
      [&](int i, int client) {
        thread_local SlowExit slow;
        (void)slow;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        std::lock_guard<std::mutex> lock(mu);
        sent_by_client[client].push_back(i);
      },
      [&] { ++waited; });
  EXPECT_GE(wall, 0.15);  // three requests per client, one after another
  EXPECT_LT(wall, 0.9);
  EXPECT_GE(waited, 1);  // told every 100 ms while the requests ran
  ASSERT_EQ(sent_by_client.size(), 4u);
  std::set<int> all;
  for (const auto& [client, sent] : sent_by_client) all.insert(sent.begin(), sent.end());
  EXPECT_EQ(all.size(), 12u);
  EXPECT_EQ(*all.rbegin(), 11);
  EXPECT_EQ(RunClosedLoop(2, 0, [](int, int) {}), 0.0);
}

// The open loop sends every request once, each on a thread of its own at its arrival time, and its
// wall time too ends at the last answer, not when the threads have ended.
TEST(OpenLoopTest, WallEndsAtTheLastAnswer) {
  struct SlowExit {
    ~SlowExit() { std::this_thread::sleep_for(std::chrono::seconds(1)); }
  };
  std::mutex mu;
  std::set<int> sent;
  const double wall = RunOpenLoop(8, 200.0, 7, [&](int i) {
    thread_local SlowExit slow;
    (void)slow;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::lock_guard<std::mutex> lock(mu);
    sent.insert(i);
  });
  EXPECT_GE(wall, 0.05);
  EXPECT_LT(wall, 0.9);  // 8 arrivals at 200/s: the last one some 40 ms in, then 50 ms
  EXPECT_EQ(sent.size(), 8u);
  EXPECT_EQ(*sent.rbegin(), 7);
  EXPECT_EQ(RunOpenLoop(0, 10.0, 7, [](int) {}), 0.0);
}

}  // namespace
}  // namespace tandem::loadgen
