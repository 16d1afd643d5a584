// Recovery without a hand, through real processes on loopback: a coordinator killed and started
// again finds its workers back, a worker that was taken for dead comes back into the layout that
// was asked for, a drain is undone, and the health service tells liveness from readiness.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <future>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "coordinator/config.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "health.grpc.pb.h"
#include "tests/integration/cluster.h"
#include "tools/model_generator.h"

namespace tandem::testing {
namespace {

using ::grpc::health::v1::HealthCheckResponse;
using ::testing::HasSubstr;

std::filesystem::path& ModelDir() {
  static std::filesystem::path dir;
  return dir;
}

class RecoveryTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ModelDir() = std::filesystem::path(::testing::TempDir()) /
                 absl::StrFormat("tandem-recovery-model-%d", getpid());
    absl::StatusOr<ModelConfig> c = PresetConfig("tiny-llama");
    ASSERT_TRUE(c.ok()) << c.status();
    c->max_positions = 1024;
    absl::Status s = WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 11}, ModelDir());
    ASSERT_TRUE(s.ok()) << s;
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(ModelDir(), ec);
  }

  // `flags` after the cluster's own (short heartbeats: 100 ms, down after 700 ms).
  static std::unique_ptr<Cluster> StartCluster(int workers, int stages,
                                               std::vector<std::string> flags = {}) {
    absl::StatusOr<std::unique_ptr<Cluster>> c =
        Cluster::Start({.model_dir = ModelDir(), .workers = workers, .stages = stages,
                        .coordinator_flags = std::move(flags)});
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  // Greedy tokens for a fixed prompt; the call's status in `status`.
  static std::vector<int32_t> Generate(Cluster& cluster, grpc::Status* status) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::GenerateRequest req;
    for (int32_t id : {3, 1, 4, 1, 5}) req.add_token_ids(id);
    req.set_max_new_tokens(6);
    req.set_ignore_eos(true);
    v1::GenerateResponse resp;
    *status = cluster.inference().Generate(&ctx, req, &resp);
    return {resp.token_ids().begin(), resp.token_ids().end()};
  }

  static std::vector<v1::WorkerInfo> Workers(Cluster& cluster) {
    grpc::ClientContext ctx;
    v1::ListWorkersResponse resp;
    grpc::Status s = cluster.admin().ListWorkers(&ctx, {}, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return {resp.workers().begin(), resp.workers().end()};
  }

  static absl::StatusOr<v1::Topology> Undrain(Cluster& cluster, int64_t worker_id) {
    grpc::ClientContext ctx;
    v1::UndrainRequest req;
    req.set_worker_id(worker_id);
    v1::Topology t;
    grpc::Status s = cluster.admin().Undrain(&ctx, req, &t);
    if (!s.ok()) return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
    return t;
  }

  // Runs tandem-cli with `args` against the cluster: its stdout (stderr goes to the test's), and
  // its exit status in `status`.
  static std::string Cli(Cluster& cluster, const std::string& args, int* status) {
    const std::string command =
        absl::StrCat(TANDEM_CLI_BIN, " --addr=", cluster.address(), " ", args);
    FILE* pipe = popen(command.c_str(), "r");
    std::string out;
    char buf[4096];
    for (size_t n; pipe != nullptr && (n = fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
    *status = pipe != nullptr ? pclose(pipe) : -1;
    return out;
  }

  // The index of the cluster's worker process that listens at `address`; -1: none.
  static int WorkerAt(Cluster& cluster, int workers, const std::string& address) {
    for (int i = 0; i < workers; ++i) {
      if (address == absl::StrFormat("127.0.0.1:%d", cluster.worker_port(i))) return i;
    }
    return -1;
  }
};

TEST_F(RecoveryTest, CoordinatorKilledAndRestartedTwentyTimesServesAgainEveryTime) {
  auto cluster = StartCluster(2, 2);
  ASSERT_NE(cluster, nullptr);
  grpc::Status status;
  const std::vector<int32_t> expected = Generate(*cluster, &status);
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::set<int64_t> ids_seen;
  for (const v1::WorkerInfo& w : Workers(*cluster)) ids_seen.insert(w.worker_id());
  for (int round = 1; round <= 20; ++round) {
    SCOPED_TRACE(absl::StrCat("restart ", round));
    ASSERT_TRUE(cluster->KillAndRestartCoordinator().ok()) << cluster->Logs();
    ASSERT_TRUE(cluster->WaitForTopology(1, 2).ok()) << cluster->Logs();
    EXPECT_EQ(Generate(*cluster, &status), expected);
    ASSERT_TRUE(status.ok()) << status.error_message() << cluster->Logs();
    // Each registration gets an id no earlier coordinator gave: a worker that still holds an old
    // one cannot be taken for another.
    for (const v1::WorkerInfo& w : Workers(*cluster)) {
      EXPECT_TRUE(ids_seen.insert(w.worker_id()).second) << "worker id " << w.worker_id();
    }
  }
}

TEST_F(RecoveryTest, FrozenWorkerReturnsAndTheRequestedTopologyIsRestored) {
  auto cluster = StartCluster(2, 2);
  ASSERT_NE(cluster, nullptr);
  grpc::Status status;
  const std::vector<int32_t> expected = Generate(*cluster, &status);
  ASSERT_TRUE(status.ok()) << status.error_message();
  // Frozen past the heartbeat timeout: declared down, the other worker serves alone.
  cluster->worker(1).Kill(SIGSTOP);
  ASSERT_TRUE(cluster->WaitForTopology(1, 1).ok()) << cluster->Logs();
  EXPECT_EQ(Generate(*cluster, &status), expected);
  EXPECT_TRUE(status.ok()) << status.error_message();
  // Thawed, it is told to register again and the two-stage layout comes back on its own; the
  // entry of its old registration is gone.
  cluster->worker(1).Kill(SIGCONT);
  ASSERT_TRUE(cluster->WaitForTopology(1, 2).ok()) << cluster->Logs();
  ASSERT_TRUE(cluster->WaitForLiveWorkers(2).ok()) << cluster->Logs();
  EXPECT_EQ(Generate(*cluster, &status), expected);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_THAT(cluster->worker(1).Log(), HasSubstr("registering again"));
}

TEST_F(RecoveryTest, UndrainReturnsTheWorkerAndRestoresTheTopology) {
  auto cluster = StartCluster(2, 2);
  ASSERT_NE(cluster, nullptr);
  grpc::ClientContext tctx;
  v1::Topology before;
  ASSERT_TRUE(cluster->admin().GetTopology(&tctx, {}, &before).ok());
  const int64_t drained = before.pipelines(0).stages(1).worker_id();
  grpc::ClientContext dctx;
  v1::DrainRequest drain;
  drain.set_worker_id(drained);
  v1::Topology after;
  grpc::Status s = cluster->admin().Drain(&dctx, drain, &after);
  ASSERT_TRUE(s.ok()) << s.error_message() << cluster->Logs();
  ASSERT_EQ(after.pipelines_size(), 1);
  EXPECT_EQ(after.pipelines(0).stages_size(), 1);

  int cli_status = -1;
  const std::string out = Cli(*cluster, absl::StrCat("undrain --worker_id=", drained), &cli_status);
  ASSERT_EQ(cli_status, 0) << out << cluster->Logs();
  v1::Topology undone;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(out, &undone)) << out;
  ASSERT_EQ(undone.pipelines_size(), 1);
  EXPECT_EQ(undone.pipelines(0).stages_size(), 2);
  for (const v1::WorkerInfo& w : Workers(*cluster)) {
    EXPECT_EQ(w.state(), v1::WORKER_STATE_SERVING) << w.DebugString();
  }
  grpc::Status status;
  Generate(*cluster, &status);
  EXPECT_TRUE(status.ok()) << status.error_message();

  // A worker that is not drained, and one that does not exist, are named in the error.
  absl::StatusOr<v1::Topology> again = Undrain(*cluster, drained);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.status().message(), HasSubstr(absl::StrCat(drained)));
  absl::StatusOr<v1::Topology> unknown = Undrain(*cluster, 12345);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(unknown.status().message(), HasSubstr("12345"));
}

TEST_F(RecoveryTest, HealthTellsReadinessOfInferenceFromLivenessOfTheProcess) {
  auto cluster = StartCluster(1, 1);
  ASSERT_NE(cluster, nullptr);
  auto health = grpc::health::v1::Health::NewStub(cluster->channel());
  auto check = [&](const std::string& service, HealthCheckResponse::ServingStatus* out) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    HealthCheckResponse resp;
    grpc::Status s = health->Check(&ctx, req, &resp);
    *out = resp.status();
    return s;
  };
  // Waits until `service` reports `want`.
  auto wait_for = [&](const std::string& service, HealthCheckResponse::ServingStatus want) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    HealthCheckResponse::ServingStatus got = HealthCheckResponse::UNKNOWN;
    while (absl::Now() < deadline) {
      if (check(service, &got).ok() && got == want) return true;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  };
  const std::string inference = v1::Inference::service_full_name();
  EXPECT_TRUE(wait_for(inference, HealthCheckResponse::SERVING));
  EXPECT_TRUE(wait_for("", HealthCheckResponse::SERVING));

  // No worker left: not ready, but alive.
  cluster->worker(0).Kill(SIGKILL);
  EXPECT_TRUE(wait_for(inference, HealthCheckResponse::NOT_SERVING)) << cluster->Logs();
  HealthCheckResponse::ServingStatus overall = HealthCheckResponse::UNKNOWN;
  ASSERT_TRUE(check("", &overall).ok());
  EXPECT_EQ(overall, HealthCheckResponse::SERVING);
  HealthCheckResponse::ServingStatus other = HealthCheckResponse::UNKNOWN;
  EXPECT_EQ(check("no.such.Service", &other).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(RecoveryTest, FrozenWorkerAtDefaultHeartbeatsIsReplacedAndItsRequestContinues) {
  // The default heartbeat settings, which must ride out a busy host: a frozen worker is declared
  // down after the timeout, the spare worker takes over, and the request continues there (its
  // KV-cache recomputed) to its full length; the pause the client saw is recorded.
  const CoordinatorConfig defaults;
  auto cluster = StartCluster(
      2, 1,
      {absl::StrCat("--heartbeat_interval_ms=", defaults.heartbeat_interval_ms),
       absl::StrCat("--heartbeat_timeout_ms=", defaults.heartbeat_timeout_ms)});
  ASSERT_NE(cluster, nullptr);
  grpc::ClientContext tctx;
  v1::Topology topo;
  ASSERT_TRUE(cluster->admin().GetTopology(&tctx, {}, &topo).ok());
  const int victim = WorkerAt(*cluster, 2, topo.pipelines(0).stages(0).worker_address());
  ASSERT_GE(victim, 0);
  std::atomic<bool> started{false};
  int tokens = 0;
  absl::Duration longest_gap;
  auto request = std::async(std::launch::async, [&] {
    grpc::ClientContext ctx;
    v1::GenerateRequest req;
    req.add_token_ids(7);
    req.set_max_new_tokens(1000);
    req.set_ignore_eos(true);
    auto reader = cluster->inference().GenerateStream(&ctx, req);
    v1::GenerateStreamResponse msg;
    absl::Time last = absl::Now();
    while (reader->Read(&msg)) {
      const absl::Time now = absl::Now();
      if (started) longest_gap = std::max(longest_gap, now - last);
      last = now;
      tokens += msg.token_ids_size();
      started = true;
    }
    return reader->Finish();
  });
  while (!started.load()) absl::SleepFor(absl::Milliseconds(1));
  cluster->worker(victim).Kill(SIGSTOP);
  const grpc::Status s = request.get();
  ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << cluster->Logs();
  EXPECT_EQ(tokens, 1000);
  RecordProperty("longest_pause_s", absl::StrFormat("%.2f", absl::ToDoubleSeconds(longest_gap)));
  std::printf("frozen worker: the request continued on the spare; longest pause %.2f s "
              "(heartbeat timeout %d ms)\n",
              absl::ToDoubleSeconds(longest_gap), defaults.heartbeat_timeout_ms);
  EXPECT_THAT(cluster->Logs(), HasSubstr("resuming elsewhere"));
  ASSERT_TRUE(cluster->WaitForTopology(1, 1).ok()) << cluster->Logs();
  grpc::Status status;
  Generate(*cluster, &status);
  EXPECT_TRUE(status.ok()) << status.error_message();
  cluster->worker(victim).Kill(SIGCONT);
}

}  // namespace
}  // namespace tandem::testing
