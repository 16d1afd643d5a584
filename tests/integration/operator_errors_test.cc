// An operator's mistakes through real processes on loopback, each answered with what to do: a
// relative --model_dir (the workers run elsewhere), and a checkpoint the workers cannot load (a
// folder with only PyTorch's pytorch_model.bin), whose load error reaches the client and
// `tandem-cli topology` instead of "no workers are up". Every start-up error of every program
// (a bad model folder, config.json, YAML config, flag, a taken port, an open address without a
// cluster secret) ends the process with a non-zero exit status and a message, never a signal;
// --help exits 0 and shows every default.
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
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

// A shell command's exit status (as waitpid gives it) and its stdout and stderr.
struct Result {
  int status = -1;
  std::string output;
};

Result RunCommand(const std::string& command) {
  Result r;
  // The limit only ends a hang; every command here answers at once.
  FILE* pipe = popen(("timeout 120 " + command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), pipe)) r.output.append(buf.data(), n);
  r.status = pclose(pipe);
  return r;
}

std::string Output(const std::string& command) { return RunCommand(command).output; }

// A program that gave up on its own: exit(1..125). A signal (SIGSEGV: 139 through the shell) or
// the timeout (124) is not.
::testing::AssertionResult ExitedWithError(const Result& r) {
  if (!WIFEXITED(r.status)) {
    return ::testing::AssertionFailure() << "killed by a signal:\n" << r.output;
  }
  const int code = WEXITSTATUS(r.status);
  if (code == 0 || code == 124 || code > 125) {
    return ::testing::AssertionFailure() << "exit status " << code << ":\n" << r.output;
  }
  return ::testing::AssertionSuccess();
}

std::string Coordinator(const std::string& flags) {
  return absl::StrCat(TANDEM_COORDINATOR_BIN, " --listen=127.0.0.1:0 --metrics_address= ", flags);
}

// A folder with only this config.json.
fs::path ConfigDir(const std::string& name, const std::string& config_json) {
  const fs::path dir = Base() / name;
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << config_json;
  return dir;
}

TEST_F(OperatorErrorsTest, RelativeModelDirReachesWorkersInAnotherFolder) {
  // The coordinator runs in Base() and is given "tiny-llama"; the workers run in the test's
  // folder, where that relative path names nothing.
  ASSERT_FALSE(fs::exists(fs::current_path() / "tiny-llama"));
  absl::StatusOr<std::unique_ptr<Cluster>> cluster =
      Cluster::Start({.model_dir = "tiny-llama", .workers = 1, .coordinator_cwd = Base()});
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

TEST_F(OperatorErrorsTest, ModelDirMissingEmptyOrAFileExitsWithWhatToGive) {
  const fs::path empty = Base() / "empty";
  fs::create_directories(empty);
  const fs::path file = Base() / "a-file";
  std::ofstream(file) << "not a folder";
  for (const auto& [dir, problem] :
       {std::pair{Base() / "missing", "no such folder"}, std::pair{empty, "has no config.json"},
        std::pair{file, "is a file"}}) {
    const Result r = RunCommand(Coordinator(absl::StrCat("--model_dir=", dir.string())));
    EXPECT_TRUE(ExitedWithError(r)) << dir;
    EXPECT_THAT(r.output, AllOf(HasSubstr(dir.string()), HasSubstr(problem),
                                HasSubstr("folder of a Hugging Face checkpoint")));
  }
  const Result unset = RunCommand(Coordinator(""));
  EXPECT_TRUE(ExitedWithError(unset));
  EXPECT_THAT(unset.output, HasSubstr("model_dir is not set"));
}

TEST_F(OperatorErrorsTest, MalformedConfigJsonExitsNamingTheFileAndField) {
  // Each a mistake of its own, with what the message must name.
  const std::vector<std::pair<std::string, std::string>> variants = {
      {"", "not valid JSON"},
      {"{", "not valid JSON"},
      {"[1, 2]", "expected a JSON object"},
      {"null", "expected a JSON object"},
      {R"({"hidden_size": 64})", "model_type"},
      {R"({"model_type": 7})", "model_type"},
      {R"({"model_type": "llama"})", "missing field"},
      {R"({"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": -4, "num_attention_heads": 4, "max_position_embeddings": 64})",
       "must be positive"},
      {R"({"model_type": "llama", "vocab_size": "many", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "max_position_embeddings": 64})",
       "vocab_size"},
      {R"({"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 5, "max_position_embeddings": 64})",
       "divisible"},
      {R"({"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3,
           "max_position_embeddings": 64})",
       "num_key_value_heads"},
      {R"({"model_type": "gpt2", "vocab_size": 99999999999, "n_embd": 64, "n_layer": 2,
           "n_head": 4, "n_positions": 64})",
       "vocab_size"},
  };
  for (size_t i = 0; i < variants.size(); ++i) {
    const auto& [json, names] = variants[i];
    const fs::path dir = ConfigDir(absl::StrCat("bad-config-", i), json);
    const Result r = RunCommand(Coordinator(absl::StrCat("--model_dir=", dir.string())));
    EXPECT_TRUE(ExitedWithError(r)) << json;
    EXPECT_THAT(r.output, AllOf(HasSubstr((dir / "config.json").string()), HasSubstr(names)))
        << json;
  }
}

TEST_F(OperatorErrorsTest, UnknownModelTypeExitsNamingTheSupportedOnes) {
  const fs::path dir = ConfigDir("phi3", R"({"model_type": "phi3", "vocab_size": 512})");
  const Result r = RunCommand(Coordinator(absl::StrCat("--model_dir=", dir.string())));
  EXPECT_TRUE(ExitedWithError(r));
  EXPECT_THAT(r.output, AllOf(HasSubstr("\"phi3\""), HasSubstr("gpt2, llama, mistral, qwen2")));
}

TEST_F(OperatorErrorsTest, MoreStagesThanLayersExitsWithTheMostThatFit) {
  absl::StatusOr<ModelConfig> c = PresetConfig("tiny-llama");
  ASSERT_TRUE(c.ok());
  const Result r = RunCommand(Coordinator(
      absl::StrCat("--model_dir=", ModelDir().string(), " --stages=", 2 * c->num_layers)));
  EXPECT_TRUE(ExitedWithError(r));
  EXPECT_THAT(r.output, HasSubstr(absl::StrCat("--stages to at most ", c->num_layers)));
}

TEST_F(OperatorErrorsTest, BadYamlConfigExitsNamingTheFileAndSetting) {
  const std::vector<std::pair<std::string, std::string>> variants = {
      {"stagez: 2\n", "unknown setting 'stagez'"},
      {"stages: two\n", "setting 'stages'"},
      {"listen: [\n", "config.yaml"},
      {"- 1\n- 2\n", "must be a mapping"},
      {"max_batch: -1\n", "max_batch must be >= 0"},
  };
  for (const auto& [yaml, names] : variants) {
    const fs::path file = Base() / "config.yaml";
    std::ofstream(file) << yaml;
    const Result r = RunCommand(Coordinator(
        absl::StrCat("--model_dir=", ModelDir().string(), " --config=", file.string())));
    EXPECT_TRUE(ExitedWithError(r)) << yaml;
    EXPECT_THAT(r.output, HasSubstr(names)) << yaml;
  }
  const Result missing = RunCommand(Coordinator("--config=/nonexistent/tandem.yaml"));
  EXPECT_TRUE(ExitedWithError(missing));
  EXPECT_THAT(missing.output, HasSubstr("/nonexistent/tandem.yaml: cannot open"));
}

// --kv_cache_dtype takes vLLM's values (auto, fp8, fp8_e4m3): another value, from a flag or the
// YAML config, and fp8 with --kv_page_size 0 end the coordinator with a message naming them.
TEST_F(OperatorErrorsTest, ABadKvCacheDtypeOrFp8WithoutPagesExitsNamingThem) {
  const std::string model = absl::StrCat("--model_dir=", ModelDir().string());
  Result r = RunCommand(Coordinator(model + " --kv_cache_dtype=bogus"));
  EXPECT_TRUE(ExitedWithError(r));
  EXPECT_THAT(r.output, AllOf(HasSubstr("kv_cache_dtype: 'bogus' is not a KV-cache dtype"),
                              HasSubstr("expected auto, fp8 or fp8_e4m3")));
  const fs::path file = Base() / "kv_cache_dtype.yaml";
  std::ofstream(file) << "kv_cache_dtype: fp8_e5m2\n";
  r = RunCommand(Coordinator(model + " --config=" + file.string()));
  EXPECT_TRUE(ExitedWithError(r));
  EXPECT_THAT(r.output, HasSubstr("kv_cache_dtype: 'fp8_e5m2' is not a KV-cache dtype"));
  r = RunCommand(Coordinator(model + " --kv_cache_dtype=fp8 --kv_page_size=0"));
  EXPECT_TRUE(ExitedWithError(r));
  EXPECT_THAT(r.output, AllOf(HasSubstr("kv_cache_dtype fp8 keeps the KV-cache in pages"),
                              HasSubstr("kv_page_size 0")));
}

TEST_F(OperatorErrorsTest, FlagGivenOnTheCommandLineOverridesTheYamlConfig) {
  // The file asks for too many stages; the flag, at its default value, puts it right.
  const fs::path file = Base() / "stages.yaml";
  std::ofstream(file) << "stages: 64\n";
  const std::string base =
      absl::StrCat("--model_dir=", ModelDir().string(), " --config=", file.string());
  EXPECT_THAT(RunCommand(Coordinator(base)).output, HasSubstr("stages (64)"));
  absl::StatusOr<std::unique_ptr<Process>> p =
      Process::Start({TANDEM_COORDINATOR_BIN, "--listen=127.0.0.1:0",
                      "--metrics_address=", absl::StrCat("--model_dir=", ModelDir().string()),
                      absl::StrCat("--config=", file.string()), "--stages=1"},
                     Base() / "override.log");
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE((*p)->WaitForPort().ok()) << (*p)->Log();
}

TEST_F(OperatorErrorsTest, BadFlagValuesExitNamingTheFlag) {
  for (const auto& [command, names] : std::vector<std::pair<std::string, std::string>>{
           {Coordinator("--stages=two"), "stages"},
           {Coordinator("--no_such_flag=1"), "no_such_flag"},
           {absl::StrCat(TANDEM_WORKER_BIN, " --backend=tpu"), "--backend"},
           {absl::StrCat(TANDEM_WORKER_BIN, " --transport=pigeon"), "--transport"},
           {absl::StrCat(TANDEM_WORKER_BIN, " --launch_ahead=sometimes"), "--launch_ahead"},
           {absl::StrCat(TANDEM_WORKER_BIN, " --cpu_threads=x"), "cpu_threads"},
           {absl::StrCat(TANDEM_CLI_BIN, " frobnicate"), "unknown command 'frobnicate'"},
           {absl::StrCat(TANDEM_CLI_BIN, " generate --token_ids=1,x"), "--token_ids"},
           {absl::StrCat(TANDEM_LOADGEN_BIN, " sweep --batch=one"), "batch"},
           {absl::StrCat(TANDEM_MAKE_MODEL_BIN, " --preset=tiny-llama"), "--out"},
           {absl::StrCat(TANDEM_MAKE_MODEL_BIN, " --preset=huge --out=", Base().string(), "/m"),
            "unknown preset 'huge'"},
           {absl::StrCat(TANDEM_MAKE_MODEL_BIN, " --preset=tiny-llama --tokenizer=/nonexistent",
                         " --out=", Base().string(), "/m"),
            "--tokenizer /nonexistent"},
       }) {
    const Result r = RunCommand(command);
    EXPECT_TRUE(ExitedWithError(r)) << command;
    EXPECT_THAT(r.output, HasSubstr(names)) << command;
  }
}

TEST_F(OperatorErrorsTest, HelpExitsZeroAndShowsEveryDefault) {
  for (const auto& [program, flag] : std::vector<std::pair<std::string, std::string>>{
           {TANDEM_COORDINATOR_BIN, "--stages (default: 1)"},
           {TANDEM_WORKER_BIN, "--backend (default: \"cpu\")"},
           {TANDEM_CLI_BIN, "--max_new_tokens (default: 32)"},
           {TANDEM_LOADGEN_BIN, "--addr (default: "},
           {TANDEM_MAKE_MODEL_BIN, "--vocab_size (default: unset)"}}) {
    const Result r = RunCommand(program + " --help");
    ASSERT_TRUE(WIFEXITED(r.status)) << program;
    EXPECT_EQ(WEXITSTATUS(r.status), 0) << program << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(flag)) << program;
    EXPECT_THAT(r.output, ::testing::Not(HasSubstr("default: )"))) << program;
    EXPECT_THAT(r.output, ::testing::Not(HasSubstr("default: ;"))) << program;
  }
  // The coordinator's flags show the config's defaults, not "unset".
  const Result coordinator = RunCommand(absl::StrCat(TANDEM_COORDINATOR_BIN, " --help"));
  EXPECT_THAT(coordinator.output, AllOf(HasSubstr("--listen (default: \"127.0.0.1:50051\")"),
                                        HasSubstr("--max_waiting (default: -1)"),
                                        HasSubstr("--decode_ahead (default: true)"),
                                        ::testing::Not(HasSubstr("default: unset"))));
}

TEST_F(OperatorErrorsTest, TakenPortExitsNamingThePort) {
  absl::StatusOr<std::unique_ptr<Cluster>> cluster =
      Cluster::Start({.model_dir = ModelDir(), .workers = 0, .wait_until_serving = false});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string address = (*cluster)->address();
  const std::string port = address.substr(address.rfind(':') + 1);
  const Result second = RunCommand(
      absl::StrCat(TANDEM_COORDINATOR_BIN, " --metrics_address= --model_dir=", ModelDir().string(),
                   " --listen=", address));
  EXPECT_TRUE(ExitedWithError(second));
  EXPECT_THAT(second.output, AllOf(HasSubstr(absl::StrCat("port ", port)), HasSubstr("taken")));
  const Result worker = RunCommand(absl::StrCat(
      TANDEM_WORKER_BIN, " --metrics_address= --coordinator=", address, " --listen=", address));
  EXPECT_TRUE(ExitedWithError(worker));
  EXPECT_THAT(worker.output, AllOf(HasSubstr(absl::StrCat("port ", port)), HasSubstr("taken")));
  // The first coordinator still answers.
  grpc::ClientContext ctx;
  v1::ModelInfo info;
  EXPECT_TRUE((*cluster)->inference().GetModelInfo(&ctx, {}, &info).ok());
}

TEST_F(OperatorErrorsTest, OpenAddressWithoutClusterSecretIsRefusedUnlessAllowed) {
  const std::string open = "--listen=0.0.0.0:0 --metrics_address=";
  const Result coordinator = RunCommand(
      absl::StrCat(TANDEM_COORDINATOR_BIN, " ", open, " --model_dir=", ModelDir().string()));
  EXPECT_TRUE(ExitedWithError(coordinator));
  EXPECT_THAT(coordinator.output,
              AllOf(HasSubstr("--listen 0.0.0.0:0"), HasSubstr("--cluster_secret"),
                    HasSubstr("--allow_insecure")));
  const Result worker = RunCommand(absl::StrCat(TANDEM_WORKER_BIN, " ", open));
  EXPECT_TRUE(ExitedWithError(worker));
  EXPECT_THAT(worker.output, AllOf(HasSubstr("--listen 0.0.0.0:0"), HasSubstr("--allow_insecure")));
  // A secret, or the explicit flag, lets each start.
  const std::vector<std::vector<std::string>> starts = {
      {TANDEM_COORDINATOR_BIN, "--listen=0.0.0.0:0", "--metrics_address=",
       absl::StrCat("--model_dir=", ModelDir().string()), "--cluster_secret=s3cret"},
      {TANDEM_COORDINATOR_BIN, "--listen=0.0.0.0:0",
       "--metrics_address=", absl::StrCat("--model_dir=", ModelDir().string()), "--allow_insecure"},
      {TANDEM_WORKER_BIN, "--listen=0.0.0.0:0", "--metrics_address=", "--cluster_secret=s3cret"},
      {TANDEM_WORKER_BIN, "--listen=0.0.0.0:0", "--metrics_address=", "--allow_insecure"}};
  for (size_t i = 0; i < starts.size(); ++i) {
    absl::StatusOr<std::unique_ptr<Process>> p =
        Process::Start(starts[i], Base() / absl::StrCat("open-", i, ".log"));
    ASSERT_TRUE(p.ok());
    EXPECT_TRUE((*p)->WaitForPort().ok()) << absl::StrJoin(starts[i], " ") << "\n" << (*p)->Log();
  }
}

TEST_F(OperatorErrorsTest, InfoNamesTheModelFamily) {
  absl::StatusOr<ModelConfig> c = PresetConfig("tiny-qwen2");
  ASSERT_TRUE(c.ok());
  const fs::path dir = Base() / "tiny-qwen2";
  ASSERT_TRUE(WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 1}, dir).ok());
  absl::StatusOr<std::unique_ptr<Cluster>> cluster =
      Cluster::Start({.model_dir = dir, .workers = 0, .wait_until_serving = false});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const Result r = RunCommand(absl::StrCat(TANDEM_CLI_BIN, " info --addr ", (*cluster)->address()));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("model_type: \"qwen2\""));
}

}  // namespace
}  // namespace tandem::testing
