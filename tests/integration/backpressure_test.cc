// Backpressure through real processes: a closed loop of as many clients as the service has KV
// slots is never refused, however its requests end and the next ones arrive; a load beyond the
// slots and the waiting bound is refused with RESOURCE_EXHAUSTED; a request of more sequences
// than the service can ever hold is invalid (400), naming the limit and the flag, not "retry
// later". The clients are the load generator's closed loop (loadgen/sweep.h).
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <mutex>
#include <regex>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/httplib.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "loadgen/sweep.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster.h"
#include "tools/model_generator.h"

namespace tandem::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kReplicas = 2;
constexpr int kSlots = 8;  // per replica

class BackpressureTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = new std::filesystem::path(std::filesystem::path(::testing::TempDir()) /
                                       absl::StrCat("tandem-backpressure-model-", getpid()));
    absl::StatusOr<ModelConfig> c = PresetConfig("tiny-llama");
    ASSERT_TRUE(c.ok()) << c.status();
    c->max_positions = 1024;
    const absl::Status s = WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 5}, *model_);
    ASSERT_TRUE(s.ok()) << s;
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*model_, ec);
    delete model_;
  }

  // Two CPU replicas of kSlots slots each, nothing allowed to wait beyond the slots (the
  // strictest bound: every request of a loop within capacity must find room), with the
  // coordinator's own admission settings (which hold new requests back to join one prompt step).
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Cluster>> c =
        Cluster::Start({.model_dir = *model_,
                        .workers = kReplicas,
                        .stages = 1,
                        .replicas = kReplicas,
                        .coordinator_flags = {absl::StrCat("--max_slots=", kSlots),
                                              "--max_waiting=0", "--http_listen=127.0.0.1:0"}});
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
    const std::string logs = cluster_->Logs();
    std::smatch m;
    ASSERT_TRUE(std::regex_search(logs, m, std::regex("http on port ([0-9]+)"))) << logs;
    http_ = std::make_unique<httplib::Client>("127.0.0.1", std::stoi(m[1].str()));
    http_->set_read_timeout(120);
    http_->set_write_timeout(120);
  }

  // What a closed loop of `clients` clients saw for `count` requests of `tokens(i)` tokens each:
  // how many of each status code, and the first error's message.
  struct Seen {
    std::map<grpc::StatusCode, int> codes;
    std::string first_error;
  };
  Seen ClosedLoop(int clients, int count, const std::function<int(int i)>& tokens) {
    std::mutex mu;
    Seen seen;
    loadgen::RunClosedLoop(clients, count, [&](int i, int) {
      v1::GenerateRequest req;
      req.add_token_ids(1 + i % 50);
      req.add_token_ids(2 + i % 7);
      req.set_max_new_tokens(tokens(i));
      req.set_ignore_eos(true);
      v1::GenerateResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
      const grpc::Status s = cluster_->inference().Generate(&ctx, req, &resp);
      std::lock_guard<std::mutex> lock(mu);
      ++seen.codes[s.error_code()];
      if (!s.ok() && seen.first_error.empty()) seen.first_error = s.error_message();
    });
    return seen;
  }

  httplib::Result Complete(int prompts) {
    nlohmann::json ids = nlohmann::json::array();
    for (int p = 0; p < prompts; ++p) ids.push_back({1 + p % 50, 3});
    return http_->Post("/v1/completions", nlohmann::json{{"prompt", ids}, {"max_tokens", 2}}.dump(),
                       "application/json");
  }

  static std::filesystem::path* model_;
  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<httplib::Client> http_;
};

std::filesystem::path* BackpressureTest::model_ = nullptr;

// Requests of different lengths, so that they end at different steps and their successors arrive
// while other sequences run, while admission holds new ones back, and before the scheduler has
// admitted the ones that came just before.
TEST_F(BackpressureTest, AClosedLoopOfAsManyClientsAsSlotsIsNeverRefused) {
  constexpr int kClients = kReplicas * kSlots;
  Seen seen = ClosedLoop(kClients, 400, [](int i) { return 1 + (i * 7) % 13; });
  EXPECT_EQ(seen.codes[grpc::StatusCode::OK], 400) << seen.first_error;
  EXPECT_EQ(seen.codes[grpc::StatusCode::RESOURCE_EXHAUSTED], 0) << seen.first_error;
}

// Three times as many clients as slots, each asking for long generations: once the slots are
// taken (and nothing may wait beyond them), the rest are refused for now.
TEST_F(BackpressureTest, MoreClientsThanSlotsAndTheWaitingBoundAreRefusedForNow) {
  constexpr int kClients = 3 * kReplicas * kSlots;
  Seen seen = ClosedLoop(kClients, kClients, [](int) { return 400; });
  EXPECT_GT(seen.codes[grpc::StatusCode::RESOURCE_EXHAUSTED], 0);
  EXPECT_GT(seen.codes[grpc::StatusCode::OK], 0);
  EXPECT_EQ(seen.codes[grpc::StatusCode::RESOURCE_EXHAUSTED] + seen.codes[grpc::StatusCode::OK],
            kClients)
      << seen.first_error;
  EXPECT_THAT(seen.first_error, HasSubstr("retry later"));
  // The service answers again once they are done.
  seen = ClosedLoop(1, 1, [](int) { return 2; });
  EXPECT_EQ(seen.codes[grpc::StatusCode::OK], 1) << seen.first_error;
}

// A request of as many prompts as slots fits an idle service even with no room to wait; one of
// more can never be admitted: 400 naming the limit and the flags, not 429.
TEST_F(BackpressureTest, ARequestOfMorePromptsThanTheServiceHoldsIsInvalid) {
  httplib::Result r = Complete(kReplicas * kSlots);
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(nlohmann::json::parse(r->body)["choices"].size(), size_t{kReplicas * kSlots});

  r = Complete(kReplicas * kSlots + 1);
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 400) << r->body;
  EXPECT_THAT(r->body, HasSubstr("17 sequences"));
  EXPECT_THAT(r->body, HasSubstr("16 KV slots"));
  EXPECT_THAT(r->body, HasSubstr("--max_waiting"));
  EXPECT_THAT(r->body, HasSubstr("\"param\":\"prompt\""));
}

}  // namespace
}  // namespace tandem::testing
