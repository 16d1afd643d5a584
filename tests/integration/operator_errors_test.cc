// An operator's mistakes through real processes on loopback, each answered with what to do: a
// relative --model_dir (the workers run elsewhere), and a checkpoint the workers cannot load (a
// folder with only PyTorch's pytorch_model.bin), whose load error reaches the client and
// `tandem-cli topology` instead of "no workers are up".
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster.h"
#include "tools/model_generator.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

fs::path& Base() {
  static fs::path dir;
  return dir;
}
fs::path ModelDir() { return Base() / "tiny-llama"; }

class OperatorErrorsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Base() = fs::path(::testing::TempDir()) / absl::StrFormat("tandem-operator-%d", getpid());
    absl::StatusOr<ModelConfig> c = PresetConfig("tiny-llama");
    ASSERT_TRUE(c.ok()) << c.status();
    absl::Status s = WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 5}, ModelDir());
    ASSERT_TRUE(s.ok()) << s;
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(Base(), ec);
  }
};

grpc::Status Generate(Cluster& c, v1::GenerateResponse* resp) {
  v1::GenerateRequest req;
  req.add_token_ids(1);
  req.add_token_ids(2);
  req.set_max_new_tokens(3);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return c.inference().Generate(&ctx, req, resp);
}

// stdout and stderr of a shell command.
std::string Output(const std::string& command) {
  std::string out;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), pipe)) out.append(buf.data(), n);
  pclose(pipe);
  return out;
}

TEST_F(OperatorErrorsTest, RelativeModelDirReachesWorkersInAnotherFolder) {
  // The coordinator runs in Base() and is given "tiny-llama"; the workers run in the test's
  // folder, where that relative path names nothing.
  ASSERT_FALSE(fs::exists(fs::current_path() / "tiny-llama"));
  absl::StatusOr<std::unique_ptr<Cluster>> cluster = Cluster::Start(
      {.model_dir = "tiny-llama", .workers = 1, .coordinator_cwd = Base()});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  v1::GenerateResponse resp;
  grpc::Status s = Generate(**cluster, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.token_ids_size(), 3);
}

TEST_F(OperatorErrorsTest, WorkerLoadErrorReachesTheClientAndTopology) {
  // A Hugging Face folder as PyTorch saved it: config and tokenizer, weights in
  // pytorch_model.bin only.
  const fs::path dir = Base() / "pytorch-only";
  fs::create_directories(dir);
  for (const fs::directory_entry& e : fs::directory_iterator(ModelDir())) {
    if (e.path().extension() == ".safetensors") continue;
    fs::copy_file(e.path(), dir / e.path().filename(), fs::copy_options::overwrite_existing);
  }
  std::ofstream(dir / "pytorch_model.bin") << "PK\x03\x04 a pickle tandem does not read";
  absl::StatusOr<std::unique_ptr<Cluster>> started =
      Cluster::Start({.model_dir = dir, .workers = 1, .wait_until_serving = false});
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;

  // The worker registers, fails to load, and the plan's error is kept.
  v1::Topology topology;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (topology.plan_error().empty() && absl::Now() < deadline) {
    grpc::ClientContext ctx;
    ASSERT_TRUE(cluster.admin().GetTopology(&ctx, {}, &topology).ok());
    absl::SleepFor(absl::Milliseconds(20));
  }
  const auto names_the_problem =
      AllOf(HasSubstr("pytorch_model.bin"), HasSubstr("safetensors"), HasSubstr(dir.string()));
  EXPECT_THAT(topology.plan_error(), names_the_problem) << cluster.Logs();
  EXPECT_EQ(topology.pipelines_size(), 0);

  v1::GenerateResponse resp;
  grpc::Status s = Generate(cluster, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), names_the_problem);
  EXPECT_THAT(s.error_message(), ::testing::Not(HasSubstr("workers are up")));

  EXPECT_THAT(Output(absl::StrCat(TANDEM_CLI_BIN, " topology --addr ", cluster.address())),
              AllOf(HasSubstr("plan_error"), HasSubstr("pytorch_model.bin")));

  // The coordinator itself goes on answering.
  grpc::ClientContext ctx;
  v1::ModelInfo info;
  EXPECT_TRUE(cluster.inference().GetModelInfo(&ctx, {}, &info).ok());
}

}  // namespace
}  // namespace tandem::testing
