// A run folder's results.json reads back into the result that wrote it, and every malformed
// results.json gets an error naming the file and the field.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "loadgen/sweep.h"

namespace tandem::loadgen {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

fs::path TempDir(const std::string& name) {
  const char* base = std::getenv("TANDEM_TEST_TMPDIR");
  fs::path dir = fs::path(base != nullptr ? base : fs::temp_directory_path().string()) /
                 ("sweep_report_test-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void Write(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

SweepResult Sample(const fs::path& out) {
  SweepResult r;
  r.options.out = out;
  r.options.nodes = {1, 2};
  r.options.batch = {4};
  r.options.prompt_lens = {16};
  r.options.output_lens = {8};
  r.options.worker_metrics = {"127.0.0.1:1", "127.0.0.1:2"};
  r.options.weak_scaling = true;
  r.all_correct = false;
  r.reference_has_gaps = true;
  r.server = ServedModel{.name = "m", .dtype = "bfloat16", .kv_cache_dtype = "fp8_e4m3"};
  for (int nodes : {1, 2}) {
    ConfigResult c;
    c.nodes = c.stages = nodes;
    c.mode = "closed";
    c.batch = 4;
    c.prompt_len = 16;
    c.output_len = 8;
    c.requests = 8;
    c.errors = nodes - 1;
    c.wall_s = 2.5 / nodes;
    c.tokens = 64;
    c.tokens_per_s = 25.6 * nodes;
    c.ttft_p50 = 0.01 * nodes;
    c.itl_p99 = 0.003;
    c.e2e_p90 = 0.2;
    c.pause_p99 = 0.75 * nodes;
    c.pause_max = 1.25 * nodes;
    c.speedup = nodes;
    c.efficiency = 1;
    c.has_gpu = true;
    c.energy_j = 100.5 * nodes;
    c.power_w = 400;
    c.tokens_per_joule = 0.64;
    c.peak_gpu_memory_bytes = 3e9;
    c.correct = nodes == 1;
    c.mismatches = nodes - 1;
    c.near_ties = nodes - 1;
    if (nodes == 2) {
      c.differences.push_back({.prompt = 3,
                               .requests = 2,
                               .verdict = {.agreement = Agreement::kNearTie,
                                           .position = 17,
                                           .gap = 0.00390625,
                                           .reference_token = "1234",
                                           .token = "5678"}});
      c.differences.push_back({.prompt = 5,
                               .requests = 1,
                               .verdict = {.agreement = Agreement::kDiffers,
                                           .position = 2,
                                           .gap = 1.25,
                                           .reference_token = "11",
                                           .token = "12"}});
    }
    for (int s = 0; s < nodes; ++s) c.stage_share[s] = StageShare{1.5 + s, 0.25, 1e6};
    c.precision = nodes == 1 ? "cuda f16, weights fp8" : "cuda f16, weights as stored";
    c.tensor_parallel = nodes;
    r.configs.push_back(c);
  }
  return r;
}

TEST(ReadResultsTest, ReadsBackWhatWriteReportWrote) {
  const fs::path dir = TempDir("roundtrip");
  const SweepResult want = Sample(dir);
  ASSERT_TRUE(WriteReport(want).ok());
  fs::remove(dir / "summary.md");
  absl::StatusOr<SweepResult> got = ReadResults(dir);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->options.out, dir);
  EXPECT_EQ(got->options.nodes, want.options.nodes);
  EXPECT_EQ(got->options.worker_metrics, want.options.worker_metrics);
  EXPECT_TRUE(got->options.weak_scaling);
  EXPECT_FALSE(got->all_correct);
  ASSERT_EQ(got->configs.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const ConfigResult &a = got->configs[i], &b = want.configs[i];
    EXPECT_EQ(a.nodes, b.nodes);
    EXPECT_EQ(a.errors, b.errors);
    EXPECT_DOUBLE_EQ(a.tokens_per_s, b.tokens_per_s);
    EXPECT_DOUBLE_EQ(a.ttft_p50, b.ttft_p50);
    EXPECT_DOUBLE_EQ(a.itl_p99, b.itl_p99);
    EXPECT_DOUBLE_EQ(a.e2e_p90, b.e2e_p90);
    EXPECT_DOUBLE_EQ(a.pause_p99, b.pause_p99);
    EXPECT_DOUBLE_EQ(a.pause_max, b.pause_max);
    EXPECT_DOUBLE_EQ(a.energy_j, b.energy_j);
    EXPECT_EQ(a.correct, b.correct);
    EXPECT_EQ(a.mismatches, b.mismatches);
    EXPECT_EQ(a.near_ties, b.near_ties);
    EXPECT_EQ(a.precision, b.precision);
    EXPECT_EQ(a.tensor_parallel, b.tensor_parallel);
    ASSERT_EQ(a.differences.size(), b.differences.size());
    for (size_t k = 0; k < b.differences.size(); ++k) {
      EXPECT_EQ(a.differences[k].prompt, b.differences[k].prompt);
      EXPECT_EQ(a.differences[k].requests, b.differences[k].requests);
      EXPECT_EQ(a.differences[k].verdict.agreement, b.differences[k].verdict.agreement);
      EXPECT_EQ(a.differences[k].verdict.position, b.differences[k].verdict.position);
      EXPECT_DOUBLE_EQ(a.differences[k].verdict.gap, b.differences[k].verdict.gap);
      EXPECT_EQ(a.differences[k].verdict.token, b.differences[k].verdict.token);
    }
    ASSERT_EQ(a.stage_share.size(), b.stage_share.size());
    for (const auto& [stage, share] : b.stage_share) {
      EXPECT_DOUBLE_EQ(a.stage_share.at(stage).compute_s, share.compute_s);
      EXPECT_DOUBLE_EQ(a.stage_share.at(stage).bytes, share.bytes);
    }
  }
  EXPECT_EQ(got->server.kv_cache_dtype, "fp8_e4m3");
  EXPECT_EQ(got->server.dtype, "bfloat16");
  // The report made again from it is the same report.
  ASSERT_TRUE(WriteReport(*got).ok());
  std::ifstream md(dir / "summary.md");
  std::string text((std::istreambuf_iterator<char>(md)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("| 2 | 4 | 16 | 8 | 51.2 |"));
  EXPECT_THAT(text, HasSubstr("Server: model m (weights bfloat16, KV-cache fp8_e4m3)"));
  EXPECT_THAT(text, HasSubstr("Precision (the workers' `tandem_worker_precision_info`): cuda f16, "
                              "weights fp8; cuda f16, weights as stored.\n"));
  EXPECT_THAT(text, HasSubstr("NO (1 differ, 1 failed)"));
  // The rule that judged, and each difference with the reference's gap at its first token.
  EXPECT_THAT(text, HasSubstr("Correctness: **FAIL**"));
  EXPECT_THAT(text, HasSubstr("top-2 logprob gap is at least 0.05 nats"));
  EXPECT_THAT(text,
              HasSubstr("near-tie: prompt 3 (x2), token 17, gap 0.003906 (`1234` -> `5678`)"));
  EXPECT_THAT(text, HasSubstr("differs: prompt 5, token 2, gap 1.25 (`11` -> `12`)"));
  EXPECT_THAT(text, HasSubstr("`--batch_invariant`"));  // near-ties with GPU workers
}

// Two runs side by side (tandem-loadgen compare): one row per run and configuration, each with
// its precision and its tokens/s over the first run's at the same nodes, load and lengths.
TEST(CompareRunsTest, PutsRunsSideBySideWithTheirRatioToTheFirst) {
  SweepResult fp16 = Sample(TempDir("fp16"));
  SweepResult fp8 = Sample(TempDir("fp8"));
  for (ConfigResult& c : fp16.configs) {
    c.precision = "cuda f16, weights as stored";
    c.tensor_parallel = 1;
  }
  for (ConfigResult& c : fp8.configs) {
    c.precision = "cuda f16, weights fp8";
    c.tokens_per_s *= 1.5;
    c.tensor_parallel = 1;
  }
  fp8.server.kv_cache_dtype = "auto";
  fp8.configs[0].tensor_parallel = 2;  // one worker over two GPUs
  fp8.configs[1].prompt_len = 32;      // no configuration of the first run to compare with
  const std::string md = CompareRuns({fp16, fp8});
  const std::string name16 = fp16.options.out.filename().string();
  const std::string name8 = fp8.options.out.filename().string();
  EXPECT_THAT(md, HasSubstr("| run | precision | KV-cache | nodes | layout | load |"));
  EXPECT_THAT(md, HasSubstr("| " + name16 +
                            " | cuda f16, weights as stored | fp8_e4m3 | 1 | 1 stage "
                            "x 1 replica | batch 4 | 16 | 8 | 25.6 | 1.00x | 10.0 |"));
  EXPECT_THAT(md, HasSubstr("| " + name16 +
                            " | cuda f16, weights as stored | fp8_e4m3 | 2 | 2 "
                            "stages x 1 replica | batch 4 | 16 | 8 | 51.2 | 1.00x |"));
  EXPECT_THAT(md, HasSubstr("| " + name8 +
                            " | cuda f16, weights fp8 | auto | 1 | 1 stage x 1 "
                            "replica, TP2 | batch 4 | 16 | 8 | 38.4 | 1.50x |"));
  EXPECT_THAT(md, HasSubstr("| " + name8 +
                            " | cuda f16, weights fp8 | auto | 2 | 2 stages x 1 "
                            "replica | batch 4 | 32 | 8 | 76.8 | n/a |"));
  EXPECT_THAT(md, HasSubstr("| 400.0 | 0.64 | 2.79 | yes |"));
  // A run whose workers did not say.
  fp8.configs[0].precision.clear();
  EXPECT_THAT(CompareRuns({fp8}), HasSubstr("| not reported |"));
}

// A run folder's accuracy.json (tandem-bench --agreement --json's "agreement", a perplexity) is
// read with its results and shown beside the run's speed; a run without one says n/a.
TEST(CompareRunsTest, ShowsEachRunsAccuracyFromItsFolder) {
  const fs::path fp16_dir = TempDir("acc-fp16"), fp8_dir = TempDir("acc-fp8");
  ASSERT_TRUE(WriteReport(Sample(fp16_dir)).ok());
  ASSERT_TRUE(WriteReport(Sample(fp8_dir)).ok());
  Write(fp8_dir / "accuracy.json",
        R"({"model": "m", "agreement": {"positions": 528, "kl_mean": 0.27, )"
        R"("top1_agreement": 0.1212}, "perplexity": 25.0094})");
  absl::StatusOr<SweepResult> a = ReadResults(fp16_dir), b = ReadResults(fp8_dir);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_FALSE(a->accuracy.has_value());
  ASSERT_TRUE(b->accuracy.has_value());
  EXPECT_DOUBLE_EQ(b->accuracy->kl_mean, 0.27);
  const std::string md = CompareRuns({*a, *b});
  EXPECT_THAT(md, HasSubstr("| KL vs fp16 (nats) | top-1 vs fp16 | perplexity |"));
  EXPECT_THAT(md, HasSubstr("| yes | n/a | n/a | n/a |"));
  EXPECT_THAT(md, HasSubstr("| 0.27 | 12.1% | 25.0094 |"));
  // Only a perplexity.
  Write(fp8_dir / "accuracy.json", R"({"perplexity": 24.9939})");
  b = ReadResults(fp8_dir);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(CompareRuns({*b}), HasSubstr("| n/a | n/a | 24.9939 |"));
}

TEST(CompareRunsTest, AMalformedAccuracyFileIsNamed) {
  const fs::path dir = TempDir("acc-bad");
  ASSERT_TRUE(WriteReport(Sample(dir)).ok());
  auto error = [&](const std::string& text) {
    Write(dir / "accuracy.json", text);
    absl::StatusOr<SweepResult> r = ReadResults(dir);
    EXPECT_FALSE(r.ok()) << text;
    return std::string(r.status().message());
  };
  EXPECT_THAT(error("{"), HasSubstr("accuracy.json is not JSON"));
  EXPECT_THAT(error("[1]"), HasSubstr("expected an object with \"agreement\""));
  EXPECT_THAT(error(R"({"model": "m"})"), HasSubstr("or \"perplexity\""));
  EXPECT_THAT(error(R"({"agreement": {"kl_mean": 0.1}})"),
              HasSubstr("field 'top1_agreement' is missing"));
  EXPECT_THAT(error(R"({"perplexity": "low"})"),
              HasSubstr("field 'perplexity' has the wrong type"));
  EXPECT_THAT(error(R"({"agreement": 3})"), HasSubstr("'agreement' is missing or not an object"));
  EXPECT_THAT(error(std::string(1100000, ' ') + "{}"),
              HasSubstr("accuracy.json is 1100002 bytes, larger than the limit of 1 MiB"));
  EXPECT_THAT(error(std::string(200, '[') + std::string(200, ']')), HasSubstr("128"));
}

// `json` followed by as many spaces as make it `bytes` long.
std::string PaddedTo(const std::string& json, size_t bytes) {
  return json + std::string(bytes - json.size(), ' ');
}

// An accuracy.json of exactly kMaxAccuracyJsonBytes (1 MiB) is read; one byte more is refused
// naming the file and the limit.
TEST(CompareRunsTest, AnAccuracyFileOfTheLimitIsReadAndOneByteMoreIsRefused) {
  static_assert(kMaxAccuracyJsonBytes == 1 << 20);
  const fs::path dir = TempDir("acc-limit");
  ASSERT_TRUE(WriteReport(Sample(dir)).ok());
  const std::string json = R"({"perplexity": 24.5})";
  Write(dir / "accuracy.json", PaddedTo(json, kMaxAccuracyJsonBytes));
  ASSERT_EQ(fs::file_size(dir / "accuracy.json"), kMaxAccuracyJsonBytes);
  absl::StatusOr<SweepResult> r = ReadResults(dir);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->accuracy.has_value());
  EXPECT_DOUBLE_EQ(r->accuracy->perplexity, 24.5);

  Write(dir / "accuracy.json", PaddedTo(json, kMaxAccuracyJsonBytes + 1));
  r = ReadResults(dir);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr((dir / "accuracy.json").string() +
                        " is 1048577 bytes, larger than the limit of 1 MiB"));
}

// A results.json of exactly the reader's limit is read; one byte more is refused naming the file
// and the limit.
TEST(ReadResultsTest, AResultsFileOfTheLimitIsReadAndOneByteMoreIsRefused) {
  const fs::path dir = TempDir("results-limit");
  ASSERT_TRUE(WriteReport(Sample(dir)).ok());
  std::ifstream in(dir / "results.json");
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const uintmax_t limit = json.size() + 100;
  Write(dir / "results.json", PaddedTo(json, limit));
  absl::StatusOr<SweepResult> r = ReadResults(dir, limit);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->configs.size(), 2u);

  Write(dir / "results.json", PaddedTo(json, limit + 1));
  r = ReadResults(dir, limit);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr(absl::StrCat((dir / "results.json").string(), " is ", limit + 1,
                                     " bytes, larger than the limit of ", limit, " bytes")));
}

// ReadResults' limit is kMaxResultsJsonBytes (256 MiB) unless it is given one: a (sparse) file of
// one byte more is refused naming that limit, without being read.
TEST(ReadResultsTest, TheResultsLimitIs256MiBByDefault) {
  static_assert(kMaxResultsJsonBytes == uintmax_t{256} << 20);
  const fs::path dir = TempDir("results-default-limit");
  const fs::path path = dir / "results.json";
  Write(path, "{}");
  fs::resize_file(path, kMaxResultsJsonBytes + 1);
  absl::StatusOr<SweepResult> r = ReadResults(dir);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr(path.string() + " is 268435457 bytes, larger than the limit of 256 MiB"));
  fs::remove(path);
}

TEST(SummaryTest, TheServerLineSaysOnlyWhatTheServerSaid) {
  // /v1/models of an OpenAI server without --admin: a name, the context and the vocabulary.
  const fs::path dir = TempDir("server-line");
  SweepResult r = Sample(dir);
  r.server = ServedModel{.vocab_size = 50257, .context_length = 1024, .name = "gpt2-test"};
  ASSERT_TRUE(WriteReport(r).ok());
  std::ifstream md(dir / "summary.md");
  std::string text((std::istreambuf_iterator<char>(md)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text,
              HasSubstr("Server: model gpt2-test (context 1024 tokens, vocabulary 50257).\n"));
  EXPECT_THAT(text, Not(HasSubstr("0 layers")));
  EXPECT_THAT(text, Not(HasSubstr("(, ")));
  EXPECT_THAT(text, Not(HasSubstr("stage(s) x")));
}

TEST(ReadResultsTest, EachMalformedFileIsNamed) {
  const fs::path dir = TempDir("bad");
  absl::StatusOr<SweepResult> r = ReadResults(dir);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("results.json"));

  Write(dir / "results.json", "{not json");
  r = ReadResults(dir);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("is not JSON"));

  Write(dir / "results.json", "[1, 2]");
  EXPECT_THAT(std::string(ReadResults(dir).status().message()), HasSubstr("not a JSON object"));
  // Nested deeper than any results are: refused before anything walks it.
  Write(dir / "results.json",
        "{\"configs\": " + std::string(1000, '[') + std::string(1000, ']') + "}");
  r = ReadResults(dir);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("results.json"));

  // A whole file, then one field at a time broken.
  const fs::path good = TempDir("good");
  ASSERT_TRUE(WriteReport(Sample(good)).ok());
  std::ifstream in(good / "results.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  struct Case {
    std::string from, to, message;
  };
  for (const Case& c : std::vector<Case>{
           {"\"options\"", "\"opts\"", "field 'options' is missing"},
           {"\"configs\"", "\"confs\"", "field 'configs' is missing"},
           {"\"tokens_per_s\"", "\"tps\"", "configs[0]: field 'tokens_per_s' is missing"},
           {"\"mode\": \"closed\"", "\"mode\": 7", "field 'mode' has the wrong type"},
           {"\"ttft_s\"", "\"ttft\"", "field 'ttft_s' is missing or not an object"},
           {"\"0\": {", "\"first\": {", "stage 'first' is not a stage index"},
           {"\"nodes\": [", "\"nodes\": [] , \"x\": [", "at least one node count"},
       }) {
    std::string t = text;
    const size_t at = t.find(c.from);
    ASSERT_NE(at, std::string::npos) << c.from;
    t.replace(at, c.from.size(), c.to);
    Write(dir / "results.json", t);
    r = ReadResults(dir);
    ASSERT_FALSE(r.ok()) << c.from;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.from;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.message)) << c.from;
  }
}

}  // namespace
}  // namespace tandem::loadgen
