// Tensor parallelism through real processes on loopback: a pipeline of two stages, each worker
// splitting its stage over two thread ranks (--tensor_parallel=2), gives the greedy tokens of one
// unsplit stage, and ListWorkers reports each worker's ranks.
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster.h"
#include "tools/model_generator.h"

namespace tandem::testing {
namespace {

using ::testing::HasSubstr;

class TensorParallelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::filesystem::path(std::filesystem::path(::testing::TempDir()) /
                                     absl::StrFormat("tandem-tp-model-%d", getpid()));
    absl::StatusOr<ModelConfig> c = PresetConfig("tiny-llama");  // 4 heads over 2 K/V heads
    ASSERT_TRUE(c.ok()) << c.status();
    absl::Status s = WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 37}, *dir_);
    ASSERT_TRUE(s.ok()) << s;
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*dir_, ec);
    delete dir_;
  }

  // Greedy tokens of `prompt`, max_new_tokens of them, from the cluster.
  static std::vector<int32_t> Greedy(Cluster& cluster, const std::vector<int32_t>& prompt) {
    v1::GenerateRequest req;
    req.mutable_token_ids()->Assign(prompt.begin(), prompt.end());
    req.set_max_new_tokens(12);
    req.set_ignore_eos(true);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::GenerateResponse resp;
    grpc::Status s = cluster.inference().Generate(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message() << cluster.Logs();
    return {resp.token_ids().begin(), resp.token_ids().end()};
  }

  static std::vector<int> RanksOfWorkers(Cluster& cluster) {
    grpc::ClientContext ctx;
    v1::ListWorkersResponse workers;
    EXPECT_TRUE(cluster.admin().ListWorkers(&ctx, {}, &workers).ok());
    std::vector<int> ranks;
    for (const auto& w : workers.workers()) ranks.push_back(w.tensor_parallel());
    return ranks;
  }

  static std::filesystem::path* dir_;
};
std::filesystem::path* TensorParallelTest::dir_ = nullptr;

TEST_F(TensorParallelTest, TwoStagesOfTwoRanksGiveTheGreedyTokensOfOneStage) {
  ClusterOptions one;
  one.model_dir = *dir_;
  auto whole = Cluster::Start(one);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ClusterOptions two = one;
  two.workers = 2;
  two.stages = 2;
  two.worker_flags = {"--tensor_parallel=2"};
  auto split = Cluster::Start(two);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(RanksOfWorkers(**whole), std::vector<int>{1});
  EXPECT_EQ(RanksOfWorkers(**split), (std::vector<int>{2, 2}));
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> prompt;
    for (int k = 0; k < 3 + 5 * i; ++k) prompt.push_back((i * 131 + k * 17 + 5) % 500);
    const std::vector<int32_t> want = Greedy(**whole, prompt);
    ASSERT_EQ(want.size(), 12u);
    EXPECT_EQ(Greedy(**split, prompt), want) << "prompt " << i << (*split)->Logs();
  }
}

// Admin.SetTopology of one stage and one replica of `ranks` ranks a stage; the reply in `t`.
grpc::Status SetRanks(Cluster& cluster, int ranks, v1::Topology* t) {
  v1::SetTopologyRequest req;
  req.set_stages(1);
  req.set_replicas(1);
  req.set_tensor_parallel(ranks);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return cluster.admin().SetTopology(&ctx, req, t);
}

// One worker of two ranks serves its stage over one rank, then two, as SetTopology asks, with the
// greedy tokens of an unsplit worker each time; more ranks than it has are refused naming them,
// and it goes on serving.
TEST_F(TensorParallelTest, SetTopologyPicksTheRanksOfAStageUpToTheWorkersOwn) {
  ClusterOptions one;
  one.model_dir = *dir_;
  auto whole = Cluster::Start(one);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ClusterOptions two = one;
  two.worker_flags = {"--tensor_parallel=2"};
  auto split = Cluster::Start(two);
  ASSERT_TRUE(split.ok()) << split.status();
  const std::vector<int32_t> prompt = {5, 77, 301, 12, 9, 140, 2};
  const std::vector<int32_t> want = Greedy(**whole, prompt);
  ASSERT_EQ(want.size(), 12u);
  for (int ranks : {1, 2}) {
    v1::Topology t;
    const grpc::Status s = SetRanks(**split, ranks, &t);
    ASSERT_TRUE(s.ok()) << s.error_message() << (*split)->Logs();
    EXPECT_EQ(t.tensor_parallel(), ranks);
    ASSERT_EQ(t.pipelines_size(), 1) << t.DebugString();
    EXPECT_EQ(t.pipelines(0).tensor_parallel(), ranks) << t.DebugString();
    EXPECT_EQ(Greedy(**split, prompt), want) << ranks << " rank(s)" << (*split)->Logs();
  }
  v1::Topology t;
  grpc::Status s = SetRanks(**split, 4, &t);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("needs 1 workers of at least 4 ranks"));
  s = SetRanks(**split, -1, &t);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("tensor_parallel: must be >= 1"));
  EXPECT_EQ(Greedy(**split, prompt), want) << "still serving over two ranks";
}

// A worker asked for more ranks than it was started with refuses the stage, naming both.
TEST_F(TensorParallelTest, AWorkerRefusesMoreRanksThanItHas) {
  absl::StatusOr<std::unique_ptr<Process>> worker = Process::Start(
      {TANDEM_WORKER_BIN, "--coordinator=127.0.0.1:1", "--listen=127.0.0.1:0",
       "--metrics_address=", "--tensor_parallel=2"},
      std::filesystem::path(::testing::TempDir()) / absl::StrCat("tp-assign-", getpid(), ".log"));
  ASSERT_TRUE(worker.ok()) << worker.status();
  absl::StatusOr<int> port = (*worker)->WaitForPort();
  ASSERT_TRUE(port.ok()) << port.status() << (*worker)->Log();
  auto stub = v1::Worker::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", *port), grpc::InsecureChannelCredentials()));
  for (int ranks : {3, 2}) {
    v1::AssignStageRequest req;
    req.set_assignment_id(7);
    req.set_num_stages(1);
    req.set_model_dir(dir_->string());
    req.set_last_layer(-1);
    req.set_max_slots(2);
    req.set_max_seq_len(64);
    req.set_tensor_parallel(ranks);
    v1::AssignStageResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    const grpc::Status s = stub->AssignStage(&ctx, req, &resp);
    if (ranks == 3) {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
      EXPECT_THAT(s.error_message(),
                  HasSubstr("tensor_parallel 3: this worker splits a stage over at most 2"));
    } else {
      EXPECT_TRUE(s.ok()) << s.error_message() << (*worker)->Log();
    }
  }
}

// Runs tandem-worker with `flags` against a closed coordinator address; its exit code and output.
std::pair<int, std::string> RunWorker(const std::string& flags) {
  const std::filesystem::path log = std::filesystem::path(::testing::TempDir()) /
                                    absl::StrCat("tp-worker-flags-", getpid(), ".log");
  const std::string cmd =
      absl::StrCat("timeout 10 ", TANDEM_WORKER_BIN, " --coordinator=127.0.0.1:1 ",
                   "--metrics_address= ", flags, " > ", log.string(), " 2>&1");
  const int rc = std::system(cmd.c_str());
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, text.str()};
}

TEST(TensorParallelFlagTest, MoreRanksThanCoresOrFewerThanOneAreRefusedAtStart) {
  auto [rc, out] = RunWorker("--tensor_parallel=100000");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_THAT(out, HasSubstr("--tensor_parallel: 100000 ranks on a host of"));
  std::tie(rc, out) = RunWorker("--tensor_parallel=0");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_THAT(out, HasSubstr("--tensor_parallel"));
}

// More ranks than GPUs on the cuda backend: an exit with the count (or, built without CUDA, the
// backend's absence), never a signal.
TEST(TensorParallelFlagTest, MoreRanksThanGpusAreRefusedAtStart) {
  auto [rc, out] = RunWorker("--backend=cuda --tensor_parallel=64");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_THAT(out, ::testing::AnyOf(HasSubstr("needs CUDA devices 0..63 but this host has"),
                                    HasSubstr("built without CUDA")));
}

}  // namespace
}  // namespace tandem::testing
