// Sizes a client or a peer controls, through real processes: a KV-cache whose size overflows, a
// topology whose worker count overflows, prompts and stop strings beyond their bounds, messages
// beyond the servers' receive limits, and text that is not UTF-8 (gRPC and HTTP). Each is refused
// with an error naming the sizes or the bad byte, and the process keeps serving.
#include <unistd.h>

#include <filesystem>
#include <regex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/httplib.h"
#include "coordinator/request_validation.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster.h"
#include "tools/model_generator.h"

namespace tandem::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kContext = 256;  // tiny-llama's positions

std::filesystem::path TempPath(const std::string& name) {
  return std::filesystem::path(::testing::TempDir()) / absl::StrCat(name, "-", getpid());
}

// tiny-llama (4 layers, kv_dim 32) with `max_positions`.
std::filesystem::path WriteModel(const std::string& name, int max_positions) {
  const std::filesystem::path dir = TempPath(name);
  absl::StatusOr<ModelConfig> c = PresetConfig("tiny-llama");
  EXPECT_TRUE(c.ok()) << c.status();
  c->max_positions = max_positions;
  const absl::Status s = WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 3}, dir);
  EXPECT_TRUE(s.ok()) << s;
  return dir;
}

grpc::Status Assign(v1::Worker::Stub& worker, const std::filesystem::path& model, int slots,
                    int seq_len) {
  v1::AssignStageRequest req;
  req.set_assignment_id(7);
  req.set_stage(0);
  req.set_num_stages(1);
  req.set_model_dir(model.string());
  req.set_first_layer(0);
  req.set_last_layer(-1);
  req.set_max_slots(slots);
  req.set_max_seq_len(seq_len);
  v1::AssignStageResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  return worker.AssignStage(&ctx, req, &resp);
}

// The checkpoint: max_position_embeddings 2^31 - 1, then 2^27 slots of 2^30 positions.
// The cache's floats, 2^27 x 4 x 2^30 x 32 = 2^64, wrapped to a zero-byte cache and the worker
// died at its first step; now AssignStage refuses the sizes and the worker takes a sane one.
TEST(BoundsTest, WorkerRefusesAKvCacheWhoseSizeOverflows) {
  const std::filesystem::path model = WriteModel("bounds-huge-context", 2147483647);
  absl::StatusOr<std::unique_ptr<Process>> worker =
      Process::Start({TANDEM_WORKER_BIN, "--coordinator=127.0.0.1:1", "--listen=127.0.0.1:0",
                      "--metrics_address="},
                     TempPath("bounds-worker.log"));
  ASSERT_TRUE(worker.ok()) << worker.status();
  absl::StatusOr<int> port = (*worker)->WaitForPort();
  ASSERT_TRUE(port.ok()) << port.status() << (*worker)->Log();
  auto stub = v1::Worker::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", *port), grpc::InsecureChannelCredentials()));
  const grpc::Status huge = Assign(*stub, model, 1 << 27, 1 << 30);
  EXPECT_EQ(huge.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << huge.error_message();
  EXPECT_THAT(huge.error_message(),
              HasSubstr("134217728 slots x 4 layers x 1073741824 positions x 32 (kv_dim)"));
  EXPECT_THAT(huge.error_message(), HasSubstr("overflows 64 bits"));
  const grpc::Status sane = Assign(*stub, model, 2, 64);
  EXPECT_TRUE(sane.ok()) << sane.error_message() << (*worker)->Log();
  std::filesystem::remove_all(model);
}

class BoundsClusterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = new std::filesystem::path(WriteModel("bounds-model", kContext));
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*model_);
    delete model_;
  }

  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Cluster>> c =
        Cluster::Start({.model_dir = *model_, .coordinator_flags = {"--http_listen=127.0.0.1:0"}});
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
    std::smatch m;
    const std::string logs = cluster_->Logs();
    ASSERT_TRUE(std::regex_search(logs, m, std::regex("http on port ([0-9]+)"))) << logs;
    http_ = std::make_unique<httplib::Client>("127.0.0.1", std::stoi(m[1].str()));
    http_->set_read_timeout(120);
    http_->set_write_timeout(120);
  }

  grpc::Status Generate(const v1::GenerateRequest& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
    v1::GenerateResponse resp;
    return cluster_->inference().Generate(&ctx, req, &resp);
  }

  httplib::Result Post(const std::string& body) {
    return http_->Post("/v1/completions", body, "application/json");
  }

  // The service still answers a normal request.
  void ExpectServing() {
    v1::GenerateRequest ok;
    ok.set_prompt("Hello");
    ok.set_max_new_tokens(2);
    const grpc::Status s = Generate(ok);
    EXPECT_TRUE(s.ok()) << s.error_message() << cluster_->Logs();
  }

  static std::filesystem::path* model_;
  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<httplib::Client> http_;
};
std::filesystem::path* BoundsClusterTest::model_ = nullptr;

TEST_F(BoundsClusterTest, PromptOverTheByteBoundIsRefusedNamingItsBytes) {
  const int64_t bound = MaxPromptBytes({.context_length = kContext});
  v1::GenerateRequest req;
  req.set_prompt(std::string(bound + 1, 'a'));
  grpc::Status s = Generate(req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(),
              HasSubstr(absl::StrFormat("prompt: %d bytes, more than the %d", bound + 1, bound)));
  // A message beyond the largest legal request is not read at all (it was up to 64 MiB).
  req.set_prompt(std::string(MaxRequestBytes({.context_length = kContext}) + 1, 'a'));
  s = Generate(req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();

  httplib::Result r = Post(nlohmann::json{{"prompt", std::string(bound + 1, 'a')}}.dump());
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 400) << r->body;
  EXPECT_THAT(r->body, HasSubstr(absl::StrFormat("%d bytes, more than the %d", bound + 1, bound)));
  r = Post(nlohmann::json{
      {"prompt", std::string(4 * MaxRequestBytes({.context_length = kContext}), 'a')}}
               .dump());
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 413);
  ExpectServing();
}

TEST_F(BoundsClusterTest, StopStringsBeyondTheirBoundsAreRefusedNamingTheField) {
  v1::GenerateRequest req;
  req.set_prompt("Hello");
  for (int i = 0; i <= kMaxStopStrings; ++i) req.add_stop("x");
  grpc::Status s = Generate(req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("stop: 33 stop strings"));
  req.clear_stop();
  req.add_stop(std::string(kMaxStopStringBytes + 1, 'x'));
  s = Generate(req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("stop[0]: 1025 bytes"));
  ExpectServing();
}

TEST_F(BoundsClusterTest, InvalidUtf8OverHttpNamesTheByteOffset) {
  httplib::Result r = Post("{\"prompt\": \"caf\xC3\xA9 \xFF\"}");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 400) << r->body;
  EXPECT_THAT(r->body, HasSubstr("not valid UTF-8: byte 18 (0xFF)"));
  ExpectServing();
}

// protobuf refused these before the service saw them, and the client got INTERNAL with an empty
// message; now the traits that read the request (proto/grpc_request_traits.h) name the field and
// the offset of the first bad byte inside it.
TEST_F(BoundsClusterTest, InvalidUtf8OverGrpcNamesTheFieldAndByteOffset) {
  v1::GenerateRequest req;
  req.set_prompt("0123456789abcdef\xC3\xA9\xFF tail");  // byte 18: after a whole 2-byte 'e'
  req.set_max_new_tokens(2);
  grpc::Status s = Generate(req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("prompt: not valid UTF-8: byte 18 (0xFF)"));

  req.set_prompt("Hello");
  req.add_stop("fine");
  req.add_stop("ab\xE2\x82");  // a euro sign cut after 2 of its 3 bytes
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  std::unique_ptr<grpc::ClientReader<v1::GenerateStreamResponse>> reader =
      cluster_->inference().GenerateStream(&ctx, req);
  v1::GenerateStreamResponse msg;
  EXPECT_FALSE(reader->Read(&msg));
  s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("stop[1]: not valid UTF-8: byte 2 (0xE2)"));

  // The same service then answers a well-formed request with tokens.
  v1::GenerateRequest ok;
  ok.set_prompt("Hello \xE2\x82\xAC");
  ok.set_max_new_tokens(3);
  ok.set_ignore_eos(true);
  grpc::ClientContext ok_ctx;
  ok_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  v1::GenerateResponse resp;
  s = cluster_->inference().Generate(&ok_ctx, ok, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message() << cluster_->Logs();
  EXPECT_EQ(resp.token_ids_size(), 3);
}

// 2 x 2^30 replicas overflowed the int product (stored as 1,073,741,824 replicas).
TEST_F(BoundsClusterTest, TopologyWhoseWorkerCountOverflowsIsInvalid) {
  v1::SetTopologyRequest req;
  req.set_stages(2);
  req.set_replicas(1 << 30);
  v1::Topology resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  const grpc::Status s = cluster_->admin().SetTopology(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("stages x replicas: 2 x 1073741824"));
  ExpectServing();
}

}  // namespace
}  // namespace tandem::testing
