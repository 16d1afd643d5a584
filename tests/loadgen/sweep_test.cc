// A CPU sweep on a tiny model, 1 and 2 stages, batch 1, 2, 4, 8, as a user runs it: the real
// tandem-loadgen binary against a real coordinator and two workers. It must write the whole run
// folder, plots that are PNGs with data in them, pass the correctness check against reference runs
// with top-2 logprobs, leave the layout it found, and write no terminal escapes into a log. A
// layout the workers refuse fails a sweep at once with the coordinator's reason; a failed sweep
// leaves the layout it found too; over the OpenAI API the Server line comes from /v1/models.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/httplib.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster.h"
#include "tools/model_generator.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::Cluster;
using testing::PrintedMetricsPort;
using testing::ReadFile;

// A fresh folder under the test's temp dir, named `name` and the process id, with a random
// checkpoint of `preset` in model/.
fs::path ModelFolder(const std::string& name, const std::string& preset, uint64_t seed) {
  const fs::path dir = fs::path(::testing::TempDir()) / absl::StrFormat("%s-%d", name, getpid());
  fs::remove_all(dir);
  absl::StatusOr<ModelConfig> config = PresetConfig(preset);
  EXPECT_TRUE(config.ok()) << config.status();
  if (config.ok()) {
    EXPECT_TRUE(WriteRandomCheckpoint(*config, GeneratorOptions{.seed = seed}, dir / "model").ok());
  }
  return dir;
}

// The layout that serves: stages of each pipeline (in order) and their count.
std::vector<int> ServingStages(Cluster& cluster) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::Topology t;
  const grpc::Status s = cluster.admin().GetTopology(&ctx, {}, &t);
  EXPECT_TRUE(s.ok()) << s.error_message();
  std::vector<int> stages;
  for (const auto& p : t.pipelines()) stages.push_back(p.stages_size());
  return stages;
}

// The run folder's results.json; null (and a test failure) where it does not parse.
nlohmann::json ReadResults(const fs::path& run) {
  try {
    return nlohmann::json::parse(ReadFile(run / "results.json"));
  } catch (const nlohmann::json::exception& e) {
    ADD_FAILURE() << run << "/results.json: " << e.what();
    return nullptr;
  }
}

TEST(SweepTest, CpuSweepWritesTheWholeRunFolderAndPassesTheCorrectnessCheck) {
  const fs::path dir = ModelFolder("sweep-test", "tiny-gpt2", 3);

  absl::StatusOr<std::unique_ptr<Cluster>> cluster =
      Cluster::Start({.model_dir = dir / "model", .workers = 2, .stages = 1, .replicas = 1,
                      .coordinator_flags = {"--metrics_address=127.0.0.1:0", "--max_slots=4"}});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::string> workers;
  for (int i = 0; i < 2; ++i) {
    const int port = PrintedMetricsPort((*cluster)->worker(i).Log(), "tandem-worker");
    ASSERT_GT(port, 0) << (*cluster)->Logs();
    workers.push_back(absl::StrCat("127.0.0.1:", port));
  }
  const fs::path run = dir / "run";
  const std::string cmd = absl::StrCat(
      TANDEM_LOADGEN_BIN, " sweep --addr=", (*cluster)->address(), " --worker_metrics=", workers[0],
      ",", workers[1],
      " --nodes=1,2 --batch=1,2,4,8 --requests=8 --warmup=2 --prompt_lens=12 --output_lens=10"
      " --out=",
      run.string(), " > ", (dir / "loadgen.log").string(), " 2>&1");
  const int rc = std::system(cmd.c_str());
  ASSERT_EQ(rc, 0) << ReadFile(dir / "loadgen.log") << (*cluster)->Logs();
  // The sweep ran at 2 stages last; the layout it found (1 stage) serves again.
  EXPECT_EQ(ServingStages(**cluster), std::vector<int>{1});
  // Progress into a file: plain lines, no carriage returns or escapes.
  const std::string log = ReadFile(dir / "loadgen.log");
  EXPECT_EQ(log.find('\r'), std::string::npos) << log;
  EXPECT_EQ(log.find('\033'), std::string::npos) << log;
  EXPECT_THAT(log, HasSubstr("\n[8/8] nodes=2 batch=8 prompt=12 output=10: 8 requests in"));
  EXPECT_THAT(log, HasSubstr("correctness: pass"));

  // results.csv: a header and one row per (nodes, batch).
  std::istringstream csv(ReadFile(run / "results.csv"));
  std::string line;
  std::vector<std::string> rows;
  while (std::getline(csv, line)) rows.push_back(line);
  ASSERT_EQ(rows.size(), 9u) << ReadFile(run / "results.csv");
  EXPECT_THAT(rows[0], HasSubstr("tokens_per_s"));
  EXPECT_THAT(rows[0], HasSubstr("ttft_p99_s"));

  // results.json: every configuration correct, tokens generated, both stages timed at 2 nodes.
  nlohmann::json j = ReadResults(run);
  ASSERT_FALSE(j.is_null());
  EXPECT_TRUE(j["all_correct"].get<bool>());
  EXPECT_EQ(j["correctness"], "pass");
  // The references carry the workers' top-2 logprobs; fp32 CPU outputs equal them exactly.
  EXPECT_TRUE(j["reference_has_gaps"].get<bool>());
  ASSERT_EQ(j["configs"].size(), 8u);
  for (const auto& c : j["configs"]) {
    EXPECT_TRUE(c["correct"].get<bool>()) << c.dump();
    EXPECT_EQ(c["errors"].get<int>(), 0) << c.dump();
    EXPECT_EQ(c["near_ties"].get<int>(), 0) << c.dump();
    EXPECT_TRUE(c["differences"].empty()) << c.dump();
    EXPECT_EQ(c["tokens"].get<double>(), 8 * 10) << c.dump();
    EXPECT_GT(c["tokens_per_s"].get<double>(), 0) << c.dump();
    EXPECT_GT(c["ttft_s"]["p50"].get<double>(), 0) << c.dump();
    EXPECT_GT(c["speedup"].get<double>(), 0) << c.dump();
    const int nodes = c["nodes"].get<int>();
    EXPECT_EQ(c["stages_time"].size(), static_cast<size_t>(nodes)) << c.dump();
    if (nodes == 2) {
      EXPECT_GT(c["stages_time"]["1"]["transfer_bytes"].get<double>(), 0) << c.dump();
    }
  }

  // The server's settings and the model, and a warning for batch 8 on 4 KV slots (the rows of
  // batch 8 measure its queue).
  const nlohmann::json& server = j["server"];
  EXPECT_EQ(server["model"], "model");
  EXPECT_EQ(server["model_dir"], (dir / "model").string());
  EXPECT_EQ(server["architecture"], "gpt2");
  EXPECT_EQ(server["dtype"], "float32");
  EXPECT_EQ(server["kv_cache_dtype"], "auto");
  EXPECT_EQ(server["max_slots"], 4);
  EXPECT_EQ(server["max_batch"], 4);  // with pages: every slot
  EXPECT_EQ(server["stages"], 1);
  EXPECT_EQ(server["replicas"], 1);
  ASSERT_EQ(j["warnings"].size(), 1u) << j["warnings"].dump();
  EXPECT_THAT(j["warnings"][0].get<std::string>(), HasSubstr("batch 8 is more than the 4"));
  EXPECT_THAT(ReadFile(dir / "loadgen.log"), HasSubstr("warning: batch 8 is more than the 4"));

  const std::string md = ReadFile(run / "summary.md");
  EXPECT_THAT(md, HasSubstr("| nodes | batch |"));
  EXPECT_THAT(md, HasSubstr("**pass**"));
  EXPECT_THAT(md, HasSubstr("4 KV slots per pipeline"));
  EXPECT_THAT(md, HasSubstr("**Warning:** batch 8"));
  // What the worker said it computes in (its tandem_worker_precision_info), in the summary and
  // each configuration's results.
  EXPECT_THAT(md, HasSubstr("Precision (the workers' `tandem_worker_precision_info`): cpu f32, "
                            "weights as stored.\n"));
  EXPECT_EQ(j["configs"][0]["precision"], "cpu f32, weights as stored");
  EXPECT_EQ(j["configs"][0]["tensor_parallel"], 1);

  for (const char* png : {"throughput_vs_batch.png", "latency_vs_batch.png",
                          "speedup_vs_nodes.png", "efficiency_vs_nodes.png", "compute_comm.png"}) {
    const std::string bytes = ReadFile(run / png);
    ASSERT_GT(bytes.size(), 8000u) << png << " is too small to hold a plot";
    EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8)) << png;
    EXPECT_EQ(bytes.substr(12, 4), "IHDR") << png;
  }
  cluster->reset();
  fs::remove_all(dir);
}

// Disaggregated prefill as a dimension of the sweep: two replicas, first both doing prompts and
// decoding, then one of them running prompts only; the second layout's greedy outputs must equal
// the first's, and its rows say so.
TEST(SweepTest, PrefillNodesAreASweepDimensionCheckedAgainstColocatedReplicas) {
  const fs::path dir = ModelFolder("sweep-prefill-test", "tiny-llama", 4);
  absl::StatusOr<std::unique_ptr<Cluster>> cluster =
      Cluster::Start({.model_dir = dir / "model", .workers = 2, .stages = 1, .replicas = 2,
                      .coordinator_flags = {"--metrics_address=127.0.0.1:0"}});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const fs::path run = dir / "run";
  const std::string cmd = absl::StrCat(
      TANDEM_LOADGEN_BIN, " sweep --addr=", (*cluster)->address(),
      " --nodes=2 --parallelism=data --prefill_nodes=0,1 --batch=2,4 --requests=8 --warmup=1"
      " --prompt_lens=12 --output_lens=10 --progress=false --out=",
      run.string(), " > ", (dir / "loadgen.log").string(), " 2>&1");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << ReadFile(dir / "loadgen.log") << (*cluster)->Logs();

  nlohmann::json j = ReadResults(run);
  ASSERT_FALSE(j.is_null());
  EXPECT_TRUE(j["all_correct"].get<bool>());
  ASSERT_EQ(j["configs"].size(), 4u);
  std::vector<int> prefill;
  for (const auto& c : j["configs"]) {
    EXPECT_TRUE(c["correct"].get<bool>()) << c.dump();
    EXPECT_EQ(c["tokens"].get<double>(), 8 * 10) << c.dump();
    prefill.push_back(c["prefill_nodes"].get<int>());
  }
  EXPECT_EQ(prefill, (std::vector<int>{0, 0, 1, 1}));
  std::istringstream csv(ReadFile(run / "results.csv"));
  std::string line;
  std::getline(csv, line);
  EXPECT_THAT(line, ::testing::EndsWith(",correct,prefill_nodes,workload"));
  std::getline(csv, line);
  EXPECT_THAT(line, ::testing::EndsWith(",true,0,fixed"));
  const std::string md = ReadFile(run / "summary.md");
  EXPECT_THAT(md, HasSubstr("| 2 (1 prefill) | 4 |"));
  EXPECT_THAT(md, HasSubstr("of them 0 or 1 running prompts only"));

  // The hand-offs happened: every request of the second layout outlives its first token.
  const int port = PrintedMetricsPort((*cluster)->Logs(), "tandem-coordinator");
  ASSERT_GT(port, 0);
  httplib::Client http("127.0.0.1", port);
  httplib::Result r = http.Get("/metrics");
  ASSERT_TRUE(r) << "no /metrics";
  std::smatch m;
  const std::string metrics = r->body;
  ASSERT_TRUE(std::regex_search(metrics, m, std::regex("tandem_prefill_handoffs_total ([0-9.e+]+)")))
      << metrics;
  EXPECT_GE(std::stod(m[1]), 2 * (8 + 1));
  cluster->reset();
  fs::remove_all(dir);
}

// Tensor parallelism as the sweep's node dimension: one worker of two ranks, its stage over one
// rank and then two (--parallelism tensor); every output of two ranks the same as one rank's, and
// the rows and the summary say how many ranks ran.
TEST(SweepTest, TensorParallelismSplitsOneStageOverTheNodeCountsRanks) {
  const fs::path dir = ModelFolder("sweep-tensor-test", "tiny-llama", 6);
  absl::StatusOr<std::unique_ptr<Cluster>> cluster =
      Cluster::Start({.model_dir = dir / "model",
                      .workers = 1,
                      .stages = 1,
                      .replicas = 1,
                      .worker_flags = {"--tensor_parallel=2"}});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const fs::path run = dir / "run";
  const std::string cmd =
      absl::StrCat(TANDEM_LOADGEN_BIN, " sweep --addr=", (*cluster)->address(),
                   " --nodes=1,2 --parallelism=tensor --batch=2 --requests=4 --warmup=1"
                   " --prompt_lens=12 --output_lens=8 --progress=false --out=",
                   run.string(), " > ", (dir / "loadgen.log").string(), " 2>&1");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << ReadFile(dir / "loadgen.log") << (*cluster)->Logs();
  nlohmann::json j = ReadResults(run);
  ASSERT_FALSE(j.is_null());
  EXPECT_TRUE(j["all_correct"].get<bool>());
  ASSERT_EQ(j["configs"].size(), 2u);
  std::vector<int> ranks;
  for (const auto& c : j["configs"]) {
    EXPECT_TRUE(c["correct"].get<bool>()) << c.dump();
    EXPECT_EQ(c["stages"].get<int>(), 1) << c.dump();
    ranks.push_back(c["tensor_parallel"].get<int>());
  }
  EXPECT_EQ(ranks, (std::vector<int>{1, 2}));
  EXPECT_THAT(ReadFile(run / "summary.md"), HasSubstr("as ranks of one stage (tensor parallel)"));
  cluster->reset();
  fs::remove_all(dir);
}

// The same sweep through the OpenAI-compatible HTTP API (--api openai), with the nodes set through
// tandem's gRPC Admin: the same tables, every output the same as the first node count's.
TEST(SweepTest, OpenAiApiSweepWritesTheSameTables) {
  const fs::path dir = ModelFolder("sweep-openai", "tiny-gpt2", 3);
  absl::StatusOr<std::unique_ptr<Cluster>> cluster =
      Cluster::Start({.model_dir = dir / "model", .workers = 2, .stages = 1, .replicas = 1,
                      .coordinator_flags = {"--metrics_address=", "--http_listen=127.0.0.1:0"}});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::smatch m;
  const std::string logs = (*cluster)->Logs();
  ASSERT_TRUE(std::regex_search(logs, m, std::regex("tandem-coordinator http on port ([0-9]+)")))
      << logs;
  const fs::path run = dir / "run";
  const std::string cmd = absl::StrCat(
      TANDEM_LOADGEN_BIN, " sweep --api=openai --addr=http://127.0.0.1:", m[1].str(),
      " --admin=", (*cluster)->address(),
      " --nodes=1,2 --batch=1,4 --requests=8 --warmup=2 --prompt_lens=12 --output_lens=10"
      " --progress=false --out=",
      run.string(), " > ", (dir / "loadgen.log").string(), " 2>&1");
  const int rc = std::system(cmd.c_str());
  ASSERT_EQ(rc, 0) << ReadFile(dir / "loadgen.log") << (*cluster)->Logs();
  nlohmann::json j = ReadResults(run);
  ASSERT_FALSE(j.is_null());
  EXPECT_EQ(j["options"]["api"], "openai");
  EXPECT_TRUE(j["all_correct"].get<bool>());
  ASSERT_EQ(j["configs"].size(), 4u);
  for (const auto& c : j["configs"]) {
    EXPECT_EQ(c["errors"].get<int>(), 0) << c.dump();
    EXPECT_EQ(c["tokens"].get<double>(), 8 * 10) << c.dump();
    EXPECT_GT(c["ttft_s"]["p50"].get<double>(), 0) << c.dump();
    EXPECT_GT(c["itl_s"]["p50"].get<double>(), 0) << c.dump();
  }
  EXPECT_EQ(j["correctness"], "pass");
  EXPECT_TRUE(j["reference_has_gaps"].get<bool>());
  EXPECT_EQ(ServingStages(**cluster), std::vector<int>{1});

  // Without --admin: the Server line from /v1/models alone, no blanks.
  const fs::path run2 = dir / "run-no-admin";
  const std::string cmd2 =
      absl::StrCat(TANDEM_LOADGEN_BIN, " sweep --api=openai --addr=http://127.0.0.1:", m[1].str(),
                   " --nodes=1 --batch=2 --requests=4 --warmup=0 --prompt_lens=12 --output_lens=10"
                   " --progress=false --out=",
                   run2.string(), " > ", (dir / "loadgen2.log").string(), " 2>&1");
  ASSERT_EQ(std::system(cmd2.c_str()), 0) << ReadFile(dir / "loadgen2.log");
  const std::string md = ReadFile(run2 / "summary.md");
  EXPECT_THAT(md, HasSubstr("Server: model model (context 256 tokens, vocabulary "));
  EXPECT_THAT(md, ::testing::Not(HasSubstr("0 layers")));
  EXPECT_THAT(md, ::testing::Not(HasSubstr("(, ")));
  cluster->reset();
  fs::remove_all(dir);
}

// Each workload runs end to end over a CPU worker, named in the tables, every output equal to
// its reference (the reference sends the same pool: mixed lengths, or the shared system prompt).
TEST(SweepTest, MixedAndSharedPrefixWorkloadsRunAndAreNamedInTheTables) {
  const fs::path dir = ModelFolder("sweep-workloads", "tiny-gpt2", 5);
  absl::StatusOr<std::unique_ptr<Cluster>> cluster =
      Cluster::Start({.model_dir = dir / "model",
                      .workers = 1,
                      .stages = 1,
                      .replicas = 1,
                      .coordinator_flags = {"--max_slots=4"}});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  for (const auto& [workload, flags, described] :
       {std::tuple<std::string, std::string, std::string>{
            "mixed", "--length_sigma=0.5 --prompt_lens=12 --output_lens=6", "mixed lengths"},
        {"shared_prefix", "--shared_prefix_len=24 --prompt_lens=4 --output_lens=4",
         "a 24-token system prompt"}}) {
    const fs::path run = dir / workload;
    const std::string log = (dir / (workload + ".log")).string();
    const std::string cmd = absl::StrCat(
        TANDEM_LOADGEN_BIN, " sweep --addr=", (*cluster)->address(), " --workload=", workload, " ",
        flags, " --nodes=1 --batch=2 --requests=6 --warmup=0 --prompt_pool=6",
        " --progress=false --out=", run.string(), " > ", log, " 2>&1");
    ASSERT_EQ(std::system(cmd.c_str()), 0) << ReadFile(log) << (*cluster)->Logs();
    EXPECT_THAT(ReadFile(log), HasSubstr("correctness: pass"));
    std::istringstream csv(ReadFile(run / "results.csv"));
    std::string header, row;
    std::getline(csv, header);
    std::getline(csv, row);
    EXPECT_TRUE(absl::EndsWith(header, ",workload")) << header;
    EXPECT_TRUE(absl::EndsWith(row, absl::StrCat(",", workload))) << row;
    EXPECT_THAT(ReadFile(run / "summary.md"), HasSubstr(described));
    const nlohmann::json j = ReadResults(run);
    ASSERT_FALSE(j.is_null());
    EXPECT_EQ(j["options"]["workload"], workload);
    EXPECT_EQ(j["configs"][0]["errors"], 0);
  }
  cluster->reset();
  fs::remove_all(dir);
}

// --check=false: no reference runs (nothing says "reference" in the log), every output counted as
// unchecked, and the summary says why.
TEST(SweepTest, CheckFalseMakesNoReferenceRunsAndSaysSo) {
  const fs::path dir = ModelFolder("sweep-no-check", "tiny-gpt2", 6);
  absl::StatusOr<std::unique_ptr<Cluster>> cluster = Cluster::Start(
      {.model_dir = dir / "model", .workers = 1, .stages = 1, .replicas = 1});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const fs::path run = dir / "run";
  const std::string log = (dir / "sweep.log").string();
  const std::string cmd = absl::StrCat(
      TANDEM_LOADGEN_BIN, " sweep --addr=", (*cluster)->address(),
      " --check=false --nodes=1 --batch=2 --requests=4 --warmup=0 --prompt_pool=4",
      " --prompt_lens=8 --output_lens=4 --progress=false --out=", run.string(), " > ", log,
      " 2>&1");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << ReadFile(log) << (*cluster)->Logs();
  EXPECT_THAT(ReadFile(log), HasSubstr("correctness: not checked"));
  EXPECT_THAT(ReadFile(log), ::testing::Not(HasSubstr("reference")));
  EXPECT_THAT(ReadFile(run / "summary.md"), HasSubstr("`--check=false`"));
  const nlohmann::json j = ReadResults(run);
  ASSERT_FALSE(j.is_null());
  EXPECT_EQ(j["options"]["check"], false);
  EXPECT_EQ(j["configs"][0]["unchecked"], 4);
  EXPECT_EQ(j["configs"][0]["errors"], 0);
  cluster->reset();
  fs::remove_all(dir);
}

// Workers that refuse the plan (here: the checkpoint is outside their --model_root): the sweep
// fails at once with the coordinator's reason instead of waiting for the layout to serve.
TEST(SweepTest, ALayoutTheWorkersRefuseFailsTheSweepAtOnceWithTheReason) {
  const fs::path dir = ModelFolder("sweep-refused", "tiny-gpt2", 3);
  fs::create_directories(dir / "elsewhere");
  absl::StatusOr<std::unique_ptr<Cluster>> cluster =
      Cluster::Start({.model_dir = dir / "model",
                      .workers = 1,
                      .stages = 1,
                      .replicas = 1,
                      .coordinator_flags = {"--metrics_address="},
                      .worker_flags = {absl::StrCat("--model_root=", (dir / "elsewhere").string())},
                      .wait_until_serving = false});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  // `timeout` only keeps a hang from holding the test: the old loop waited 300 s.
  const std::string cmd =
      absl::StrCat("timeout 150 ", TANDEM_LOADGEN_BIN, " sweep --addr=", (*cluster)->address(),
                   " --nodes=1 --batch=1 --requests=2 --warmup=0 --prompt_lens=4 --output_lens=2"
                   " --progress=false --out=",
                   (dir / "run").string(), " > ", (dir / "loadgen.log").string(), " 2>&1");
  const int rc = std::system(cmd.c_str());
  const std::string log = ReadFile(dir / "loadgen.log");
  ASSERT_TRUE(WIFEXITED(rc)) << log;
  EXPECT_NE(WEXITSTATUS(rc), 124) << "the sweep waited for a layout that cannot serve\n" << log;
  EXPECT_EQ(WEXITSTATUS(rc), 1) << log;
  EXPECT_THAT(log, HasSubstr("cannot serve 1 stage(s) x 1 replica(s)"));
  EXPECT_THAT(log, HasSubstr("no checkpoint folder of that name under this worker's --model_root"));
  EXPECT_FALSE(fs::exists(dir / "run" / "results.csv"));
  cluster->reset();
  fs::remove_all(dir);
}

// A sweep that fails half-way (its second node count has more stages than the model has layers)
// leaves the layout it found: one stage, two replicas.
TEST(SweepTest, AFailedSweepLeavesTheLayoutItFound) {
  const fs::path dir = ModelFolder("sweep-restore", "tiny-gpt2", 3);
  absl::StatusOr<std::unique_ptr<Cluster>> cluster =
      Cluster::Start({.model_dir = dir / "model",
                      .workers = 2,
                      .stages = 1,
                      .replicas = 2,
                      .coordinator_flags = {"--metrics_address="}});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_EQ(ServingStages(**cluster), (std::vector<int>{1, 1}));
  const std::string cmd =
      absl::StrCat(TANDEM_LOADGEN_BIN, " sweep --addr=", (*cluster)->address(),
                   " --nodes=2,9 --batch=1 --requests=2 --warmup=0 --prompt_lens=4 --output_lens=2"
                   " --progress=false --out=",
                   (dir / "run").string(), " > ", (dir / "loadgen.log").string(), " 2>&1");
  const int rc = std::system(cmd.c_str());
  const std::string log = ReadFile(dir / "loadgen.log");
  EXPECT_EQ(WEXITSTATUS(rc), 1) << log;
  EXPECT_THAT(log, HasSubstr("cannot serve 9 stage(s) x 1 replica(s)"));
  EXPECT_THAT(log, HasSubstr("serves again: 1 stage(s) x 2 replica(s)"));
  EXPECT_EQ(ServingStages(**cluster), (std::vector<int>{1, 1})) << log;
  cluster->reset();
  fs::remove_all(dir);
}

TEST(SweepTest, UnreachableCoordinatorFailsWithANamedError) {
  const fs::path dir = fs::path(::testing::TempDir()) / absl::StrFormat("sweep-bad-%d", getpid());
  fs::create_directories(dir);
  const std::string cmd = absl::StrCat(TANDEM_LOADGEN_BIN,
                                       " sweep --addr=127.0.0.1:1 --nodes=1 --batch=1 "
                                       "--progress=false --out=",
                                       (dir / "run").string(), " > ", (dir / "log").string(),
                                       " 2>&1");
  const int rc = std::system(cmd.c_str());
  EXPECT_NE(rc, 0);
  EXPECT_THAT(ReadFile(dir / "log"), HasSubstr("GetModelInfo"));
  EXPECT_FALSE(fs::exists(dir / "run" / "results.csv"));
  fs::remove_all(dir);
}

TEST(SweepTest, BadFlagIsRejectedBeforeConnecting) {
  const fs::path dir = fs::path(::testing::TempDir()) / absl::StrFormat("sweep-flag-%d", getpid());
  fs::create_directories(dir);
  const std::string cmd =
      absl::StrCat(TANDEM_LOADGEN_BIN, " sweep --batch=1,x --out=", (dir / "run").string(), " > ",
                   (dir / "log").string(), " 2>&1");
  const int rc = std::system(cmd.c_str());
  EXPECT_EQ(WEXITSTATUS(rc), 2);
  EXPECT_THAT(ReadFile(dir / "log"), HasSubstr("--batch: 'x'"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tandem
