// Real tandem-worker processes on two GPUs: a coordinator splits a tiny Llama into two stages,
// one CUDA worker per GPU with NCCL between them (each stage's steps through its StepRunner, the
// first stage's decode outputs sent from behind its forward pass), and the greedy tokens equal
// those of one CUDA worker holding the whole model, over the GPUs' direct link and over NCCL's
// socket transport (the stand-in for two hosts); the first stage gets the last one's tokens over
// NCCL, so that the coordinator sends each micro-batch's next step ahead of its tokens, and
// concurrent requests of batch-invariant workers give the tokens of one worker too. Skipped
// without 2 GPUs.
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster.h"
#include "tools/model_generator.h"

namespace tandem {
namespace {

using testing::Cluster;

std::filesystem::path ModelDir() {
  return std::filesystem::path(::testing::TempDir()) /
         absl::StrFormat("tandem-cuda-pipeline-model-%d", getpid());
}

std::vector<std::vector<int32_t>> Prompts() {
  return {{5, 17, 99, 3}, {42}, {7, 7, 7, 7, 7, 7, 7, 7, 7, 12, 300, 2}};
}

// The greedy generation of `prompt`, `max_new_tokens` long.
std::vector<int32_t> GenerateOne(Cluster& cluster, const std::vector<int32_t>& prompt,
                                 int max_new_tokens) {
  v1::GenerateRequest req;
  req.mutable_token_ids()->Assign(prompt.begin(), prompt.end());
  req.set_max_new_tokens(max_new_tokens);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::GenerateResponse resp;
  const grpc::Status s = cluster.inference().Generate(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return {resp.token_ids().begin(), resp.token_ids().end()};
}

// Greedy generations of every prompt, one request at a time.
std::vector<std::vector<int32_t>> Generate(Cluster& cluster) {
  std::vector<std::vector<int32_t>> out;
  for (const std::vector<int32_t>& prompt : Prompts()) {
    out.push_back(GenerateOne(cluster, prompt, 16));
  }
  return out;
}

// Greedy generations of `n` requests at once, request i of prompt i % 3 with 24 new tokens.
std::vector<std::vector<int32_t>> GenerateAtOnce(Cluster& cluster, int n) {
  std::vector<std::vector<int32_t>> out(n);
  std::vector<std::thread> clients;
  for (int i = 0; i < n; ++i) {
    clients.emplace_back(
        [&, i] { out[i] = GenerateOne(cluster, Prompts()[i % Prompts().size()], 24); });
  }
  for (std::thread& t : clients) t.join();
  return out;
}

// One CUDA worker on GPU 0 that holds the whole model, with `flags` added.
absl::StatusOr<std::unique_ptr<Cluster>> StartOneWorker(std::vector<std::string> flags) {
  testing::ClusterOptions o;
  o.model_dir = ModelDir();
  o.worker_flags = {"--backend=cuda", "--gpu=0", "--metrics_address="};
  o.worker_flags.insert(o.worker_flags.end(), flags.begin(), flags.end());
  return Cluster::Start(o);
}

// Two CUDA workers, one per GPU, as the two stages of one pipeline over NCCL (over its socket
// transport, the stand-in for two hosts, with `socket`), with `flags` added.
absl::StatusOr<std::unique_ptr<Cluster>> StartTwoStages(bool socket,
                                                        std::vector<std::string> flags) {
  if (socket) {
    setenv("NCCL_P2P_DISABLE", "1", 1);
    setenv("NCCL_SHM_DISABLE", "1", 1);
  }
  testing::ClusterOptions o;
  o.model_dir = ModelDir();
  o.workers = 2;
  o.stages = 2;
  o.worker_flags = {"--backend=cuda", "--transport=nccl", "--metrics_address="};
  o.worker_flags.insert(o.worker_flags.end(), flags.begin(), flags.end());
  o.flags_of_worker = {{"--gpu=0"}, {"--gpu=1"}};
  absl::StatusOr<std::unique_ptr<Cluster>> c = Cluster::Start(o);
  unsetenv("NCCL_P2P_DISABLE");
  unsetenv("NCCL_SHM_DISABLE");
  return c;
}

class CudaPipelineTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
    if (gpus < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << gpus;
    if (!std::filesystem::exists(ModelDir() / "config.json")) {
      absl::StatusOr<ModelConfig> c = PresetConfig("tiny-llama");
      ASSERT_TRUE(c.ok()) << c.status();
      ASSERT_TRUE(WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 11}, ModelDir()).ok());
    }
    setenv("NCCL_NVLS_ENABLE", "0", 1);
  }
};

TEST_P(CudaPipelineTest, TwoWorkersOverNcclGiveTheTokensOfOne) {
  const bool socket = GetParam();
  std::vector<std::vector<int32_t>> one;
  {
    absl::StatusOr<std::unique_ptr<Cluster>> c = StartOneWorker({});
    ASSERT_TRUE(c.ok()) << c.status();
    one = Generate(**c);
  }
  std::vector<std::vector<int32_t>> two;
  {
    absl::StatusOr<std::unique_ptr<Cluster>> c = StartTwoStages(socket, {});
    ASSERT_TRUE(c.ok()) << c.status();
    two = Generate(**c);
    EXPECT_NE((*c)->Logs().find("over nccl"), std::string::npos) << (*c)->Logs();
    EXPECT_NE((*c)->Logs().find("tokens fed to the first over the link"), std::string::npos)
        << (*c)->Logs();
  }
  ASSERT_EQ(one.size(), Prompts().size());
  for (const std::vector<int32_t>& t : one) EXPECT_FALSE(t.empty());
  EXPECT_EQ(two, one);
}

// Twelve requests at once through two stages with steps ahead of their tokens: micro-batches
// whose first-stage rows feed the tokens the last stage sent over NCCL. Batch-invariant workers,
// so that every request's tokens equal those of its prompt alone on one worker.
TEST_P(CudaPipelineTest, ConcurrentRequestsThroughTwoStagesGoingAheadGiveTheTokensOfOne) {
  const bool socket = GetParam();
  constexpr int kRequests = 12;
  std::vector<std::vector<int32_t>> one;
  {
    absl::StatusOr<std::unique_ptr<Cluster>> c = StartOneWorker({"--batch_invariant"});
    ASSERT_TRUE(c.ok()) << c.status();
    one = GenerateAtOnce(**c, static_cast<int>(Prompts().size()));
  }
  std::vector<std::vector<int32_t>> two;
  {
    absl::StatusOr<std::unique_ptr<Cluster>> c = StartTwoStages(socket, {"--batch_invariant"});
    ASSERT_TRUE(c.ok()) << c.status();
    two = GenerateAtOnce(**c, kRequests);
    EXPECT_NE((*c)->Logs().find("tokens fed to the first over the link"), std::string::npos)
        << (*c)->Logs();
  }
  ASSERT_EQ(two.size(), static_cast<size_t>(kRequests));
  for (int i = 0; i < kRequests; ++i) {
    EXPECT_FALSE(two[i].empty()) << "request " << i;
    EXPECT_EQ(two[i], one[i % one.size()]) << "request " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Links, CudaPipelineTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? std::string("Socket") : std::string("Direct");
                         });

}  // namespace
}  // namespace tandem
