// TLS and keys through real processes on loopback: a coordinator and a CPU worker that require
// the API key, the admin key and the cluster secret, and a pair that talk mutual TLS with
// certificates this test makes with openssl (never committed).
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "common/httplib.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster.h"
#include "tools/model_generator.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr char kApiKey[] = "api-7f3a";
constexpr char kAdminKey[] = "admin-91c2";
constexpr char kSecret[] = "cluster-5d0e";

fs::path& Base() {
  static fs::path dir;
  return dir;
}
fs::path ModelRoot() { return Base() / "models"; }
fs::path ModelDir() { return ModelRoot() / "tiny-llama"; }

// A CA and a certificate it signed for 127.0.0.1/localhost, usable as server and client.
struct Pki {
  fs::path ca, cert, key;
};

absl::Status Sh(const std::string& command) {
  const int rc = std::system((command + " >/dev/null 2>&1").c_str());
  if (rc != 0) return absl::InternalError(absl::StrCat("failed (", rc, "): ", command));
  return absl::OkStatus();
}

absl::StatusOr<Pki> MakePki(const fs::path& dir, const std::string& name) {
  fs::create_directories(dir);
  const std::string d = dir.string() + "/" + name;
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  {
    std::ofstream ext(d + "-ext.cnf");
    ext << "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        << "extendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n";
  }
  for (const std::string& cmd : {
           absl::StrCat("openssl req -x509 ", ec, " -days 2 -subj /CN=", name, "-ca -keyout ", d,
                        "-ca.key -out ", d, "-ca.pem -addext basicConstraints=critical,CA:TRUE",
                        " -addext keyUsage=critical,keyCertSign,cRLSign"),
           absl::StrCat("openssl req ", ec, " -subj /CN=", name, "-member -keyout ", d,
                        "-member.key -out ", d, "-member.csr"),
           absl::StrCat("openssl x509 -req -in ", d, "-member.csr -CA ", d, "-ca.pem -CAkey ", d,
                        "-ca.key -CAcreateserial -days 2 -out ", d, "-member.pem -extfile ", d,
                        "-ext.cnf")}) {
    if (absl::Status s = Sh(cmd); !s.ok()) return s;
  }
  return Pki{.ca = d + "-ca.pem", .cert = d + "-member.pem", .key = d + "-member.key"};
}

std::vector<std::string> TlsFlags(const Pki& p) {
  return {"--tls_cert=" + p.cert.string(), "--tls_key=" + p.key.string(),
          "--tls_ca=" + p.ca.string()};
}

// TLS that trusts `ca` and presents no certificate of its own.
TlsFiles TrustOnly(const fs::path& ca) {
  TlsFiles tls;
  tls.ca = ca.string();
  return tls;
}

// A plain channel's credentials with `key`.
ClientAuth KeyOnly(const std::string& key) {
  ClientAuth auth;
  auth.key = key;
  return auth;
}

ClientAuth Auth(const TlsFiles& tls, const std::string& key) {
  absl::StatusOr<ClientAuth> a = MakeClientAuth(tls, key);
  EXPECT_TRUE(a.ok()) << a.status();
  return a.ok() ? *a : ClientAuth{};
}

// A call context that gives up after a few seconds (a refused handshake fails at once).
std::unique_ptr<grpc::ClientContext> Ctx() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return ctx;
}

v1::GenerateRequest SmallRequest() {
  v1::GenerateRequest r;
  r.add_token_ids(1);
  r.add_token_ids(2);
  r.set_max_new_tokens(2);
  return r;
}

grpc::Status Generate(const std::shared_ptr<grpc::Channel>& channel) {
  v1::GenerateResponse resp;
  return v1::Inference::NewStub(channel)->Generate(Ctx().get(), SmallRequest(), &resp);
}

grpc::Status Register(const std::shared_ptr<grpc::Channel>& channel, const std::string& address) {
  v1::RegisterRequest req;
  req.set_address(address);
  req.set_backend("cpu");
  v1::RegisterResponse resp;
  return v1::Registry::NewStub(channel)->Register(Ctx().get(), req, &resp);
}

grpc::Status Assign(const std::shared_ptr<grpc::Channel>& channel, const std::string& model_dir) {
  v1::AssignStageRequest req;
  req.set_assignment_id(1u << 30);
  req.set_stage(0);
  req.set_num_stages(1);
  req.set_model_dir(model_dir);
  req.set_first_layer(0);
  req.set_last_layer(-1);
  req.set_max_slots(1);
  v1::AssignStageResponse resp;
  return v1::Worker::NewStub(channel)->AssignStage(Ctx().get(), req, &resp);
}

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Base() = fs::path(::testing::TempDir()) / absl::StrFormat("tandem-security-%d", getpid());
    absl::StatusOr<ModelConfig> c = PresetConfig("tiny-llama");
    ASSERT_TRUE(c.ok()) << c.status();
    absl::Status s = WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 3}, ModelDir());
    ASSERT_TRUE(s.ok()) << s;
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(Base(), ec);
  }
  void SetUp() override {
    if (std::system("openssl version >/dev/null 2>&1") != 0) {
      const char* ci = std::getenv("CI");
      if (ci != nullptr && std::string(ci) == "true") FAIL() << "openssl is required (CI=true)";
      GTEST_SKIP() << "openssl not found (scripts/setup installs it)";
    }
  }
};

// --------------------------------------------------------------------------------------------
// Keys without TLS.

class KeysTest : public SecurityTest {
 protected:
  void SetUp() override {
    SecurityTest::SetUp();
    if (IsSkipped()) return;
    absl::StatusOr<std::unique_ptr<Cluster>> c = Cluster::Start(
        {.model_dir = ModelDir(),
         .coordinator_flags = {absl::StrCat("--api_key=", kApiKey),
                               absl::StrCat("--admin_key=", kAdminKey),
                               absl::StrCat("--cluster_secret=", kSecret),
                               "--http_listen=127.0.0.1:0"},
         .worker_flags = {absl::StrCat("--cluster_secret=", kSecret),
                          "--model_root=" + ModelRoot().string()},
         .inference_auth = KeyOnly(kApiKey),
         .admin_auth = KeyOnly(kAdminKey)});
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
  }
  std::shared_ptr<grpc::Channel> Plain(const std::string& key, const std::string& address = "") {
    return MakeChannel(address.empty() ? cluster_->address() : address, KeyOnly(key));
  }
  std::string WorkerAddress() const {
    return absl::StrCat("127.0.0.1:", cluster_->worker_port(0));
  }
  std::unique_ptr<Cluster> cluster_;
};

TEST_F(KeysTest, InferenceWithoutTheApiKeyIsUnauthenticated) {
  EXPECT_TRUE(Generate(cluster_->channel()).ok());
  for (const std::string key : {"", "wrong", kAdminKey, kSecret}) {
    grpc::Status s = Generate(Plain(key));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << "key '" << key << "'";
    EXPECT_THAT(s.error_message(), HasSubstr("api key"));
  }
  v1::GenerateStreamResponse msg;
  auto ctx = Ctx();
  auto stream = v1::Inference::NewStub(Plain(""))->GenerateStream(ctx.get(), SmallRequest());
  EXPECT_FALSE(stream->Read(&msg));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  v1::ModelInfo info;
  EXPECT_EQ(v1::Inference::NewStub(Plain(""))->GetModelInfo(Ctx().get(), {}, &info).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(KeysTest, AdminNeedsTheAdminKey) {
  v1::Topology t;
  EXPECT_TRUE(cluster_->admin().GetTopology(Ctx().get(), {}, &t).ok());
  auto admin = v1::Admin::NewStub(Plain(kApiKey));
  EXPECT_EQ(admin->GetTopology(Ctx().get(), {}, &t).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::SetTopologyRequest set;
  set.set_stages(1);
  set.set_replicas(1);
  EXPECT_EQ(admin->SetTopology(Ctx().get(), set, &t).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::DrainRequest drain;
  drain.set_worker_id(1);
  grpc::Status s = admin->Drain(Ctx().get(), drain, &t);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(s.error_message(), HasSubstr("admin key"));
  v1::ListWorkersResponse workers;
  EXPECT_EQ(admin->ListWorkers(Ctx().get(), {}, &workers).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  // The refused Drain changed nothing.
  EXPECT_TRUE(cluster_->WaitForTopology(1, 1, 5).ok());
}

TEST_F(KeysTest, HttpWithoutTheApiKeyGets401WithOpenAisErrorBody) {
  std::smatch m;
  const std::string logs = cluster_->Logs();
  ASSERT_TRUE(std::regex_search(logs, m, std::regex("http on port ([0-9]+)"))) << logs;
  httplib::Client http("127.0.0.1", std::stoi(m[1].str()));
  const std::string body = R"({"prompt": [1, 2], "max_tokens": 2})";
  httplib::Result none = http.Post("/v1/completions", body, "application/json");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 401);
  const nlohmann::json error = nlohmann::json::parse(none->body, nullptr, false);
  ASSERT_TRUE(error.contains("error")) << none->body;
  EXPECT_THAT(error["error"]["message"].get<std::string>(), HasSubstr("api key"));
  EXPECT_TRUE(error["error"].contains("type"));
  httplib::Result wrong = http.Post("/v1/completions", {{"Authorization", "Bearer wrong"}}, body,
                                    "application/json");
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 401);
  httplib::Result models = http.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(models->status, 401);
  httplib::Result ok = http.Post(
      "/v1/completions", {{"Authorization", absl::StrCat("Bearer ", kApiKey)}}, body,
      "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  httplib::Result health = http.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);  // load balancers probe without a key
}

TEST_F(KeysTest, AFakeWorkerWithoutTheClusterSecretIsRefused) {
  for (const std::string key : {"", "wrong", kApiKey, kAdminKey}) {
    grpc::Status s = Register(Plain(key), "127.0.0.1:1");
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << "key '" << key << "'";
    EXPECT_THAT(s.error_message(), HasSubstr("cluster secret"));
  }
  v1::HeartbeatRequest hb;
  hb.set_worker_id(1);
  v1::HeartbeatResponse hb_resp;
  EXPECT_EQ(v1::Registry::NewStub(Plain(""))->Heartbeat(Ctx().get(), hb, &hb_resp).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::ListWorkersResponse workers;
  ASSERT_TRUE(cluster_->admin().ListWorkers(Ctx().get(), {}, &workers).ok());
  EXPECT_EQ(workers.workers_size(), 1);
}

TEST_F(KeysTest, RegisteringAnotherHostsAddressIsRefused) {
  // 192.0.2.1 (TEST-NET-1) is not this machine, where the caller runs.
  grpc::Status s = Register(Plain(kSecret), "192.0.2.1:5000");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("192.0.2.1:5000"));
  v1::ListWorkersResponse workers;
  ASSERT_TRUE(cluster_->admin().ListWorkers(Ctx().get(), {}, &workers).ok());
  EXPECT_EQ(workers.workers_size(), 1);
}

TEST_F(KeysTest, TheWorkerRefusesCallersWithoutTheClusterSecret) {
  for (const std::string key : {"", kApiKey, kAdminKey}) {
    auto channel = Plain(key, WorkerAddress());
    grpc::Status s = Assign(channel, ModelDir().string());
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << "key '" << key << "'";
    v1::PrepareLinkRequest prepare;
    prepare.set_num_stages(2);
    v1::PrepareLinkResponse prepared;
    EXPECT_EQ(v1::Worker::NewStub(channel)->PrepareLink(Ctx().get(), prepare, &prepared)
                  .error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    auto steps_ctx = Ctx();
    auto steps = v1::Worker::NewStub(channel)->Steps(steps_ctx.get());
    v1::StepResult result;
    EXPECT_FALSE(steps->Read(&result));
    EXPECT_EQ(steps->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
    auto link_ctx = Ctx();
    v1::ActivationsAck ack;
    auto writer = v1::StageLink::NewStub(channel)->Activations(link_ctx.get(), &ack);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  // The pipeline still serves.
  EXPECT_TRUE(Generate(cluster_->channel()).ok());
}

TEST_F(KeysTest, TheWorkerLoadsOnlyUnderItsModelRoot) {
  auto channel = Plain(kSecret, WorkerAddress());
  const fs::path outside = Base() / "outside";
  fs::create_directories(outside);
  fs::copy(ModelDir(), outside / "tiny-llama");
  const std::string exists = (outside / "tiny-llama").string();
  const std::string missing = (outside / "no-such-model").string();
  grpc::Status a = Assign(channel, exists);
  grpc::Status b = Assign(channel, missing);
  EXPECT_EQ(a.error_code(), grpc::StatusCode::NOT_FOUND) << a.error_message();
  EXPECT_EQ(b.error_code(), a.error_code());
  // The same answer whether or not the folder outside exists.
  EXPECT_EQ(absl::StrReplaceAll(a.error_message(), {{exists, "<dir>"}}),
            absl::StrReplaceAll(b.error_message(), {{missing, "<dir>"}}));
  EXPECT_THAT(a.error_message(), HasSubstr("--model_root"));
  // The refused assignments left the serving stage alone.
  EXPECT_TRUE(Generate(cluster_->channel()).ok());
}

// --------------------------------------------------------------------------------------------
// Mutual TLS between the cluster's members (and the cluster secret); clients trust the CA.

class TlsTest : public SecurityTest {
 protected:
  void SetUp() override {
    SecurityTest::SetUp();
    if (IsSkipped()) return;
    absl::StatusOr<Pki> pki = MakePki(Base() / "pki", "tandem");
    ASSERT_TRUE(pki.ok()) << pki.status();
    absl::StatusOr<Pki> rogue = MakePki(Base() / "pki", "rogue");
    ASSERT_TRUE(rogue.ok()) << rogue.status();
    pki_ = *pki;
    rogue_ = *rogue;
    const ClientAuth client = Auth(TrustOnly(pki_.ca), "");
    // Two stages: the first sends its activations to the second over StageLink, through TLS
    // with the cluster secret.
    std::vector<std::string> flags = TlsFlags(pki_);
    flags.push_back(absl::StrCat("--cluster_secret=", kSecret));
    std::vector<std::string> coordinator_flags = flags;
    coordinator_flags.push_back("--http_listen=127.0.0.1:0");
    absl::StatusOr<std::unique_ptr<Cluster>> c =
        Cluster::Start({.model_dir = ModelDir(),
                        .workers = 2,
                        .stages = 2,
                        .coordinator_flags = coordinator_flags,
                        .worker_flags = flags,
                        .inference_auth = client,
                        .admin_auth = client});
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
  }
  static TlsFiles Member(const Pki& p, const fs::path& trust) {
    return {.cert = p.cert.string(), .key = p.key.string(), .ca = trust.string()};
  }
  std::string WorkerAddress() const {
    return absl::StrCat("127.0.0.1:", cluster_->worker_port(0));
  }
  Pki pki_, rogue_;
  std::unique_ptr<Cluster> cluster_;
};

TEST_F(TlsTest, ServesATwoStagePipelineOverTls) {
  grpc::Status s = Generate(cluster_->channel());
  EXPECT_TRUE(s.ok()) << s.error_message() << cluster_->Logs();
}

TEST_F(TlsTest, TheHttpApiServesHttpsWithTheSameCertificate) {
  std::smatch m;
  const std::string logs = cluster_->Logs();
  ASSERT_TRUE(std::regex_search(logs, m, std::regex("http on port ([0-9]+)"))) << logs;
  const int port = std::stoi(m[1].str());
  httplib::SSLClient https("127.0.0.1", port);
  https.set_ca_cert_path(pki_.ca.c_str());
  https.enable_server_certificate_verification(true);
  httplib::Result health = https.Get("/health");
  ASSERT_TRUE(health) << httplib::to_string(health.error());
  EXPECT_EQ(health->status, 200);
  httplib::SSLClient other_ca("127.0.0.1", port);
  other_ca.set_ca_cert_path(rogue_.ca.c_str());
  other_ca.enable_server_certificate_verification(true);
  EXPECT_FALSE(other_ca.Get("/health"));
  httplib::Client plain("127.0.0.1", port);
  httplib::Result plain_health = plain.Get("/health");
  EXPECT_TRUE(!plain_health || plain_health->status != 200);
}

TEST_F(TlsTest, AClientThatTrustsAnotherCaIsRefused) {
  grpc::Status s =
      Generate(MakeChannel(cluster_->address(), Auth(TrustOnly(rogue_.ca), "")));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
}

TEST_F(TlsTest, APlaintextClientIsRefused) {
  EXPECT_EQ(Generate(MakeChannel(cluster_->address(), {})).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, RegistryNeedsACertificateTheClusterCaSigned) {
  // The secret but no client certificate: TLS connects (clients of Inference have none),
  // Registry refuses.
  grpc::Status none =
      Register(MakeChannel(cluster_->address(), Auth(TrustOnly(pki_.ca), kSecret)),
               "127.0.0.1:1");
  EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED) << none.error_message();
  EXPECT_THAT(none.error_message(), HasSubstr("certificate"));
  // A certificate of another CA: the handshake fails.
  grpc::Status rogue =
      Register(MakeChannel(cluster_->address(), Auth(Member(rogue_, pki_.ca), kSecret)),
               "127.0.0.1:1");
  EXPECT_EQ(rogue.error_code(), grpc::StatusCode::UNAVAILABLE) << rogue.error_message();
  v1::ListWorkersResponse workers;
  ASSERT_TRUE(cluster_->admin().ListWorkers(Ctx().get(), {}, &workers).ok());
  EXPECT_EQ(workers.workers_size(), 2);
}

TEST_F(TlsTest, TheWorkerAcceptsOnlyCertificatesTheClusterCaSigned) {
  for (const TlsFiles& tls : {TrustOnly(pki_.ca), Member(rogue_, pki_.ca)}) {
    grpc::Status s = Assign(MakeChannel(WorkerAddress(), Auth(tls, "")), ModelDir().string());
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE)
        << "cert '" << tls.cert << "': " << s.error_message();
  }
  // A member's certificate gets through to AssignStage, which then judges the request itself.
  v1::AssignStageRequest bad;
  bad.set_num_stages(0);
  v1::AssignStageResponse resp;
  auto member_channel = MakeChannel(WorkerAddress(), Auth(Member(pki_, pki_.ca), kSecret));
  grpc::Status member = v1::Worker::NewStub(member_channel)->AssignStage(Ctx().get(), bad, &resp);
  EXPECT_EQ(member.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << member.error_message();
  EXPECT_TRUE(Generate(cluster_->channel()).ok());
}

}  // namespace
}  // namespace tandem::testing
