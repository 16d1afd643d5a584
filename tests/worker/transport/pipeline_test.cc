// A tiny Llama split into two stage processes on two GPUs (tandem-pipeline-bench, NCCL between
// them) generates exactly the tokens of the whole model in one process, over the GPUs' direct
// link and over NCCL's socket transport (the stand-in for two hosts), with the transport on each
// stage's stream sending from behind the forward pass (the default) and on streams of its own.
// Skipped without 2 GPUs.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tools/model_generator.h"

extern char** environ;

namespace tandem {
namespace {

std::filesystem::path TmpDir() {
  const char* env = std::getenv("TANDEM_TEST_TMPDIR");
  return env != nullptr ? std::filesystem::path(env) : std::filesystem::path(TANDEM_TEST_TMPDIR);
}

// The benchmark binary: next to this test where both were copied elsewhere, else the build's.
std::string BenchBinary() {
  if (const char* env = std::getenv("TANDEM_PIPELINE_BENCH")) return env;
  const auto here = std::filesystem::read_symlink("/proc/self/exe").parent_path();
  if (std::filesystem::exists(here / "tandem-pipeline-bench")) {
    return (here / "tandem-pipeline-bench").string();
  }
  return TANDEM_PIPELINE_BENCH;
}

pid_t Spawn(const std::vector<std::string>& args, const std::filesystem::path& log) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = -1;
  const int e = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  EXPECT_EQ(e, 0) << "cannot start " << args[0];
  return e == 0 ? pid : -1;
}

int Wait(pid_t pid) {
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string Slurp(const std::filesystem::path& p) {
  std::ifstream f(p);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

enum class Link { kDirect, kSocket, kDirectOwnStreams };

class TwoStagePipelineTest : public ::testing::TestWithParam<Link> {};

TEST_P(TwoStagePipelineTest, GivesTheTokensOfOneStage) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  if (gpus < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << gpus;
  const bool socket = GetParam() == Link::kSocket;
  const std::vector<std::string> streams =
      GetParam() == Link::kDirectOwnStreams
          ? std::vector<std::string>{"--stage_stream=false", "--device_send=false"}
          : std::vector<std::string>{};
  const std::filesystem::path dir =
      TmpDir() / (socket                        ? "pipeline_socket"
                  : GetParam() == Link::kDirect ? "pipeline_p2p"
                                                : "pipeline_p2p_streams");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::filesystem::path model = TmpDir() / "pipeline_tiny_llama";
  if (!std::filesystem::exists(model / "config.json")) {
    auto c = PresetConfig("tiny-llama");
    ASSERT_TRUE(c.ok()) << c.status();
    GeneratorOptions o;
    o.seed = 11;
    ASSERT_TRUE(WriteRandomCheckpoint(*c, o, model).ok());
  }
  const std::string bench = BenchBinary();
  const std::vector<std::string> common = {"--model=" + model.string(), "--batch=1,3",
                                           "--prompt=9", "--new_tokens=12", "--timeout_s=60"};
  auto args = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = {bench};
    a.insert(a.end(), common.begin(), common.end());
    a.insert(a.end(), streams.begin(), streams.end());
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const auto single_json = dir / "single.json";
  ASSERT_EQ(Wait(Spawn(args({"--single", "--json=" + single_json.string()}), dir / "single.log")),
            0)
      << Slurp(dir / "single.log");

  if (socket) {
    setenv("NCCL_P2P_DISABLE", "1", 1);
    setenv("NCCL_SHM_DISABLE", "1", 1);
  }
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  const std::string id = "--id_file=" + (dir / "nccl.id").string();
  const pid_t r1 = Spawn(args({"--world=2", "--rank=1", id, "--json=" + (dir / "r1.json").string()}),
                         dir / "r1.log");
  const pid_t r0 = Spawn(args({"--world=2", "--rank=0", id, "--json=" + (dir / "r0.json").string(),
                               "--reference=" + single_json.string()}),
                         dir / "r0.log");
  const int c0 = Wait(r0), c1 = Wait(r1);
  unsetenv("NCCL_P2P_DISABLE");
  unsetenv("NCCL_SHM_DISABLE");
  ASSERT_EQ(c0, 0) << Slurp(dir / "r0.log");
  ASSERT_EQ(c1, 0) << Slurp(dir / "r1.log");

  const auto single = nlohmann::json::parse(Slurp(single_json));
  const auto r0_json = nlohmann::json::parse(Slurp(dir / "r0.json"));
  ASSERT_EQ(single["results"].size(), 2u);
  ASSERT_EQ(r0_json["results"].size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const auto want = single["results"][i]["tokens"].get<std::vector<std::vector<int>>>();
    const auto got = r0_json["results"][i]["tokens"].get<std::vector<std::vector<int>>>();
    ASSERT_EQ(want.size(), i == 0 ? 1u : 3u);
    for (const auto& seq : want) EXPECT_EQ(seq.size(), 12u);
    EXPECT_EQ(got, want) << "batch " << single["results"][i]["batch"];
  }
  EXPECT_TRUE(r0_json["tokens_identical"].get<bool>());
}

INSTANTIATE_TEST_SUITE_P(Links, TwoStagePipelineTest,
                         ::testing::Values(Link::kDirect, Link::kSocket, Link::kDirectOwnStreams),
                         [](const auto& info) {
                           return info.param == Link::kSocket   ? "Socket"
                                  : info.param == Link::kDirect ? "Direct"
                                                                : "DirectOwnStreams";
                         });

}  // namespace
}  // namespace tandem
