// End to end on loopback: a real coordinator and real CPU workers serve a random tiny Llama, and
// every answer is checked token for token against the single-process CPU engine.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/httplib.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster.h"
#include "tools/model_generator.h"
#include "worker/cpu/cpu_stage.h"

namespace tandem::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A generation request of the tests and what the oracle says it must produce.
struct Case {
  std::vector<int32_t> prompt;
  int max_new_tokens = 8;
  SamplingParams sampling;
  bool stream = false;
  bool ignore_eos = false;
};

std::filesystem::path& ModelDir() {
  static std::filesystem::path dir;
  return dir;
}

class ServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ModelDir() = std::filesystem::path(::testing::TempDir()) /
                 absl::StrFormat("tandem-service-model-%d", getpid());
    absl::StatusOr<ModelConfig> c = PresetConfig("tiny-llama");
    ASSERT_TRUE(c.ok()) << c.status();
    c->max_positions = 1024;  // room for long generations in the failure tests
    absl::Status s = WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 7}, ModelDir());
    ASSERT_TRUE(s.ok()) << s;
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(ModelDir(), ec);
  }

  // `default_heartbeats`: the coordinator's own heartbeat settings (what README's claims are
  // about) instead of the short ones of the tests.
  std::unique_ptr<Cluster> StartCluster(int workers, int stages, int replicas,
                                        std::vector<std::string> flags = {},
                                        bool default_heartbeats = false) {
    absl::StatusOr<std::unique_ptr<Cluster>> c = Cluster::Start(
        {.model_dir = ModelDir(), .workers = workers, .stages = stages, .replicas = replicas,
         .coordinator_flags = std::move(flags), .default_heartbeats = default_heartbeats});
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  // The single-process engine: one stage with every layer, one sequence at a time, the same step
  // semantics as the service (prefill samples the first token, then one token per step).
  static std::vector<int32_t> Oracle(const Case& c) {
    static std::unique_ptr<Stage> stage = [] {
      absl::StatusOr<std::unique_ptr<Stage>> s = MakeCpuStage(
          {.model_dir = ModelDir(), .first_layer = 0, .last_layer = -1, .max_slots = 1});
      EXPECT_TRUE(s.ok()) << s.status();
      return s.ok() ? *std::move(s) : nullptr;
    }();
    if (stage == nullptr) return {};
    const int eos = stage->config().eos_token_id;
    std::vector<int32_t> out;
    StepDescriptor d;
    d.seqs = {{.slot = 0, .position = 0, .num_tokens = static_cast<int>(c.prompt.size()),
               .sample = true, .sampling = c.sampling, .sample_index = 0}};
    d.tokens = c.prompt;
    while (true) {
      absl::StatusOr<StepOutput> o = stage->Step(d, Activations{});
      EXPECT_TRUE(o.ok()) << o.status();
      if (!o.ok()) return out;
      const int32_t t = o->tokens.at(0);
      out.push_back(t);
      if ((t == eos && !c.ignore_eos) || static_cast<int>(out.size()) >= c.max_new_tokens) {
        return out;
      }
      d.seqs[0].position += d.seqs[0].num_tokens;
      d.seqs[0].num_tokens = 1;
      d.seqs[0].sample_index = out.size();
      d.tokens = {t};
    }
  }

  // For a greedy case: the oracle's tokens and, at each, the gap between its two best logits.
  static std::vector<float> OracleGaps(const Case& c) {
    absl::StatusOr<std::unique_ptr<Stage>> stage = MakeCpuStage(
        {.model_dir = ModelDir(), .first_layer = 0, .last_layer = -1, .max_slots = 1});
    EXPECT_TRUE(stage.ok()) << stage.status();
    if (!stage.ok()) return {};
    const std::vector<int32_t> tokens = Oracle(c);
    std::vector<float> gaps;
    StepDescriptor d;
    d.return_logits = true;
    d.seqs = {{.slot = 0, .position = 0, .num_tokens = static_cast<int>(c.prompt.size()),
               .sample = true, .sampling = c.sampling, .sample_index = 0}};
    d.tokens = c.prompt;
    for (int32_t t : tokens) {
      absl::StatusOr<StepOutput> o = (*stage)->Step(d, Activations{});
      if (!o.ok()) break;
      std::vector<float> top(2);
      std::partial_sort_copy(o->logits.begin(), o->logits.end(), top.begin(), top.end(),
                             std::greater<float>());
      gaps.push_back(top[0] - top[1]);
      d.seqs[0].position += d.seqs[0].num_tokens;
      d.seqs[0].num_tokens = 1;
      d.tokens = {t};
    }
    return gaps;
  }

  // A greedy request whose KV-cache was recomputed (a prefill over its prompt and tokens instead
  // of the decode steps that made it) gives the oracle's tokens, or parts from them only where
  // the oracle's two best logits are within rounding of each other (a near tie: the recomputed
  // KV-cache differs from the decoded one in the last bits); past that point nothing is compared.
  static void ExpectOracleUpToNearTie(const std::vector<int32_t>& got, const Case& c,
                                      int request) {
    const std::vector<int32_t> want = Oracle(c);
    size_t k = 0;
    while (k < got.size() && k < want.size() && got[k] == want[k]) ++k;
    if (k == want.size() && got.size() == want.size()) return;
    ASSERT_LT(k, want.size()) << "request " << request << ": " << got.size() << " tokens";
    ASSERT_EQ(got.size(), want.size()) << "request " << request;
    const std::vector<float> gaps = OracleGaps(c);
    ASSERT_LT(k, gaps.size());
    EXPECT_LT(gaps[k], 1e-5f) << "request " << request << " parts from the oracle at token " << k
                              << " (" << got[k] << " for " << want[k]
                              << ") where its top-2 gap is " << gaps[k];
    std::printf("request %d: a near tie at token %zu (top-2 gap %.3g): %d for %d\n", request, k,
                gaps[k], got[k], want[k]);
  }

  static v1::GenerateRequest ToRequest(const Case& c) {
    v1::GenerateRequest r;
    r.mutable_token_ids()->Assign(c.prompt.begin(), c.prompt.end());
    r.set_max_new_tokens(c.max_new_tokens);
    r.mutable_sampling()->set_temperature(c.sampling.temperature);
    r.mutable_sampling()->set_top_k(c.sampling.top_k);
    r.mutable_sampling()->set_top_p(c.sampling.top_p);
    r.mutable_sampling()->set_seed(c.sampling.seed);
    r.set_ignore_eos(c.ignore_eos);
    return r;
  }

  // Generate or GenerateStream (tokens concatenated); the call's status in `status`.
  static std::vector<int32_t> Run(Cluster& cluster, const Case& c, grpc::Status* status,
                                  v1::FinishReason* finish = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    std::vector<int32_t> tokens;
    if (!c.stream) {
      v1::GenerateResponse resp;
      *status = cluster.inference().Generate(&ctx, ToRequest(c), &resp);
      tokens.assign(resp.token_ids().begin(), resp.token_ids().end());
      if (finish) *finish = resp.finish_reason();
      return tokens;
    }
    auto reader = cluster.inference().GenerateStream(&ctx, ToRequest(c));
    v1::GenerateStreamResponse msg;
    while (reader->Read(&msg)) {
      tokens.insert(tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
      if (finish && msg.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
        *finish = msg.finish_reason();
      }
    }
    *status = reader->Finish();
    return tokens;
  }

  // 16 requests of different prompt and output lengths, greedy and seeded, half streamed.
  static std::vector<Case> MixedCases(uint64_t salt) {
    std::vector<Case> cases;
    for (int i = 0; i < 16; ++i) {
      Case c;
      const int len = 1 + (i * 7 + static_cast<int>(salt)) % 23;
      for (int k = 0; k < len; ++k) c.prompt.push_back((i * 131 + k * 17 + salt * 7) % 500);
      c.max_new_tokens = 3 + (i * 5) % 17;
      if (i % 2 == 1) {
        c.sampling = {.temperature = 0.8f, .top_k = (i % 4 == 1) ? 40 : 0,
                      .top_p = (i % 4 == 3) ? 0.9f : 1.0f, .seed = 1000 + i + salt};
      }
      c.stream = i % 3 == 0;
      cases.push_back(c);
    }
    return cases;
  }

  // Runs the cases concurrently: each one's status and tokens, in order.
  static std::vector<std::pair<grpc::Status, std::vector<int32_t>>> RunAll(
      Cluster& cluster, const std::vector<Case>& cases) {
    std::vector<std::future<std::pair<grpc::Status, std::vector<int32_t>>>> futures;
    for (const Case& c : cases) {
      futures.push_back(std::async(std::launch::async, [&cluster, c] {
        grpc::Status s;
        std::vector<int32_t> t = Run(cluster, c, &s);
        return std::make_pair(s, t);
      }));
    }
    std::vector<std::pair<grpc::Status, std::vector<int32_t>>> answers;
    for (auto& f : futures) answers.push_back(f.get());
    return answers;
  }

  // Runs the cases concurrently and checks every answer against the oracle.
  static void ExpectMatchesOracle(Cluster& cluster, const std::vector<Case>& cases) {
    std::vector<std::pair<grpc::Status, std::vector<int32_t>>> answers = RunAll(cluster, cases);
    for (size_t i = 0; i < cases.size(); ++i) {
      auto& [status, tokens] = answers[i];
      ASSERT_TRUE(status.ok()) << "request " << i << ": " << status.error_message() << "\n"
                               << cluster.Logs();
      EXPECT_EQ(tokens, Oracle(cases[i])) << "request " << i;
    }
  }

  // Runs the cases concurrently while requests may be recomputed (a worker lost, a hand-off that
  // failed): every one must succeed; greedy ones match the oracle up to a near tie; sampled ones
  // are only checked to have tokens (see LongStreams' `greedy`).
  static void ExpectServedWhileRecomputing(Cluster& cluster, const std::vector<Case>& cases) {
    std::vector<std::pair<grpc::Status, std::vector<int32_t>>> answers = RunAll(cluster, cases);
    for (size_t i = 0; i < cases.size(); ++i) {
      auto& [status, tokens] = answers[i];
      ASSERT_TRUE(status.ok()) << "request " << i << ": " << status.error_message() << "\n"
                               << cluster.Logs();
      if (cases[i].sampling.temperature == 0.0f) {
        ExpectOracleUpToNearTie(tokens, cases[i], static_cast<int>(i));
      } else {
        EXPECT_FALSE(tokens.empty()) << "request " << i;
      }
    }
  }

  // Long streamed generations running in the background: Start returns once each has streamed a
  // token (so that its pipeline holds its KV-cache), Finish checks each against the oracle.
  class LongStreams {
   public:
    // `greedy`: every stream greedy (where recomputation is expected: a recomputed sampled stream
    // may part from the oracle where a draw falls within float error of a boundary, which only
    // the greedy check, ExpectOracleUpToNearTie, can tell from a bug); otherwise every other one
    // samples.
    LongStreams(Cluster& cluster, int n, uint64_t salt, bool greedy = false) : cluster_(cluster) {
      for (int i = 0; i < n; ++i) {
        Case c{.prompt = {static_cast<int32_t>(salt % 97 + i), 20, static_cast<int32_t>(30 + i)},
               .max_new_tokens = 400, .ignore_eos = true};
        if (i % 2 == 1 && !greedy) c.sampling = {.temperature = 0.9f, .seed = salt * 100 + i};
        cases_.push_back(c);
        futures_.push_back(std::async(std::launch::async, [this, c] {
          grpc::ClientContext ctx;
          ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
          auto reader = cluster_.inference().GenerateStream(&ctx, ToRequest(c));
          std::vector<int32_t> tokens;
          v1::GenerateStreamResponse msg;
          while (reader->Read(&msg)) {
            if (tokens.empty() && msg.token_ids_size() > 0) started_++;
            tokens.insert(tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
          }
          if (tokens.empty()) started_++;
          return std::make_pair(reader->Finish(), tokens);
        }));
      }
      while (started_.load() < n) absl::SleepFor(absl::Milliseconds(1));
    }
    // `recomputed`: some KV-caches may have been recomputed, so greedy requests may part from
    // the oracle at a near tie (ExpectOracleUpToNearTie); without, every token must match.
    void Finish(bool recomputed = false) {
      for (size_t i = 0; i < cases_.size(); ++i) {
        auto [status, tokens] = futures_[i].get();
        ASSERT_TRUE(status.ok()) << "request " << i << ": " << status.error_message() << "\n"
                                 << cluster_.Logs();
        if (recomputed && cases_[i].sampling.temperature == 0.0f) {
          ExpectOracleUpToNearTie(tokens, cases_[i], static_cast<int>(i));
        } else {
          const std::vector<int32_t> want = Oracle(cases_[i]);
          const size_t at = std::mismatch(tokens.begin(), tokens.end(), want.begin(), want.end())
                                .first - tokens.begin();
          EXPECT_EQ(tokens, want) << "request " << i << ": " << tokens.size() << " tokens against "
                                  << want.size() << ", first difference at token " << at << "\n"
                                  << cluster_.Logs();
        }
      }
    }

   private:
    Cluster& cluster_;
    std::vector<Case> cases_;
    std::atomic<int> started_{0};
    std::vector<std::future<std::pair<grpc::Status, std::vector<int32_t>>>> futures_;
  };

  static absl::StatusOr<v1::Topology> SetTopology(Cluster& cluster, int stages, int replicas,
                                                  std::optional<int> prefill_replicas = {}) {
    grpc::ClientContext ctx;
    v1::SetTopologyRequest req;
    req.set_stages(stages);
    req.set_replicas(replicas);
    if (prefill_replicas) req.set_prefill_replicas(*prefill_replicas);
    v1::Topology t;
    grpc::Status s = cluster.admin().SetTopology(&ctx, req, &t);
    if (!s.ok()) return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                                     s.error_message());
    return t;
  }
};

struct Shape {
  int stages;
  int replicas;
};

class ServiceShapeTest : public ServiceTest, public ::testing::WithParamInterface<Shape> {};

TEST_P(ServiceShapeTest, ConcurrentRequestsMatchSingleProcessEngine) {
  const Shape shape = GetParam();
  auto cluster = StartCluster(shape.stages * shape.replicas, shape.stages, shape.replicas);
  ASSERT_NE(cluster, nullptr);
  ExpectMatchesOracle(*cluster, MixedCases(shape.stages * 10 + shape.replicas));
}

INSTANTIATE_TEST_SUITE_P(Topologies, ServiceShapeTest,
                         ::testing::Values(Shape{1, 1}, Shape{2, 1}, Shape{3, 1}, Shape{1, 2}),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return absl::StrFormat("%dStages%dReplicas", info.param.stages,
                                                  info.param.replicas);
                         });

// The clusters of these tests start their CPU workers with --launch_ahead=always, so that they
// hold a launched step as CUDA workers do; a CPU worker's default (auto) and off run every step to
// its end before the next, with the same tokens.
TEST_F(ServiceTest, WorkersThatRunEveryStepToItsEndMatchTheEngineToo) {
  for (const char* mode : {"--launch_ahead=auto", "--launch_ahead=off"}) {
    SCOPED_TRACE(mode);
    absl::StatusOr<std::unique_ptr<Cluster>> c =
        Cluster::Start({.model_dir = ModelDir(), .worker_flags = {mode}});
    ASSERT_TRUE(c.ok()) << c.status();
    ExpectMatchesOracle(**c, MixedCases(7));
  }
}

TEST_F(ServiceTest, TopologyChangesAtRunTimeStayCorrect) {
  // Small steps too: prompts are prefilled in chunks of 5 tokens, at most 3 sequences a step.
  auto cluster = StartCluster(3, 1, 1, {"--prefill_chunk=5", "--max_batch=3"});
  ASSERT_NE(cluster, nullptr);
  ExpectMatchesOracle(*cluster, MixedCases(1));
  for (auto [stages, replicas] : {std::pair{2, 1}, {3, 1}, {1, 2}}) {
    SCOPED_TRACE(absl::StrFormat("%d stages x %d replicas", stages, replicas));
    // Requests in flight while the topology changes finish on the old pipelines or wait for the
    // new ones; either way their tokens are right.
    std::vector<Case> during = MixedCases(stages * 3 + replicas);
    during.resize(4);
    auto background = std::async(std::launch::async, [&] { ExpectMatchesOracle(*cluster, during); });
    absl::StatusOr<v1::Topology> t = SetTopology(*cluster, stages, replicas);
    ASSERT_TRUE(t.ok()) << t.status() << cluster->Logs();
    ASSERT_EQ(t->pipelines_size(), replicas);
    for (const auto& p : t->pipelines()) ASSERT_EQ(p.stages_size(), stages);
    background.get();
    ExpectMatchesOracle(*cluster, MixedCases(stages * 100 + replicas));
  }
}

TEST_F(ServiceTest, DrainedWorkerIsReplacedByAnIdleOne) {
  auto cluster = StartCluster(2, 1, 1);
  ASSERT_NE(cluster, nullptr);
  grpc::ClientContext tctx;
  v1::Topology before;
  ASSERT_TRUE(cluster->admin().GetTopology(&tctx, {}, &before).ok());
  const int64_t drained = before.pipelines(0).stages(0).worker_id();
  grpc::ClientContext dctx;
  v1::DrainRequest req;
  req.set_worker_id(drained);
  v1::Topology after;
  grpc::Status s = cluster->admin().Drain(&dctx, req, &after);
  ASSERT_TRUE(s.ok()) << s.error_message() << cluster->Logs();
  ASSERT_EQ(after.pipelines_size(), 1) << cluster->Logs();
  EXPECT_NE(after.pipelines(0).stages(0).worker_id(), drained);
  grpc::ClientContext wctx;
  v1::ListWorkersResponse workers;
  ASSERT_TRUE(cluster->admin().ListWorkers(&wctx, {}, &workers).ok());
  for (const auto& w : workers.workers()) {
    if (w.worker_id() == drained) {
      EXPECT_EQ(w.state(), v1::WORKER_STATE_DRAINED);
    }
  }
  ExpectMatchesOracle(*cluster, MixedCases(8));
  // Unknown workers are named in the error.
  grpc::ClientContext uctx;
  req.set_worker_id(12345);
  s = cluster->admin().Drain(&uctx, req, &after);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("12345"));
}

TEST_F(ServiceTest, TopologyNeedingMoreWorkersThanRegisteredIsRefused) {
  auto cluster = StartCluster(1, 1, 1);
  ASSERT_NE(cluster, nullptr);
  absl::StatusOr<v1::Topology> t = SetTopology(*cluster, 2, 1);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(SetTopology(*cluster, 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  ExpectMatchesOracle(*cluster, MixedCases(5));
}

// The coordinator's counter `name` from its /metrics (--metrics_address=127.0.0.1:0); -1 when
// absent.
double CoordinatorCounter(Cluster& cluster, const std::string& name) {
  const int port = PrintedMetricsPort(cluster.Logs(), "tandem-coordinator");
  httplib::Client http("127.0.0.1", port);
  httplib::Result r = http.Get("/metrics");
  if (!r || r->status != 200) return -1;
  std::smatch m;
  const std::regex re("\n" + name + " ([0-9.e+]+)");
  if (!std::regex_search(r->body, m, re)) return -1;
  return std::stod(m[1].str());
}

// The pages every pipeline's running sequences hold (tandem_kv_pages{state="used"}, summed), once
// the coordinator's gauges show none within a few seconds; otherwise the last sum, -1 without
// the gauge.
double PagesUsedOnceIdle(Cluster& cluster) {
  const int port = PrintedMetricsPort(cluster.Logs(), "tandem-coordinator");
  httplib::Client http("127.0.0.1", port);
  const std::regex re("\ntandem_kv_pages\\{pipeline=\"[0-9]+\",state=\"used\"\\} ([0-9.e+]+)");
  double used = -1;
  for (int i = 0; i < 100; ++i) {
    httplib::Result r = http.Get("/metrics");
    if (!r || r->status != 200) return -1;
    used = -1;
    for (std::sregex_iterator m(r->body.begin(), r->body.end(), re), end; m != end; ++m) {
      used = std::max(used, 0.0) + std::stod((*m)[1].str());
    }
    if (used == 0) return used;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return used;
}

// Every layout change moves the running sequences with their KV-cache, worker to worker over
// gRPC, into the stages that now hold their layers: each continues where it was (nothing is
// recomputed) and ends with the tokens of an undisturbed run.
TEST_F(ServiceTest, LayoutChangesMoveRunningSequencesWithTheirKvCache) {
  // Room for every request in any layout: nothing is recomputed for want of a slot.
  auto cluster = StartCluster(3, 1, 1, {"--max_slots=32", "--metrics_address=127.0.0.1:0"});
  ASSERT_NE(cluster, nullptr);
  int changes = 0;
  for (auto [stages, replicas] : {std::pair{2, 1}, {3, 1}, {1, 2}, {1, 1}, {2, 1}}) {
    SCOPED_TRACE(absl::StrFormat("to %d stages x %d replicas", stages, replicas));
    LongStreams streams(*cluster, 6, ++changes);
    // Short requests arriving meanwhile: some are admitted but not yet fed when the pause comes
    // (nothing to move), some wait for the new layout.
    auto arriving = std::async(std::launch::async, [&] {
      ExpectMatchesOracle(*cluster, MixedCases(changes));
    });
    absl::StatusOr<v1::Topology> t = SetTopology(*cluster, stages, replicas);
    ASSERT_TRUE(t.ok()) << t.status() << cluster->Logs();
    ASSERT_EQ(t->pipelines_size(), replicas);
    streams.Finish();
    arriving.get();
  }
  EXPECT_GT(CoordinatorCounter(*cluster, "tandem_sequences_migrated_total"), 0);
  EXPECT_GT(CoordinatorCounter(*cluster, "tandem_kv_transfer_bytes_total"), 0);
  EXPECT_EQ(CoordinatorCounter(*cluster, "tandem_sequences_recomputed_total"), 0)
      << cluster->Logs();
  EXPECT_THAT(cluster->Logs(), HasSubstr("with their KV-cache"));
  // The new stages were got ready while the old ones served and took what was prepared; workers
  // a layout left without a stage released theirs.
  EXPECT_THAT(cluster->Logs(), HasSubstr("(prepared), ready in"));
  EXPECT_THAT(cluster->Logs(), HasSubstr("stage released"));
}

// With a paged KV-cache (pages of 4 positions) a layout change moves the running sequences'
// KV-cache from the old pipeline's pages into pages the new pipeline's owner gives them: nothing
// is recomputed, every request ends with the undisturbed tokens, and no page stays held.
TEST_F(ServiceTest, LayoutChangesMovePagedSequencesWithTheirKvCache) {
  auto cluster = StartCluster(3, 1, 1, {"--kv_page_size=4", "--max_slots=32",
                                        "--metrics_address=127.0.0.1:0"});
  ASSERT_NE(cluster, nullptr);
  int changes = 0;
  for (auto [stages, replicas] : {std::pair{2, 1}, {1, 2}}) {
    SCOPED_TRACE(absl::StrFormat("to %d stages x %d replicas", stages, replicas));
    LongStreams streams(*cluster, 6, 40 + ++changes);
    absl::StatusOr<v1::Topology> t = SetTopology(*cluster, stages, replicas);
    ASSERT_TRUE(t.ok()) << t.status() << cluster->Logs();
    ASSERT_EQ(t->pipelines_size(), replicas);
    streams.Finish();
  }
  EXPECT_GT(CoordinatorCounter(*cluster, "tandem_sequences_migrated_total"), 0) << cluster->Logs();
  EXPECT_GT(CoordinatorCounter(*cluster, "tandem_kv_transfer_bytes_total"), 0);
  EXPECT_EQ(CoordinatorCounter(*cluster, "tandem_sequences_recomputed_total"), 0)
      << cluster->Logs();
  EXPECT_EQ(PagesUsedOnceIdle(*cluster), 0);
}

// With a paged KV-cache, a worker killed under load: its pipeline's sequences are recomputed on
// pages of the pipeline that takes them and end with the undisturbed greedy tokens; once every
// request has ended no page is held.
TEST_F(ServiceTest, KilledWorkersPagedSequencesContinueWithTheSameTokens) {
  auto cluster = StartCluster(3, 1, 2, {"--kv_page_size=4", "--metrics_address=127.0.0.1:0"});
  ASSERT_NE(cluster, nullptr);
  grpc::ClientContext tctx;
  v1::Topology topo;
  ASSERT_TRUE(cluster->admin().GetTopology(&tctx, {}, &topo).ok());
  const std::string victim_addr = topo.pipelines(0).stages(0).worker_address();
  int victim = -1;
  for (int i = 0; i < 3; ++i) {
    if (victim_addr == absl::StrFormat("127.0.0.1:%d", cluster->worker_port(i))) victim = i;
  }
  ASSERT_GE(victim, 0);
  LongStreams streams(*cluster, 6, 53, /*greedy=*/true);
  cluster->worker(victim).Kill(SIGKILL);
  streams.Finish(/*recomputed=*/true);
  EXPECT_GT(CoordinatorCounter(*cluster, "tandem_sequences_recomputed_total"), 0)
      << cluster->Logs();
  EXPECT_EQ(PagesUsedOnceIdle(*cluster), 0);
  ExpectMatchesOracle(*cluster, MixedCases(21));
}

// The roles of a topology's pipelines, in pipeline order.
std::vector<std::string> Roles(const v1::Topology& t) {
  std::vector<std::string> roles;
  for (const v1::PipelineInfo& p : t.pipelines()) roles.push_back(p.role());
  return roles;
}

// With a prefill replica, every prompt runs there and its KV-cache goes to the decode replica
// (a stage's layers to the stage with the same layers), which decodes: exactly the tokens of the
// one-process engine, nothing recomputed, with one stage per replica and with two. Going back to
// replicas that do both, and a prefill count that would leave nothing to decode, refused.
TEST_F(ServiceTest, PrefillReplicasHandTheKvCacheToDecodeReplicasWithTheSameTokens) {
  auto cluster = StartCluster(4, 1, 2, {"--prefill_replicas=1", "--max_slots=8",
                                        "--metrics_address=127.0.0.1:0"});
  ASSERT_NE(cluster, nullptr);
  ASSERT_TRUE(cluster->WaitForLiveWorkers(4).ok()) << cluster->Logs();
  grpc::ClientContext tctx;
  v1::Topology topo;
  ASSERT_TRUE(cluster->admin().GetTopology(&tctx, {}, &topo).ok());
  EXPECT_THAT(Roles(topo), ElementsAre("prefill", "decode"));
  EXPECT_EQ(topo.prefill_replicas(), 1);
  {
    LongStreams streams(*cluster, 4, 5);
    ExpectMatchesOracle(*cluster, MixedCases(3));
    streams.Finish();
  }
  // Every request that outlives its first token was handed off once.
  int outlive = 4;
  for (const Case& c : MixedCases(3)) outlive += Oracle(c).size() > 1;
  const double one_stage = CoordinatorCounter(*cluster, "tandem_prefill_handoffs_total");
  EXPECT_EQ(one_stage, outlive);

  absl::StatusOr<v1::Topology> t = SetTopology(*cluster, 2, 2);
  ASSERT_TRUE(t.ok()) << t.status() << cluster->Logs();
  EXPECT_THAT(Roles(*t), ElementsAre("prefill", "decode"));
  {
    LongStreams streams(*cluster, 4, 6);
    ExpectMatchesOracle(*cluster, MixedCases(4));
    streams.Finish();
  }
  EXPECT_GT(CoordinatorCounter(*cluster, "tandem_prefill_handoffs_total"), one_stage);
  EXPECT_GT(CoordinatorCounter(*cluster, "tandem_kv_transfer_bytes_total"), 0);
  EXPECT_EQ(CoordinatorCounter(*cluster, "tandem_sequences_recomputed_total"), 0)
      << cluster->Logs();
  // The workers of each new prefill/decode pair made their KV links before the first hand-off
  // (an import of no sequence): once for each layout.
  const std::string logs = cluster->Logs();
  int made = 0;
  for (size_t at = logs.find("KV links for hand-offs made"); at != std::string::npos;
       at = logs.find("KV links for hand-offs made", at + 1)) {
    ++made;
  }
  EXPECT_EQ(made, 2) << logs;

  t = SetTopology(*cluster, 2, 2, 0);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(Roles(*t), ElementsAre("both", "both"));
  const double before = CoordinatorCounter(*cluster, "tandem_prefill_handoffs_total");
  ExpectMatchesOracle(*cluster, MixedCases(5));
  EXPECT_EQ(CoordinatorCounter(*cluster, "tandem_prefill_handoffs_total"), before);

  t = SetTopology(*cluster, 2, 2, 2);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("prefill_replicas: 2"));
}

// Layout changes while prompts are handed off: running sequences move with their KV-cache (or
// are recomputed), hand-offs in flight end one way or the other, and every request ends with the
// tokens of an undisturbed run (greedy ones up to a near tie where recomputed).
TEST_F(ServiceTest, LayoutChangesDuringHandoffsLoseNoRequest) {
  auto cluster = StartCluster(4, 1, 2, {"--prefill_replicas=1", "--max_slots=16",
                                        "--metrics_address=127.0.0.1:0"});
  ASSERT_NE(cluster, nullptr);
  ASSERT_TRUE(cluster->WaitForLiveWorkers(4).ok()) << cluster->Logs();
  int round = 0;
  for (auto [stages, replicas, prefill] :
       {std::tuple{2, 2, 1}, {1, 2, 0}, {1, 3, 1}, {1, 2, 1}, {2, 2, 1}}) {
    SCOPED_TRACE(absl::StrFormat("to %d stages x %d replicas, %d prefill", stages, replicas,
                                 prefill));
    LongStreams streams(*cluster, 4, 30 + round, /*greedy=*/true);
    auto arriving = std::async(std::launch::async, [&, round] {
      ExpectServedWhileRecomputing(*cluster, MixedCases(40 + round));
    });
    absl::StatusOr<v1::Topology> t = SetTopology(*cluster, stages, replicas, prefill);
    ASSERT_TRUE(t.ok()) << t.status() << cluster->Logs();
    ASSERT_EQ(t->pipelines_size(), replicas);
    arriving.get();
    streams.Finish(/*recomputed=*/true);
    ++round;
  }
}

// With a paged KV-cache (pages of 4 positions), a prefill replica's prompts go to the decode
// replica as well: the prompt's last step writes its pages out as it runs, and the hand-off
// imports that into pages the decode replica's owner gives each sequence, which decodes there with the one-process engine's tokens;
// nothing is recomputed, and no page stays held on either side.
TEST_F(ServiceTest, PrefillReplicasHandPagedKvCacheToDecodeReplicasWithTheSameTokens) {
  auto cluster = StartCluster(2, 1, 2, {"--prefill_replicas=1", "--kv_page_size=4",
                                        "--max_slots=8", "--metrics_address=127.0.0.1:0"});
  ASSERT_NE(cluster, nullptr);
  grpc::ClientContext tctx;
  v1::Topology topo;
  ASSERT_TRUE(cluster->admin().GetTopology(&tctx, {}, &topo).ok());
  EXPECT_THAT(Roles(topo), ElementsAre("prefill", "decode"));
  {
    LongStreams streams(*cluster, 4, 15, /*greedy=*/true);
    ExpectMatchesOracle(*cluster, MixedCases(13));
    streams.Finish();
  }
  int outlive = 4;
  for (const Case& c : MixedCases(13)) outlive += Oracle(c).size() > 1;
  EXPECT_EQ(CoordinatorCounter(*cluster, "tandem_prefill_handoffs_total"), outlive)
      << cluster->Logs();
  EXPECT_EQ(CoordinatorCounter(*cluster, "tandem_sequences_recomputed_total"), 0)
      << cluster->Logs();
  EXPECT_EQ(PagesUsedOnceIdle(*cluster), 0);
}

// A prefill worker killed under load: its sequences, and those handed off or about to be, continue
// (recomputed where their KV-cache was lost) on what is left, and no request fails. The worker is
// stopped first, so that requests are surely in its prompts when it dies.
TEST_F(ServiceTest, KilledPrefillWorkerFailsNoRequest) {
  auto cluster = StartCluster(3, 1, 2, {"--prefill_replicas=1", "--max_slots=8",
                                        "--metrics_address=127.0.0.1:0"},
                              /*default_heartbeats=*/true);
  ASSERT_NE(cluster, nullptr);
  grpc::ClientContext tctx;
  v1::Topology topo;
  ASSERT_TRUE(cluster->admin().GetTopology(&tctx, {}, &topo).ok());
  ASSERT_EQ(topo.pipelines(0).role(), "prefill");
  const std::string victim_addr = topo.pipelines(0).stages(0).worker_address();
  int victim = -1;
  for (int i = 0; i < 3; ++i) {
    if (victim_addr == absl::StrFormat("127.0.0.1:%d", cluster->worker_port(i))) victim = i;
  }
  ASSERT_GE(victim, 0);
  LongStreams streams(*cluster, 6, 8, /*greedy=*/true);
  cluster->worker(victim).Kill(SIGSTOP);
  // Requests arriving all along; the first ones wait in the stopped worker's prompts.
  auto arriving = std::async(std::launch::async, [&] {
    for (int round = 0; round < 3; ++round) {
      ExpectServedWhileRecomputing(*cluster, MixedCases(10 + round));
    }
  });
  absl::SleepFor(absl::Milliseconds(100));
  cluster->worker(victim).Kill(SIGKILL);
  arriving.get();
  streams.Finish(/*recomputed=*/true);
  EXPECT_GT(CoordinatorCounter(*cluster, "tandem_sequences_recomputed_total"), 0)
      << cluster->Logs();
}

// Two replicas' sequences moving into one whose slots are all taken: those that find no slot are
// recomputed there once slots free up, and every request still ends with the right tokens.
TEST_F(ServiceTest, SequencesWithoutRoomInTheNewLayoutAreRecomputed) {
  auto cluster = StartCluster(2, 1, 2, {"--max_slots=3", "--metrics_address=127.0.0.1:0"});
  ASSERT_NE(cluster, nullptr);
  LongStreams streams(*cluster, 6, 77, /*greedy=*/true);
  absl::StatusOr<v1::Topology> t = SetTopology(*cluster, 1, 1);
  ASSERT_TRUE(t.ok()) << t.status() << cluster->Logs();
  streams.Finish(/*recomputed=*/true);
  EXPECT_GT(CoordinatorCounter(*cluster, "tandem_sequences_recomputed_total"), 0)
      << cluster->Logs();
}

// A worker killed under load: the requests of its pipeline continue on the other replica or on
// the pipeline the spare worker forms (their KV-cache recomputed from prompt and tokens so far),
// and every request ends with exactly the tokens of an undisturbed greedy run.
TEST_F(ServiceTest, KilledWorkersRequestsContinueElsewhereWithTheSameTokens) {
  // Two replicas of one stage plus a spare worker for the re-plan.
  auto cluster = StartCluster(3, 1, 2, {}, /*default_heartbeats=*/true);
  ASSERT_NE(cluster, nullptr);
  grpc::ClientContext tctx;
  v1::Topology topo;
  ASSERT_TRUE(cluster->admin().GetTopology(&tctx, {}, &topo).ok());
  // The worker of the first pipeline: find its process by port.
  const std::string victim_addr = topo.pipelines(0).stages(0).worker_address();
  int victim = -1;
  for (int i = 0; i < 3; ++i) {
    if (victim_addr == absl::StrFormat("127.0.0.1:%d", cluster->worker_port(i))) victim = i;
  }
  ASSERT_GE(victim, 0);

  // Long generations on both replicas; each records when it ended.
  constexpr int kRequests = 8;
  std::atomic<int> started{0};
  std::vector<std::future<std::tuple<grpc::Status, std::vector<int32_t>, absl::Time>>> futures;
  std::vector<Case> cases;
  for (int i = 0; i < kRequests; ++i) {
    Case c{.prompt = {static_cast<int32_t>(10 + i), 20, 30}, .max_new_tokens = 1000, .sampling = {}};
    cases.push_back(c);
    futures.push_back(std::async(std::launch::async, [&cluster, c, &started] {
      grpc::ClientContext ctx;
      v1::GenerateRequest req = ToRequest(c);
      req.set_ignore_eos(true);
      auto reader = cluster->inference().GenerateStream(&ctx, req);
      std::vector<int32_t> tokens;
      v1::GenerateStreamResponse msg;
      bool counted = false;
      while (reader->Read(&msg)) {
        tokens.insert(tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
        if (!counted) started++;
        counted = true;
      }
      grpc::Status s = reader->Finish();
      return std::make_tuple(s, tokens, absl::Now());
    }));
  }
  while (started.load() < kRequests) absl::SleepFor(absl::Milliseconds(1));
  cluster->worker(victim).Kill(SIGKILL);

  for (int i = 0; i < kRequests; ++i) {
    auto [status, tokens, ended] = futures[i].get();
    ASSERT_TRUE(status.ok()) << "request " << i << ": " << status.error_message() << "\n"
                             << cluster->Logs();
    ExpectOracleUpToNearTie(tokens, cases[i], i);
  }
  // Some of them were on the killed worker's pipeline (else this test shows nothing).
  EXPECT_THAT(cluster->Logs(), HasSubstr("resuming elsewhere")) << "no request was resumed";

  // The spare worker replaces the dead one; new requests succeed and are right.
  ASSERT_TRUE(cluster->WaitForTopology(2, 1).ok()) << cluster->Logs();
  ExpectMatchesOracle(*cluster, MixedCases(3));
}

// A stage's worker killed mid-generation: the coordinator serves the whole model on the worker
// left, and the request continues there with the tokens of an undisturbed run.
TEST_F(ServiceTest, KilledStageWorkerReplansOntoRemainingWorkerAndTheRequestContinues) {
  auto cluster = StartCluster(2, 2, 1, {}, /*default_heartbeats=*/true);
  ASSERT_NE(cluster, nullptr);
  Case c{.prompt = {1, 2, 3}, .max_new_tokens = 1000, .sampling = {}};
  std::promise<void> first_token;
  std::vector<int32_t> tokens;
  auto f = std::async(std::launch::async, [&] {
    grpc::ClientContext ctx;
    v1::GenerateRequest req = ToRequest(c);
    req.set_ignore_eos(true);
    auto reader = cluster->inference().GenerateStream(&ctx, req);
    v1::GenerateStreamResponse msg;
    bool told = false;
    while (reader->Read(&msg)) {
      if (!told && msg.token_ids_size() > 0) first_token.set_value();
      told |= msg.token_ids_size() > 0;
      tokens.insert(tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
    }
    if (!told) first_token.set_value();
    return reader->Finish();
  });
  // Killed mid-generation: once a token has streamed, both stages hold the sequence.
  first_token.get_future().wait();
  cluster->worker(1).Kill(SIGKILL);
  grpc::Status s = f.get();
  ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << cluster->Logs();
  ExpectOracleUpToNearTie(tokens, c, 0);
  // One worker is left: the coordinator serves the whole model on it.
  ASSERT_TRUE(cluster->WaitForTopology(1, 1).ok()) << cluster->Logs();
  ExpectMatchesOracle(*cluster, MixedCases(9));
}

// A fake worker's answer to a paged assignment, as a real one gives: the pages of every slot's
// whole context.
void ReportPages(const v1::AssignStageRequest& req, v1::AssignStageResponse* resp) {
  if (req.kv_page_size() <= 0) return;
  const int per_slot = (req.max_seq_len() + req.kv_page_size() - 1) / req.kv_page_size();
  resp->set_kv_pages(std::max(req.max_slots(), 1) * std::max(per_slot, 1));
}

// A worker that takes any stage and fails the first step it is sent (a stage error), then stops
// heartbeating and refuses stages, as a broken worker would.
class FailingWorker final : public v1::Worker::Service {
 public:
  grpc::Status AssignStage(grpc::ServerContext*, const v1::AssignStageRequest* req,
                           v1::AssignStageResponse* resp) override {
    if (failed_.load()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "broken");
    ReportPages(*req, resp);
    return grpc::Status::OK;
  }
  grpc::Status Steps(grpc::ServerContext*,
                     grpc::ServerReaderWriter<v1::StepResult, v1::StepRequest>* stream) override {
    v1::StepRequest req;
    if (stream->Read(&req)) {
      v1::StepResult r;
      r.set_step_id(req.step_id());
      r.set_error_code(static_cast<int32_t>(absl::StatusCode::kInternal));
      r.set_error_message("injected: the stage failed");
      stream->Write(r);
      failed_.store(true);
    }
    while (stream->Read(&req)) {
    }
    return grpc::Status::OK;
  }
  bool failed() const { return failed_.load(); }

 private:
  std::atomic<bool> failed_{false};
};

// A pipeline whose stage fails a step costs no request: the requests in it continue on the other
// pipeline, recomputed, with the tokens of an undisturbed run.
TEST_F(ServiceTest, AFailedStepResumesItsPipelinesRequestsInsteadOfFailingThem) {
  absl::StatusOr<std::unique_ptr<Cluster>> c = Cluster::Start(
      {.model_dir = ModelDir(), .workers = 1, .stages = 1, .replicas = 2,
       .coordinator_flags = {"--metrics_address=127.0.0.1:0"}, .wait_until_serving = false});
  ASSERT_TRUE(c.ok()) << c.status();
  Cluster& cluster = **c;
  FailingWorker failing;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&failing);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_GT(port, 0);
  auto registry = v1::Registry::NewStub(
      grpc::CreateChannel(cluster.address(), grpc::InsecureChannelCredentials()));
  v1::RegisterRequest reg;
  reg.set_address(absl::StrFormat("127.0.0.1:%d", port));
  reg.set_backend("cpu");
  v1::RegisterResponse id;
  grpc::ClientContext rctx;
  ASSERT_TRUE(registry->Register(&rctx, reg, &id).ok());
  std::atomic<bool> beating{true};
  std::thread heartbeats([&] {
    while (beating.load() && !failing.failed()) {
      grpc::ClientContext hctx;
      v1::HeartbeatRequest hb;
      hb.set_worker_id(id.worker_id());
      v1::HeartbeatResponse hr;
      registry->Heartbeat(&hctx, hb, &hr);
      absl::SleepFor(absl::Milliseconds(100));
    }
  });
  ASSERT_TRUE(cluster.WaitForTopology(2, 1).ok()) << cluster.Logs();
  ExpectMatchesOracle(cluster, MixedCases(12));
  beating.store(false);
  heartbeats.join();
  EXPECT_TRUE(failing.failed()) << "no request went to the failing worker";
  EXPECT_GT(CoordinatorCounter(cluster, "tandem_sequences_recomputed_total"), 0) << cluster.Logs();
  EXPECT_THAT(cluster.Logs(), HasSubstr("injected: the stage failed"));
  c->reset();
  server->Shutdown();
}

// A worker that records how the coordinator links it: whether it was asked which link it offers
// (PrepareLink, answered "nccl" as a CUDA worker does) and the transport of its assignment, which
// it takes, answering that its pipeline may go ahead of its tokens where that is NCCL.
class LinkRecordingWorker final : public v1::Worker::Service {
 public:
  grpc::Status PrepareLink(grpc::ServerContext*, const v1::PrepareLinkRequest*,
                           v1::PrepareLinkResponse* resp) override {
    ++prepared;
    resp->set_transport("nccl");
    resp->set_nccl_id(std::string(128, '\1'));
    return grpc::Status::OK;
  }
  grpc::Status AssignStage(grpc::ServerContext*, const v1::AssignStageRequest* req,
                           v1::AssignStageResponse* resp) override {
    {
      std::lock_guard<std::mutex> lock(mu);
      transports.push_back(req->transport());
    }
    resp->set_feeds_previous_samples(req->transport() == "nccl");
    ReportPages(*req, resp);
    return grpc::Status::OK;
  }
  grpc::Status Steps(grpc::ServerContext*,
                     grpc::ServerReaderWriter<v1::StepResult, v1::StepRequest>* stream) override {
    v1::StepRequest req;
    while (stream->Read(&req)) {
    }
    return grpc::Status::OK;
  }
  std::vector<std::string> Transports() {
    std::lock_guard<std::mutex> lock(mu);
    return transports;
  }

  std::atomic<int> prepared{0};

 private:
  std::mutex mu;
  std::vector<std::string> transports;
};

// The stages of a pipeline link over NCCL only where every stage's worker is a CUDA one; then the
// coordinator lets the pipeline's steps go ahead of their tokens. A CPU worker among them: gRPC,
// without asking, whatever its CUDA neighbour would offer.
TEST_F(ServiceTest, StagesLinkOverNcclOnlyWhereEveryWorkerIsACudaOne) {
  for (const std::vector<std::string>& backends :
       {std::vector<std::string>{"cuda", "cpu"}, std::vector<std::string>{"cuda", "cuda"}}) {
    const bool nccl = backends[1] == "cuda";
    absl::StatusOr<std::unique_ptr<Cluster>> c = Cluster::Start(
        {.model_dir = ModelDir(), .workers = 0, .stages = 2, .wait_until_serving = false});
    ASSERT_TRUE(c.ok()) << c.status();
    Cluster& cluster = **c;
    LinkRecordingWorker fakes[2];
    std::unique_ptr<grpc::Server> servers[2];
    auto registry = v1::Registry::NewStub(
        grpc::CreateChannel(cluster.address(), grpc::InsecureChannelCredentials()));
    std::vector<int64_t> ids;
    for (int i = 0; i < 2; ++i) {
      grpc::ServerBuilder builder;
      int port = 0;
      builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
      builder.RegisterService(&fakes[i]);
      servers[i] = builder.BuildAndStart();
      ASSERT_GT(port, 0);
      v1::RegisterRequest reg;
      reg.set_address(absl::StrFormat("127.0.0.1:%d", port));
      reg.set_backend(backends[i]);
      v1::RegisterResponse id;
      grpc::ClientContext rctx;
      ASSERT_TRUE(registry->Register(&rctx, reg, &id).ok());
      ids.push_back(id.worker_id());
    }
    std::atomic<bool> beating{true};
    std::thread heartbeats([&] {
      while (beating.load()) {
        for (int64_t id : ids) {
          grpc::ClientContext hctx;
          v1::HeartbeatRequest hb;
          hb.set_worker_id(id);
          v1::HeartbeatResponse hr;
          registry->Heartbeat(&hctx, hb, &hr);
        }
        absl::SleepFor(absl::Milliseconds(100));
      }
    });
    EXPECT_TRUE(cluster.WaitForTopology(1, 2).ok()) << cluster.Logs();
    const std::string want = nccl ? "nccl" : "grpc";
    for (LinkRecordingWorker& f : fakes) EXPECT_THAT(f.Transports(), ElementsAre(want));
    EXPECT_EQ(fakes[0].prepared.load() + fakes[1].prepared.load(), nccl ? 1 : 0);
    EXPECT_EQ(cluster.Logs().find("tokens fed to the first over the link") != std::string::npos,
              nccl)
        << cluster.Logs();
    beating.store(false);
    heartbeats.join();
    c->reset();
    for (auto& s : servers) s->Shutdown();
  }
}

// With no other worker to resume on, the request of a frozen worker fails with UNAVAILABLE.
TEST_F(ServiceTest, WorkerThatStopsAnsweringFailsItsRequestsWithUnavailable) {
  auto cluster = StartCluster(1, 1, 1);
  ASSERT_NE(cluster, nullptr);
  Case c{.prompt = {1, 2, 3}, .max_new_tokens = 1000, .sampling = {}};
  std::atomic<bool> started{false};
  auto f = std::async(std::launch::async, [&] {
    grpc::ClientContext ctx;
    v1::GenerateRequest req = ToRequest(c);
    req.set_ignore_eos(true);
    auto reader = cluster->inference().GenerateStream(&ctx, req);
    v1::GenerateStreamResponse msg;
    while (reader->Read(&msg)) started = true;
    return reader->Finish();
  });
  while (!started.load()) absl::SleepFor(absl::Milliseconds(1));
  // Frozen, not dead: its connections stay open, only the heartbeats stop.
  const absl::Time stopped = absl::Now();
  cluster->worker(0).Kill(SIGSTOP);
  grpc::Status s = f.get();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_LT(absl::Now() - stopped, absl::Seconds(2));
  // Resumed, it registers again and the service serves on it.
  cluster->worker(0).Kill(SIGCONT);
  ASSERT_TRUE(cluster->WaitForTopology(1, 1).ok()) << cluster->Logs();
  grpc::Status s2;
  Case d{.prompt = {4, 5}, .max_new_tokens = 5, .sampling = {}};
  EXPECT_EQ(Run(*cluster, d, &s2), Oracle(d));
  EXPECT_TRUE(s2.ok()) << s2.error_message();
}

TEST_F(ServiceTest, BadRequestsAreRejectedNamingTheFieldAndServiceKeepsServing) {
  auto cluster = StartCluster(1, 1, 1, {"--max_seq_len=64"});
  ASSERT_NE(cluster, nullptr);
  auto base = [] {
    v1::GenerateRequest r;
    r.add_token_ids(5);
    r.set_max_new_tokens(4);
    return r;
  };
  std::vector<std::pair<std::string, v1::GenerateRequest>> bad;
  {
    v1::GenerateRequest r = base();
    r.clear_token_ids();
    bad.push_back({"prompt", r});  // empty prompt
  }
  {
    v1::GenerateRequest r = base();
    for (int i = 0; i < 70; ++i) r.add_token_ids(1);
    bad.push_back({"token_ids", r});  // longer than the context of 64
  }
  {
    v1::GenerateRequest r = base();
    r.set_prompt(std::string(400, 'x') + " and more words to pass the context limit");
    r.clear_token_ids();
    bad.push_back({"prompt", r});  // text longer than the context
  }
  {
    v1::GenerateRequest r = base();
    r.add_token_ids(512);
    bad.push_back({"token_ids[1]", r});
  }
  {
    v1::GenerateRequest r = base();
    r.add_token_ids(-1);
    bad.push_back({"token_ids[1]", r});
  }
  {
    v1::GenerateRequest r = base();
    r.mutable_sampling()->set_temperature(-0.5f);
    bad.push_back({"sampling.temperature", r});
  }
  for (float p : {0.0f, 1.5f, -0.1f}) {
    v1::GenerateRequest r = base();
    r.mutable_sampling()->set_top_p(p);
    bad.push_back({"sampling.top_p", r});
  }
  {
    v1::GenerateRequest r = base();
    r.mutable_sampling()->set_top_k(-1);
    bad.push_back({"sampling.top_k", r});
  }
  {
    v1::GenerateRequest r = base();
    r.set_max_new_tokens(0);
    bad.push_back({"max_new_tokens", r});
  }
  {
    v1::GenerateRequest r = base();
    r.set_max_new_tokens(65);
    bad.push_back({"max_new_tokens", r});
  }
  {
    v1::GenerateRequest r = base();
    r.add_stop_token_ids(100000);
    bad.push_back({"stop_token_ids[0]", r});
  }
  for (auto& [field, req] : bad) {
    for (bool stream : {false, true}) {
      SCOPED_TRACE(field + (stream ? " (stream)" : ""));
      grpc::ClientContext ctx;
      grpc::Status s;
      if (stream) {
        auto reader = cluster->inference().GenerateStream(&ctx, req);
        v1::GenerateStreamResponse msg;
        while (reader->Read(&msg)) {
        }
        s = reader->Finish();
      } else {
        v1::GenerateResponse resp;
        s = cluster->inference().Generate(&ctx, req, &resp);
      }
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
      EXPECT_THAT(s.error_message(), HasSubstr(field));
    }
  }
  ExpectMatchesOracle(*cluster, MixedCases(2));
}

TEST_F(ServiceTest, DeadlineEndsRequestAndFreesItsSlot) {
  auto cluster = StartCluster(1, 1, 1, {"--max_slots=2"});
  ASSERT_NE(cluster, nullptr);
  for (bool use_grpc_deadline : {false, true}) {
    grpc::ClientContext ctx;
    v1::GenerateRequest req;
    req.add_token_ids(3);
    req.set_max_new_tokens(1000);
    req.set_ignore_eos(true);
    if (use_grpc_deadline) {
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
    } else {
      req.set_timeout_ms(100);
    }
    v1::GenerateResponse resp;
    grpc::Status s = cluster->inference().Generate(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  }
  // Both slots are free again. (With a gRPC deadline the client may see the error a moment
  // before the server's handler notices it, so this polls briefly.)
  v1::Topology t;
  for (int i = 0; i < 200; ++i) {
    grpc::ClientContext tctx;
    ASSERT_TRUE(cluster->admin().GetTopology(&tctx, {}, &t).ok());
    ASSERT_EQ(t.pipelines_size(), 1);
    if (t.pipelines(0).free_slots() == 2) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(t.pipelines(0).free_slots(), 2);
  EXPECT_EQ(t.pipelines(0).running_sequences(), 0);
  ExpectMatchesOracle(*cluster, MixedCases(4));
}

TEST_F(ServiceTest, ClientCancellationFreesTheSlot) {
  auto cluster = StartCluster(1, 1, 1, {"--max_slots=1"});
  ASSERT_NE(cluster, nullptr);
  {
    grpc::ClientContext ctx;
    v1::GenerateRequest req;
    req.add_token_ids(3);
    req.set_max_new_tokens(1000);
    req.set_ignore_eos(true);
    auto reader = cluster->inference().GenerateStream(&ctx, req);
    v1::GenerateStreamResponse msg;
    ASSERT_TRUE(reader->Read(&msg));
    ctx.TryCancel();
    while (reader->Read(&msg)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // With one slot, this only runs once the cancelled request gave it back.
  grpc::Status s;
  Case c{.prompt = {4, 5}, .max_new_tokens = 5, .sampling = {}};
  EXPECT_EQ(Run(*cluster, c, &s), Oracle(c));
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(ServiceTest, FullWaitingQueueAnswersResourceExhausted) {
  auto cluster = StartCluster(1, 1, 1, {"--max_slots=1", "--max_waiting=1"});
  ASSERT_NE(cluster, nullptr);
  std::vector<std::future<grpc::Status>> futures;
  for (int i = 0; i < 6; ++i) {
    futures.push_back(std::async(std::launch::async, [&] {
      grpc::ClientContext ctx;
      v1::GenerateRequest req;
      req.add_token_ids(3);
      req.set_max_new_tokens(300);
      req.set_ignore_eos(true);
      v1::GenerateResponse resp;
      return cluster->inference().Generate(&ctx, req, &resp);
    }));
  }
  int exhausted = 0, ok = 0;
  for (auto& f : futures) {
    grpc::Status s = f.get();
    if (s.ok()) ++ok;
    else if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) ++exhausted;
    else ADD_FAILURE() << s.error_message();
  }
  EXPECT_GT(exhausted, 0);
  EXPECT_GT(ok, 0);
  // Still serving once the queue has room again.
  grpc::Status s;
  Case c{.prompt = {4, 5}, .max_new_tokens = 5, .sampling = {}};
  EXPECT_EQ(Run(*cluster, c, &s), Oracle(c));
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(ServiceTest, StopTokenEndsGenerationWithStopReason) {
  auto cluster = StartCluster(1, 1, 1);
  ASSERT_NE(cluster, nullptr);
  Case c{.prompt = {7, 8, 9}, .max_new_tokens = 12, .sampling = {}};
  std::vector<int32_t> full = Oracle(c);
  ASSERT_GE(full.size(), 4u);
  const int32_t stop = full[3];
  const size_t first = std::find(full.begin(), full.end(), stop) - full.begin();
  for (bool stream : {false, true}) {
    c.stream = stream;
    v1::GenerateRequest req = ToRequest(c);
    req.add_stop_token_ids(stop);
    grpc::ClientContext ctx;
    v1::GenerateResponse resp;
    grpc::Status s = cluster->inference().Generate(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(std::vector<int32_t>(resp.token_ids().begin(), resp.token_ids().end()),
              std::vector<int32_t>(full.begin(), full.begin() + first + 1));
    EXPECT_EQ(resp.finish_reason(), v1::FINISH_REASON_STOP);
    EXPECT_EQ(resp.usage().completion_tokens(), static_cast<int>(first + 1));
    EXPECT_EQ(resp.usage().prompt_tokens(), 3);
  }
}

TEST_F(ServiceTest, TextPromptStreamsTextAndStopsAtStopString) {
  auto cluster = StartCluster(1, 1, 1);
  ASSERT_NE(cluster, nullptr);
  // A random model's greedy text may be all stray bytes; seeded sampling at a high temperature
  // gives varied tokens, and the first seed whose text has ASCII in it is used.
  v1::GenerateRequest req;
  req.set_prompt("Hello, tandem");
  req.set_max_new_tokens(24);
  req.set_ignore_eos(true);
  req.mutable_sampling()->set_temperature(2.0f);
  v1::GenerateResponse full;
  grpc::Status s;
  size_t from = 0;
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    req.mutable_sampling()->set_seed(seed);
    grpc::ClientContext ctx;
    s = cluster->inference().Generate(&ctx, req, &full);
    ASSERT_TRUE(s.ok()) << s.error_message();
    from = 1;
    while (from < full.text().size() && static_cast<unsigned char>(full.text()[from]) >= 0x80) {
      ++from;
    }
    if (from < full.text().size()) break;
  }
  ASSERT_LT(from, full.text().size()) << "no ASCII in the generated text";
  // Streamed text pieces add up to the unary answer's text.
  {
    grpc::ClientContext sctx;
    auto reader = cluster->inference().GenerateStream(&sctx, req);
    std::string text;
    v1::GenerateStreamResponse msg;
    while (reader->Read(&msg)) text += msg.text();
    s = reader->Finish();
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(text, full.text());
  }
  // A stop string taken from the middle of that text ends the answer just before it.
  // (ASCII, so that it is the same bytes in the raw and in the shown text.)
  const std::string& t = full.text();
  const std::string stop = t.substr(from, 1);
  const size_t at = t.find(stop);
  req.add_stop(stop);
  grpc::ClientContext ctx2;
  v1::GenerateResponse cut;
  s = cluster->inference().Generate(&ctx2, req, &cut);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(cut.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(cut.text(), full.text().substr(0, at));

  // Streamed, with a stop string that never comes listed first: the pieces add up to the same
  // cut text, and none of them shows the stop string.
  req.clear_stop();
  req.add_stop("<<a stop string this text never holds>>");
  req.add_stop(stop);
  grpc::ClientContext ctx3;
  auto reader = cluster->inference().GenerateStream(&ctx3, req);
  std::string streamed;
  v1::GenerateStreamResponse msg;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  while (reader->Read(&msg)) {
    streamed += msg.text();
    if (msg.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) finish = msg.finish_reason();
  }
  s = reader->Finish();
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(finish, v1::FINISH_REASON_STOP);
  EXPECT_EQ(streamed, full.text().substr(0, at));
}

// Text of the first choice of an OpenAI completion answer, whole or streamed as server-sent
// events (the pieces of every "data:" event joined); `finish` gets its finish_reason.
std::string CompletionText(const std::string& body, bool streamed, std::string* finish) {
  std::vector<nlohmann::json> events;
  if (!streamed) events.push_back(nlohmann::json::parse(body, nullptr, false));
  std::istringstream lines(body);
  for (std::string line; streamed && std::getline(lines, line);) {
    if (line.rfind("data: {", 0) == 0) {
      events.push_back(nlohmann::json::parse(line.substr(6), nullptr, false));
    }
  }
  std::string text;
  for (const nlohmann::json& e : events) {
    if (!e.is_object() || !e.contains("choices") || e["choices"].empty()) continue;
    const nlohmann::json& choice = e["choices"][0];
    text += choice.value("text", "");
    if (choice.contains("finish_reason") && choice["finish_reason"].is_string()) {
      *finish = choice["finish_reason"].get<std::string>();
    }
  }
  return text;
}

TEST_F(ServiceTest, HttpStreamEndsBeforeTheStopString) {
  auto cluster = StartCluster(1, 1, 1, {"--http_listen=127.0.0.1:0"});
  ASSERT_NE(cluster, nullptr);
  std::smatch m;
  const std::string logs = cluster->Logs();
  ASSERT_TRUE(std::regex_search(logs, m, std::regex("http on port ([0-9]+)"))) << logs;
  httplib::Client http("127.0.0.1", std::stoi(m[1].str()));
  http.set_read_timeout(120);
  // As in the gRPC test above: seeded text with ASCII in it, and a stop string taken from there.
  nlohmann::json body = {
      {"prompt", "Hello, tandem"}, {"max_tokens", 24}, {"temperature", 2.0}, {"ignore_eos", true}};
  std::string full, finish;
  size_t from = 0;
  for (int seed = 1; seed <= 20; ++seed) {
    body["seed"] = seed;
    httplib::Result r = http.Post("/v1/completions", body.dump(), "application/json");
    ASSERT_TRUE(r && r->status == 200) << (r ? r->body : httplib::to_string(r.error()));
    full = CompletionText(r->body, false, &finish);
    from = 1;
    while (from < full.size() && static_cast<unsigned char>(full[from]) >= 0x80) ++from;
    if (from < full.size()) break;
  }
  ASSERT_LT(from, full.size()) << "no ASCII in the generated text";
  const std::string stop = full.substr(from, 1);
  body["stop"] = {"<<a stop string this text never holds>>", stop};
  body["stream"] = true;
  httplib::Result r = http.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : httplib::to_string(r.error()));
  finish.clear();
  EXPECT_EQ(CompletionText(r->body, true, &finish), full.substr(0, full.find(stop))) << r->body;
  EXPECT_EQ(finish, "stop");
}

}  // namespace
}  // namespace tandem::testing
