// The paged KV-cache through real processes on loopback (a coordinator and two CPU workers, one
// stage each): with pages of 4 positions in a pool too small for the load, concurrent requests
// preempt each other and every output equals an undisturbed contiguous run's; with prefix
// caching, a repeated prompt's full pages are taken from the cache; n > 1 sequences fork the
// prompt's pages. An FP8 KV-cache (--kv_cache_dtype fp8) reaches the workers and serves.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <future>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/metrics.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster.h"
#include "tools/model_generator.h"

namespace tandem::testing {
namespace {

class PagedKvTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::filesystem::path(std::filesystem::path(::testing::TempDir()) /
                                     absl::StrFormat("tandem-paged-model-%d", getpid()));
    absl::StatusOr<ModelConfig> c = PresetConfig("tiny-llama");
    ASSERT_TRUE(c.ok()) << c.status();
    absl::Status s = WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 41}, *dir_);
    ASSERT_TRUE(s.ok()) << s;
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*dir_, ec);
    delete dir_;
  }

  static ClusterOptions TwoStages(std::vector<std::string> coordinator_flags) {
    ClusterOptions o;
    o.model_dir = *dir_;
    o.workers = 2;
    o.stages = 2;
    o.coordinator_flags = std::move(coordinator_flags);
    return o;
  }

  // Greedy tokens of `prompt` (24 new ones) from the cluster; empty with a failure on an error.
  static std::vector<int32_t> Greedy(Cluster& cluster, const std::vector<int32_t>& prompt) {
    v1::GenerateRequest req;
    req.mutable_token_ids()->Assign(prompt.begin(), prompt.end());
    req.set_max_new_tokens(24);
    req.set_ignore_eos(true);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    v1::GenerateResponse resp;
    grpc::Status s = cluster.inference().Generate(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message() << cluster.Logs();
    return {resp.token_ids().begin(), resp.token_ids().end()};
  }

  static std::vector<int32_t> Prompt(int k) {
    std::vector<int32_t> p;
    for (int i = 0; i < 13; ++i) p.push_back(1 + (7 * i + 11 * k) % 250);
    return p;
  }

  static std::filesystem::path* dir_;
};
std::filesystem::path* PagedKvTest::dir_ = nullptr;

TEST_F(PagedKvTest, PreemptedRequestsInATooSmallPoolGiveTheContiguousTokens) {
  constexpr int kRequests = 6;
  std::vector<std::vector<int32_t>> want(kRequests);
  {
    auto contiguous = Cluster::Start(TwoStages({}));
    ASSERT_TRUE(contiguous.ok()) << contiguous.status();
    for (int k = 0; k < kRequests; ++k) want[k] = Greedy(**contiguous, Prompt(k));
  }
  // 16 pages of 4 hold 64 positions; each request needs 37 (13 + 24): at most one runs whole.
  auto paged =
      Cluster::Start(TwoStages({"--kv_page_size=4", "--kv_pages=16", "--prefix_caching=false"}));
  ASSERT_TRUE(paged.ok()) << paged.status();
  std::vector<std::future<std::vector<int32_t>>> got;
  for (int k = 0; k < kRequests; ++k) {
    got.push_back(std::async(std::launch::async, [&, k] { return Greedy(**paged, Prompt(k)); }));
  }
  for (int k = 0; k < kRequests; ++k) {
    EXPECT_EQ(got[k].get(), want[k]) << "request " << k << (*paged)->Logs();
  }
}

TEST_F(PagedKvTest, ARepeatedPromptGivesTheSameTokensFromCachedPages) {
  auto contiguous = Cluster::Start(TwoStages({}));
  ASSERT_TRUE(contiguous.ok()) << contiguous.status();
  const std::vector<int32_t> want = Greedy(**contiguous, Prompt(0));
  auto paged = Cluster::Start(TwoStages({"--kv_page_size=4", "--kv_pages=40"}));
  ASSERT_TRUE(paged.ok()) << paged.status();
  for (int round = 0; round < 3; ++round) {
    EXPECT_EQ(Greedy(**paged, Prompt(0)), want) << "round " << round << (*paged)->Logs();
  }
}

TEST_F(PagedKvTest, ARequestLargerThanThePoolIsRefusedNamingTheCapacity) {
  auto paged = Cluster::Start(TwoStages({"--kv_page_size=4", "--kv_pages=4"}));
  ASSERT_TRUE(paged.ok()) << paged.status();
  v1::GenerateRequest req;
  const std::vector<int32_t> prompt = Prompt(1);
  req.mutable_token_ids()->Assign(prompt.begin(), prompt.end());
  req.set_max_new_tokens(24);  // 37 positions; the pool holds 16
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::GenerateResponse resp;
  grpc::Status s = (*paged)->inference().Generate(&ctx, req, &resp);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error_message().find("16"), std::string::npos) << s.error_message();
  // And the cluster still serves a request that fits.
  req.set_max_new_tokens(2);
  grpc::ClientContext ctx2;
  ctx2.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  EXPECT_TRUE((*paged)->inference().Generate(&ctx2, req, &resp).ok()) << (*paged)->Logs();
}

// n = 4 sampled sequences of one prompt: on pages the siblings fork the first one's full prompt
// pages (coordinator/scheduler_pages.cc) and each gives the contiguous layout's tokens.
TEST_F(PagedKvTest, NSequencesForkingThePromptsPagesGiveTheContiguousTokens) {
  v1::GenerateRequest req;
  const std::vector<int32_t> prompt = Prompt(3);
  req.mutable_token_ids()->Assign(prompt.begin(), prompt.end());
  req.set_max_new_tokens(24);
  req.set_ignore_eos(true);
  req.mutable_sampling()->set_temperature(1.0f);
  req.mutable_sampling()->set_seed(7);
  req.mutable_sampling()->set_n(4);
  auto choices = [&](Cluster& cluster) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    v1::GenerateResponse resp;
    grpc::Status s = cluster.inference().Generate(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message() << cluster.Logs();
    std::vector<std::vector<int32_t>> out;
    for (const v1::Choice& c : resp.choices()) {
      out.emplace_back(c.token_ids().begin(), c.token_ids().end());
    }
    return out;
  };
  std::vector<std::vector<int32_t>> want;
  {
    auto contiguous = Cluster::Start(TwoStages({}));
    ASSERT_TRUE(contiguous.ok()) << contiguous.status();
    want = choices(**contiguous);
  }
  ASSERT_EQ(want.size(), 4u);
  EXPECT_NE(want[0], want[1]) << "the sequences sample with seeds of their own";
  auto paged = Cluster::Start(TwoStages({"--kv_page_size=4", "--kv_pages=40"}));
  ASSERT_TRUE(paged.ok()) << paged.status();
  EXPECT_EQ(choices(**paged), want) << (*paged)->Logs();
}

// --kv_cache_dtype fp8 reaches every stage's AssignStage (each worker's start line says so), the
// model info and the coordinator's tandem_kv_cache_info; requests are served, and their greedy
// tokens are the same on every run of that configuration, from a prefix's cached pages too. (They
// may differ from the fp32 cache's at near ties; how many agree is printed.) A worker refuses an
// assignment of a KV-cache dtype it does not know, or of FP8 without pages, naming it, and goes on
// serving.
TEST_F(PagedKvTest, AnFp8KvCacheServesTheSameTokensOnEveryRun) {
  constexpr int kRequests = 3;
  const std::vector<std::string> fp8 = {"--kv_page_size=4", "--kv_pages=40",
                                        "--kv_cache_dtype=fp8"};
  std::vector<std::vector<int32_t>> first(kRequests);
  {
    std::vector<std::string> flags = fp8;
    flags.push_back("--metrics_address=127.0.0.1:0");
    auto cluster = Cluster::Start(TwoStages(flags));
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    Cluster& c = **cluster;
    const std::string logs = c.Logs();
    const std::string ready = "KV-cache fp8_e4m3 in 40 pages of 4 tokens";
    size_t stages = 0;
    for (size_t at = logs.find(ready); at != std::string::npos; at = logs.find(ready, at + 1)) {
      ++stages;
    }
    EXPECT_EQ(stages, 2u) << logs;
    grpc::ClientContext info_ctx;
    v1::ModelInfo info;
    ASSERT_TRUE(c.inference().GetModelInfo(&info_ctx, {}, &info).ok());
    EXPECT_EQ(info.kv_cache_dtype(), "fp8_e4m3");
    absl::StatusOr<std::string> metrics = FetchMetricsPage(
        absl::StrCat("127.0.0.1:", PrintedMetricsPort(logs, "tandem-coordinator")));
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    EXPECT_NE(metrics->find("\ntandem_kv_cache_info{dtype=\"fp8_e4m3\"} 1"), std::string::npos)
        << *metrics;
    for (int k = 0; k < kRequests; ++k) {
      first[k] = Greedy(c, Prompt(k));
      EXPECT_EQ(first[k].size(), 24u) << c.Logs();
    }
    EXPECT_EQ(Greedy(c, Prompt(0)), first[0]) << "from cached pages" << c.Logs();

    auto worker = v1::Worker::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", c.worker_port(0)), grpc::InsecureChannelCredentials()));
    auto assign = [&](const std::string& dtype, int page_size) {
      v1::AssignStageRequest req;
      req.set_assignment_id(12345);
      req.set_num_stages(1);
      req.set_model_dir(dir_->string());
      req.set_last_layer(-1);
      req.set_max_slots(2);
      req.set_max_seq_len(64);
      req.set_kv_page_size(page_size);
      req.set_kv_cache_dtype(dtype);
      v1::AssignStageResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      return worker->AssignStage(&ctx, req, &resp);
    };
    grpc::Status refused = assign("bogus", 4);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(refused.error_message(),
              "kv_cache_dtype: 'bogus' is not a KV-cache dtype (expected auto, fp8 or fp8_e4m3)");
    refused = assign("fp8_e4m3", 0);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(refused.error_message(),
              "kv_cache_dtype fp8_e4m3 needs the paged KV-cache, but kv_page_size is 0");
    EXPECT_EQ(Greedy(c, Prompt(1)), first[1]) << "after the refusals" << c.Logs();
  }
  auto again = Cluster::Start(TwoStages(fp8));
  ASSERT_TRUE(again.ok()) << again.status();
  for (int k = 0; k < kRequests; ++k) {
    EXPECT_EQ(Greedy(**again, Prompt(k)), first[k]) << "request " << k << (*again)->Logs();
  }
  again->reset();
  auto fp32 = Cluster::Start(TwoStages({"--kv_page_size=4", "--kv_pages=40"}));
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  int same = 0;
  for (int k = 0; k < kRequests; ++k) {
    const std::vector<int32_t> want = Greedy(**fp32, Prompt(k));
    for (size_t i = 0; i < want.size() && i < first[k].size() && want[i] == first[k][i]; ++i) {
      ++same;
    }
  }
  std::printf("FP8 KV-cache: %d of %d greedy tokens as the fp32 cache's before they part\n", same,
              24 * kRequests);
}

// The coordinator's sample `name` (a counter, without labels) from its /metrics; -1 when absent.
double CoordinatorSample(const Cluster& cluster, const std::string& name) {
  absl::StatusOr<std::string> page = FetchMetricsPage(
      absl::StrCat("127.0.0.1:", PrintedMetricsPort(cluster.Logs(), "tandem-coordinator")));
  if (!page.ok()) return -1;
  absl::StatusOr<std::vector<MetricSample>> samples = ParseMetricsText(*page);
  if (!samples.ok()) return -1;
  for (const MetricSample& s : *samples) {
    if (s.name == name) return s.value;
  }
  return -1;
}

// A prefill replica hands each FP8 prompt's KV-cache to the decode replica (the write-out of the
// prompt's last step, or where that fails an export: F8_E4M3 chunks with their layers' scales;
// kv_moves_test holds the write-out alone). The decode replica's pages then hold the very codes,
// so it gives the tokens of a single FP8 pipeline, and nothing is recomputed.
TEST_F(PagedKvTest, AnFp8PrefillReplicaHandsItsCodesToTheDecodeReplica) {
  constexpr int kRequests = 4;
  const std::vector<std::string> fp8 = {"--kv_page_size=4", "--kv_pages=40", "--kv_cache_dtype=fp8",
                                        "--metrics_address=127.0.0.1:0"};
  std::vector<std::vector<int32_t>> want(kRequests);
  {
    ClusterOptions one;
    one.model_dir = *dir_;
    one.coordinator_flags = fp8;
    auto single = Cluster::Start(one);
    ASSERT_TRUE(single.ok()) << single.status();
    for (int k = 0; k < kRequests; ++k) want[k] = Greedy(**single, Prompt(k));
  }
  ClusterOptions o;
  o.model_dir = *dir_;
  o.workers = 2;
  o.replicas = 2;
  o.coordinator_flags = fp8;
  o.coordinator_flags.push_back("--prefill_replicas=1");
  auto cluster = Cluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  for (int k = 0; k < kRequests; ++k) {
    EXPECT_EQ(Greedy(**cluster, Prompt(k)), want[k]) << "request " << k << (*cluster)->Logs();
  }
  EXPECT_EQ(CoordinatorSample(**cluster, "tandem_prefill_handoffs_total"), kRequests)
      << (*cluster)->Logs();
  EXPECT_EQ(CoordinatorSample(**cluster, "tandem_sequences_recomputed_total"), 0)
      << (*cluster)->Logs();
}

}  // namespace
}  // namespace tandem::testing
