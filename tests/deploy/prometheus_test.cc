// deploy/ against the real Prometheus server: it scrapes a coordinator and two CPU workers (two
// pipeline stages) under load, every PromQL expression of the Grafana dashboard returns data
// through Prometheus' HTTP API, and promtool accepts every /metrics page and the shipped config.
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/metrics.h"
#include "common/nvml.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster.h"
#include "tools/model_generator.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using testing::Cluster;
using testing::PrintedMetricsPort;
using testing::ReadFile;
using testing::Process;

// The address Prometheus, started with --web.listen-address=127.0.0.1:0, says it listens on.
absl::StatusOr<std::string> WaitForPrometheusAddress(const fs::path& log) {
  static const std::regex kLine("msg=\"Listening on\" address=(127\\.0\\.0\\.1:[0-9]+)");
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    std::smatch m;
    const std::string text = ReadFile(log);
    if (std::regex_search(text, m, kLine)) return m[1].str();
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::DeadlineExceededError(absl::StrCat("Prometheus did not say where it listens:\n",
                                                  ReadFile(log)));
}

std::string UrlEncode(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      out += absl::StrFormat("%%%02X", c);
    }
  }
  return out;
}

// Every "expr" of every panel target in a Grafana dashboard.
std::vector<std::string> DashboardExpressions(const nlohmann::json& dash) {
  std::vector<std::string> out;
  for (const auto& panel : dash.at("panels")) {
    for (const auto& t : panel.value("targets", nlohmann::json::array())) {
      if (t.contains("expr")) out.push_back(t.at("expr").get<std::string>());
    }
  }
  return out;
}

// Runs `cmd` through the shell; its exit code.
int Shell(const std::string& cmd) {
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// A missing Prometheus skips a test, except under CI (CI=true), where a skip would hide it.
bool InCi() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}
#define SKIP_UNLESS_INSTALLED(installed, what)                                        \
  if (!(installed)) {                                                                 \
    if (InCi()) FAIL() << what << " is not installed (CI=true: a test may not skip)"; \
    GTEST_SKIP() << what << " is not installed";                                      \
  }

TEST(PrometheusTest, ShippedConfigPassesPromtool) {
  SKIP_UNLESS_INSTALLED(!std::string(TANDEM_PROMTOOL_BIN).empty(), "promtool");
  EXPECT_EQ(Shell(absl::StrCat(TANDEM_PROMTOOL_BIN, " check config ", TANDEM_PROMETHEUS_YML,
                               " >/dev/null 2>&1")),
            0);
}

TEST(PrometheusTest, DashboardExpressionsReturnDataFromARealPrometheus) {
  SKIP_UNLESS_INSTALLED(
      !std::string(TANDEM_PROMETHEUS_BIN).empty() && !std::string(TANDEM_PROMTOOL_BIN).empty(),
      "the prometheus package (prometheus, promtool)");
  const fs::path dir =
      fs::path(::testing::TempDir()) / absl::StrFormat("prometheus-test-%d", getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  absl::StatusOr<ModelConfig> config = PresetConfig("tiny-gpt2");
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_TRUE(WriteRandomCheckpoint(*config, GeneratorOptions{.seed = 5}, dir / "model").ok());

  absl::StatusOr<std::unique_ptr<Cluster>> cluster =
      Cluster::Start({.model_dir = dir / "model", .workers = 2, .stages = 2, .replicas = 1,
                      .coordinator_flags = {"--metrics_address=127.0.0.1:0"}});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& c = **cluster;
  std::vector<std::string> targets;
  targets.push_back(
      absl::StrCat("127.0.0.1:", PrintedMetricsPort(c.Logs(), "tandem-coordinator")));
  for (int i = 0; i < 2; ++i) {
    targets.push_back(
        absl::StrCat("127.0.0.1:", PrintedMetricsPort(c.worker(i).Log(), "tandem-worker")));
  }
  for (const std::string& t : targets) ASSERT_THAT(t, ::testing::Not(::testing::EndsWith(":-1")));

  // Load: four clients generating until the test ends.
  std::atomic<bool> stop{false};
  std::atomic<int> ok_requests{0};
  std::vector<std::thread> load;
  for (int k = 0; k < 4; ++k) {
    load.emplace_back([&, k] {
      auto stub = v1::Inference::NewStub(c.channel());
      for (int i = 0; !stop.load(); ++i) {
        v1::GenerateRequest req;
        for (int t = 0; t < 6 + (i + k) % 5; ++t) req.add_token_ids((i * 31 + t * 7 + k) % 400);
        req.set_max_new_tokens(12);
        req.set_ignore_eos(true);
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
        v1::GenerateResponse resp;
        if (stub->Generate(&ctx, req, &resp).ok()) ok_requests.fetch_add(1);
      }
    });
  }
  struct Joiner {
    std::atomic<bool>& stop;
    std::vector<std::thread>& threads;
    ~Joiner() {
      stop.store(true);
      for (auto& t : threads) t.join();
    }
  } joiner{stop, load};

  std::ofstream(dir / "prometheus.yml") << absl::StrFormat(
      "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
      "scrape_configs:\n"
      "  - job_name: tandem-coordinator\n    static_configs:\n      - targets: ['%s']\n"
      "  - job_name: tandem-worker\n    static_configs:\n      - targets: ['%s', '%s']\n",
      targets[0], targets[1], targets[2]);
  absl::StatusOr<std::unique_ptr<Process>> server = Process::Start(
      {TANDEM_PROMETHEUS_BIN, absl::StrCat("--config.file=", (dir / "prometheus.yml").string()),
       absl::StrCat("--storage.tsdb.path=", (dir / "tsdb").string()),
       "--web.listen-address=127.0.0.1:0"},
      dir / "prometheus.log");
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::string> listening = WaitForPrometheusAddress(dir / "prometheus.log");
  ASSERT_TRUE(listening.ok()) << listening.status();
  const std::string prom = *listening;

  // Ready, and all three targets scraped as up.
  auto query = [&](const std::string& expr) -> absl::StatusOr<nlohmann::json> {
    absl::StatusOr<std::string> body =
        HttpGet(prom, absl::StrCat("/api/v1/query?query=", UrlEncode(expr)));
    if (!body.ok()) return body.status();
    try {
      return nlohmann::json::parse(*body);
    } catch (const nlohmann::json::exception& e) {
      return absl::InternalError(absl::StrCat("Prometheus answered no JSON: ", e.what()));
    }
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  int up = 0;
  while (absl::Now() < deadline) {
    absl::StatusOr<nlohmann::json> r = query("sum(up)");
    if (r.ok() && (*r)["status"] == "success" && !(*r)["data"]["result"].empty()) {
      up = std::stoi((*r)["data"]["result"][0]["value"][1].get<std::string>());
      if (up == 3) break;
    }
    absl::SleepFor(absl::Milliseconds(250));
  }
  ASSERT_EQ(up, 3) << ReadFile(dir / "prometheus.log");

  nlohmann::json dash;
  try {
    dash = nlohmann::json::parse(ReadFile(TANDEM_DASHBOARD_JSON));
  } catch (const nlohmann::json::exception& e) {
    FAIL() << TANDEM_DASHBOARD_JSON << ": " << e.what();
  }
  const std::vector<std::string> exprs = DashboardExpressions(dash);
  ASSERT_GE(exprs.size(), 20u);
  // GPU series exist only where NVML reads a GPU; elsewhere those expressions must still parse.
  const bool have_gpu = Nvml::Load().ok();
  for (const std::string& expr : exprs) {
    const bool gpu = expr.find("tandem_gpu_") != std::string::npos;
    std::string last;
    bool has_data = false;
    // rate() needs two scrapes of a series after its first sample; wait for them.
    const absl::Time until = absl::Now() + absl::Seconds(30);
    while (absl::Now() < until) {
      absl::StatusOr<nlohmann::json> r = query(expr);
      ASSERT_TRUE(r.ok()) << expr << ": " << r.status();
      ASSERT_EQ((*r)["status"], "success") << expr << ": " << r->dump();
      last = r->dump();
      has_data = !(*r)["data"]["result"].empty();
      if (has_data || (gpu && !have_gpu)) break;
      absl::SleepFor(absl::Milliseconds(500));
    }
    if (gpu && !have_gpu) continue;
    EXPECT_TRUE(has_data) << "no data for " << expr << "\nlast answer: " << last;
  }
  EXPECT_GT(ok_requests.load(), 0);

  // promtool accepts every /metrics page, read under load.
  for (const std::string& t : targets) {
    absl::StatusOr<std::string> page = FetchMetricsPage(t);
    ASSERT_TRUE(page.ok()) << page.status();
    const fs::path file = dir / absl::StrCat("metrics-", t.substr(t.rfind(':') + 1), ".txt");
    std::ofstream(file) << *page;
    EXPECT_EQ(Shell(absl::StrCat(TANDEM_PROMTOOL_BIN, " check metrics < ", file.string(), " > ",
                                 file.string(), ".promtool 2>&1")),
              0)
        << t << ": " << ReadFile(file.string() + ".promtool");
  }
  server->reset();
  cluster->reset();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tandem
