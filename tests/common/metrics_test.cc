// The metric families' names and types, the /metrics endpoint, and the text parser the sweep
// uses to read it.
#include "common/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string Serialize(prometheus::Registry& r) {
  return prometheus::TextSerializer().Serialize(r.Collect());
}

TEST(CoordinatorMetricsTest, ExportsEveryFamilyWithHelpAndType) {
  prometheus::Registry r;
  CoordinatorMetrics m(r);
  m.request_duration.Observe(0.3);
  m.batch_size.Observe(4);
  const std::string text = Serialize(r);
  for (const char* h : {"tandem_request_duration_seconds", "tandem_time_to_first_token_seconds",
                        "tandem_inter_token_latency_seconds", "tandem_queue_time_seconds",
                        "tandem_batch_size"}) {
    EXPECT_THAT(text, HasSubstr(std::string("# TYPE ") + h + " histogram")) << h;
  }
  for (const char* c : {"tandem_prompt_tokens_total", "tandem_generated_tokens_total",
                        "tandem_requests_total"}) {
    EXPECT_THAT(text, HasSubstr(std::string("# TYPE ") + c + " counter")) << c;
  }
  for (const char* g : {"tandem_running_sequences", "tandem_waiting_sequences"}) {
    EXPECT_THAT(text, HasSubstr(std::string("# TYPE ") + g + " gauge")) << g;
  }
  EXPECT_THAT(text, HasSubstr("# HELP tandem_request_duration_seconds Time"));
}

TEST(CoordinatorMetricsTest, CountsRequestsByOutcome) {
  prometheus::Registry r;
  CoordinatorMetrics m(r);
  m.CountRequest(absl::OkStatus());
  m.CountRequest(absl::OkStatus());
  m.CountRequest(absl::UnavailableError("worker down"));
  m.CountRequest(absl::DataLossError("odd"));
  absl::StatusOr<std::vector<MetricSample>> s = ParseMetricsText(Serialize(r));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(SumSamples(*s, "tandem_requests_total", {{"outcome", "ok"}}), 2);
  EXPECT_EQ(SumSamples(*s, "tandem_requests_total", {{"outcome", "unavailable"}}), 1);
  EXPECT_EQ(SumSamples(*s, "tandem_requests_total", {{"outcome", "error"}}), 1);
  EXPECT_EQ(SumSamples(*s, "tandem_requests_total", {{"outcome", "cancelled"}}), 0);
}

TEST(CoordinatorMetricsTest, KvSlotsOfRetiredStagesDisappear) {
  prometheus::Registry r;
  CoordinatorMetrics m(r);
  m.SetKvSlots({{0, 0, 3, 16}, {0, 1, 3, 16}});
  std::string text = Serialize(r);
  EXPECT_THAT(text, HasSubstr("tandem_kv_slots_used{pipeline=\"0\",stage=\"1\"} 3"));
  m.SetKvSlots({{1, 0, 5, 8}});
  text = Serialize(r);
  EXPECT_THAT(text, Not(HasSubstr("pipeline=\"0\"")));
  EXPECT_THAT(text, HasSubstr("tandem_kv_slots_used{pipeline=\"1\",stage=\"0\"} 5"));
  EXPECT_THAT(text, HasSubstr("tandem_kv_slots_capacity{pipeline=\"1\",stage=\"0\"} 8"));
}

TEST(CoordinatorMetricsTest, WorkerUpIsOneOrZero) {
  prometheus::Registry r;
  CoordinatorMetrics m(r);
  m.SetWorkersUp({{"127.0.0.1:1", true}, {"127.0.0.1:2", false}});
  const std::string text = Serialize(r);
  EXPECT_THAT(text, HasSubstr("tandem_worker_up{worker=\"127.0.0.1:1\"} 1"));
  EXPECT_THAT(text, HasSubstr("tandem_worker_up{worker=\"127.0.0.1:2\"} 0"));
}

TEST(WorkerMetricsTest, StageTimesAndBytesCarryStageAndDirection) {
  prometheus::Registry r;
  WorkerMetrics m(r);
  m.ObserveCompute(1, 0.02);
  m.ObserveCompute(1, 0.03);
  m.ObserveTransfer(1, "send", 0.001, 4096);
  m.ObserveTransfer(1, "send", 0.001, 4096);
  m.CountStep(1);
  absl::StatusOr<std::vector<MetricSample>> s = ParseMetricsText(Serialize(r));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_NEAR(SumSamples(*s, "tandem_stage_compute_seconds_sum", {{"stage", "1"}}), 0.05, 1e-12);
  EXPECT_EQ(SumSamples(*s, "tandem_stage_compute_seconds_count", {{"stage", "1"}}), 2);
  EXPECT_EQ(SumSamples(*s, "tandem_stage_transfer_bytes_total",
                       {{"stage", "1"}, {"direction", "send"}}),
            8192);
  EXPECT_EQ(SumSamples(*s, "tandem_stage_steps_total", {{"stage", "1"}}), 1);
}

TEST(GpuMetricsTest, EnergyIsACounterOfTheDeltas) {
  prometheus::Registry r;
  GpuMetrics m(r);
  m.Record({.index = 0, .uuid = "GPU-x", .power_watts = 250, .energy_joules_delta = 10,
            .utilization_ratio = 0.5, .memory_used_bytes = 1e9, .memory_total_bytes = 8e10});
  m.Record({.index = 0, .uuid = "GPU-x", .power_watts = 260, .energy_joules_delta = 2.5,
            .utilization_ratio = 0.75, .memory_used_bytes = 2e9, .memory_total_bytes = 8e10});
  absl::StatusOr<std::vector<MetricSample>> s = ParseMetricsText(Serialize(r));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(SumSamples(*s, "tandem_gpu_energy_joules_total", {{"uuid", "GPU-x"}}), 12.5);
  EXPECT_EQ(SumSamples(*s, "tandem_gpu_power_watts", {{"gpu", "0"}}), 260);
  EXPECT_EQ(SumSamples(*s, "tandem_gpu_utilization_ratio"), 0.75);
  EXPECT_EQ(SumSamples(*s, "tandem_gpu_memory_used_bytes"), 2e9);
  EXPECT_EQ(SumSamples(*s, "tandem_gpu_memory_total_bytes"), 8e10);
}

TEST(MetricsServerTest, ServesTheRegistryOverHttpOnAnEphemeralPort) {
  auto registry = std::make_shared<prometheus::Registry>();
  CoordinatorMetrics m(*registry);
  m.generated_tokens.Increment(42);
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);
  absl::StatusOr<std::string> page =
      FetchMetricsPage(absl::StrCat("127.0.0.1:", (*server)->port()));
  ASSERT_TRUE(page.ok()) << page.status();
  absl::StatusOr<std::vector<MetricSample>> s = ParseMetricsText(*page);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(SumSamples(*s, "tandem_generated_tokens_total"), 42);
}

// A TCP connection to 127.0.0.1:port that has sent `sent`; closed on destruction.
class RawClient {
 public:
  RawClient(int port, const std::string& sent) : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    if (connected_ && !sent.empty()) Send(sent);
  }
  ~RawClient() { close(fd_); }
  bool connected() const { return connected_; }
  void Send(const std::string& bytes) { send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL); }

 private:
  int fd_;
  bool connected_ = false;
};

// Served while kMetricsThreads - 2 clients keep their connections busy by sending a header byte
// every 100 ms (with two threads, two such clients held the endpoint for as long as they liked).
TEST(MetricsServerTest, SlowClientsDoNotStopAScrape) {
  auto registry = std::make_shared<prometheus::Registry>();
  CoordinatorMetrics m(*registry);
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<std::unique_ptr<RawClient>> slow;
  for (int i = 0; i < kMetricsThreads - 2; ++i) {
    slow.push_back(
        std::make_unique<RawClient>((*server)->port(), "GET /metrics HTTP/1.1\r\nX-Slow: "));
    ASSERT_TRUE(slow.back()->connected());
  }
  std::atomic<bool> done{false};
  std::thread trickle([&] {
    while (!done.load()) {
      for (auto& c : slow) c->Send("a");
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  absl::StatusOr<std::string> page =
      FetchMetricsPage(absl::StrCat("127.0.0.1:", (*server)->port()), absl::Seconds(60));
  done.store(true);
  trickle.join();
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_THAT(*page, HasSubstr("tandem_generated_tokens_total"));
}

// Connections that send nothing are closed after kMetricsIdleSeconds, so twice as many idle
// clients as threads delay a scrape by seconds (with httplib's defaults: 5 s for every two).
TEST(MetricsServerTest, IdleConnectionsAreClosedAndAScrapeStillAnswers) {
  auto registry = std::make_shared<prometheus::Registry>();
  CoordinatorMetrics m(*registry);
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<std::unique_ptr<RawClient>> idle;
  for (int i = 0; i < 2 * kMetricsThreads; ++i) {
    idle.push_back(std::make_unique<RawClient>((*server)->port(), ""));
    ASSERT_TRUE(idle.back()->connected());
  }
  absl::StatusOr<std::string> page =
      FetchMetricsPage(absl::StrCat("127.0.0.1:", (*server)->port()), absl::Seconds(30));
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_THAT(*page, HasSubstr("tandem_generated_tokens_total"));
}

TEST(MetricsServerTest, RejectsAnAddressWithoutPort) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("localhost", std::make_shared<prometheus::Registry>());
  ASSERT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("localhost"));
}

TEST(MetricsServerTest, APortInUseIsUnavailable) {
  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<std::unique_ptr<MetricsServer>> first =
      MetricsServer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<MetricsServer>> second =
      MetricsServer::Start(absl::StrCat("127.0.0.1:", (*first)->port()), registry);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
}

TEST(FetchMetricsPageTest, NothingListeningIsUnavailable) {
  // Bind and close a socket to find a port with nothing on it.
  auto registry = std::make_shared<prometheus::Registry>();
  int port = 0;
  {
    absl::StatusOr<std::unique_ptr<MetricsServer>> s = MetricsServer::Start("127.0.0.1:0", registry);
    ASSERT_TRUE(s.ok());
    port = (*s)->port();
  }
  absl::StatusOr<std::string> page = FetchMetricsPage(absl::StrCat("127.0.0.1:", port));
  EXPECT_EQ(page.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(FetchMetricsPage("no-port").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParseMetricsTextTest, ReadsLabelsEscapesAndSpecialValues) {
  absl::StatusOr<std::vector<MetricSample>> s = ParseMetricsText(
      "# HELP x y\n# TYPE a counter\na_total 3\nb{k=\"v\",q=\"a\\\"b\"} 1.5e3\n"
      "c_bucket{le=\"+Inf\"} +Inf\n");
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->size(), 3u);
  EXPECT_EQ((*s)[0].name, "a_total");
  EXPECT_EQ((*s)[0].value, 3);
  EXPECT_EQ((*s)[1].labels.at("q"), "a\"b");
  EXPECT_EQ((*s)[1].value, 1500);
  EXPECT_TRUE(std::isinf((*s)[2].value));
}

TEST(ParseMetricsTextTest, RejectsMalformedLinesNamingTheLine) {
  for (const char* bad : {"x{k=v} 1\n", "x{k=\"v} 1\n", "x{k=\"v\"\n", "x\n", "x abc\n",
                          "{k=\"v\"} 1\n"}) {
    absl::StatusOr<std::vector<MetricSample>> s = ParseMetricsText(bad);
    ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(s.status().message()), HasSubstr("line 1")) << bad;
  }
}

TEST(OutcomeLabelTest, MapsStatusCodes) {
  EXPECT_EQ(OutcomeLabel(absl::OkStatus()), "ok");
  EXPECT_EQ(OutcomeLabel(absl::CancelledError("")), "cancelled");
  EXPECT_EQ(OutcomeLabel(absl::DeadlineExceededError("")), "deadline_exceeded");
  EXPECT_EQ(OutcomeLabel(absl::ResourceExhaustedError("")), "resource_exhausted");
  EXPECT_EQ(OutcomeLabel(absl::InvalidArgumentError("")), "invalid_argument");
  EXPECT_EQ(OutcomeLabel(absl::InternalError("")), "error");
}

}  // namespace
}  // namespace tandem
