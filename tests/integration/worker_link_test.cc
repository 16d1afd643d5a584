// The worker's link flags and RPCs as a CPU build sees them: --backend/--transport/--dtype
// checking, PrepareLink and AssignStage's transport field on a real tandem-worker process, and the
// gRPC link carrying fp16/bf16 rows as they are (dtype field) with bad messages refused.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster.h"
#include "worker/transport/grpc_transport.h"

namespace tandem::testing {
namespace {

using ::testing::HasSubstr;

std::filesystem::path TempPath(const std::string& name) {
  return std::filesystem::path(::testing::TempDir()) / absl::StrCat(name, "-", getpid());
}

// Runs tandem-worker with `flags`; its exit code and its output.
std::pair<int, std::string> RunWorker(const std::vector<std::string>& flags) {
  const std::filesystem::path log = TempPath("worker-flags.log");
  // The coordinator address is closed: a worker that got past its flags would keep retrying, so
  // `timeout` ends it (exit 124) rather than hang the test.
  const std::string cmd =
      absl::StrCat("timeout 10 ", TANDEM_WORKER_BIN, " --coordinator=127.0.0.1:1 ",
                   "--metrics_address= ", absl::StrJoin(flags, " "), " > ", log.string(), " 2>&1");
  const int rc = std::system(cmd.c_str());
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, text.str()};
}

TEST(WorkerLinkTest, UnknownTransportIsRefusedAtStart) {
  auto [rc, out] = RunWorker({"--transport=infiniband"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_THAT(out, HasSubstr("--transport: 'infiniband'"));
}

TEST(WorkerLinkTest, NcclTransportNeedsTheCudaBackend) {
  auto [rc, out] = RunWorker({"--backend=cpu", "--transport=nccl"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_THAT(out, HasSubstr("--transport=nccl needs --backend=cuda"));
}

TEST(WorkerLinkTest, BatchInvariantNeedsTheCudaBackend) {
  auto [rc, out] = RunWorker({"--backend=cpu", "--batch_invariant"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_THAT(out, HasSubstr("--batch_invariant needs --backend=cuda"));
}

TEST(WorkerLinkTest, FewerThanOneCpuThreadIsRefusedAtStart) {
  auto [rc, out] = RunWorker({"--backend=cpu", "--cpu_threads=0"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_THAT(out, HasSubstr("--cpu_threads: 0 threads (expected at least 1)"));
}

TEST(WorkerLinkTest, StepTraceThatCannotBeOpenedIsRefusedAtStart) {
  auto [rc, out] = RunWorker({"--step_trace=/nonexistent-dir/steps.tsv"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_THAT(out, HasSubstr("--step_trace: cannot open '/nonexistent-dir/steps.tsv'"));
}

TEST(WorkerLinkTest, UnknownLaunchAheadModeIsRefusedAtStart) {
  auto [rc, out] = RunWorker({"--launch_ahead=sometimes"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_THAT(out, HasSubstr("--launch_ahead: 'sometimes' (expected auto, always or off)"));
}

TEST(WorkerLinkTest, UnknownBackendIsRefusedAtStart) {
  auto [rc, out] = RunWorker({"--backend=tpu"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_THAT(out, HasSubstr("--backend: 'tpu'"));
}

#ifdef TANDEM_HAVE_CUDA
TEST(WorkerLinkTest, CudaBackendRefusesUnknownDtype) {
  auto [rc, out] = RunWorker({"--backend=cuda", "--dtype=f32"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_THAT(out, HasSubstr("--dtype: 'f32'"));
}

TEST(WorkerLinkTest, CudaBackendRefusesKvFractionOutsideZeroOne) {
  auto [rc, out] = RunWorker({"--backend=cuda", "--kv_memory_fraction=1.5"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_THAT(out, HasSubstr("--kv_memory_fraction"));
}
#else
TEST(WorkerLinkTest, CudaBackendInBuildWithoutCudaSaysSo) {
  auto [rc, out] = RunWorker({"--backend=cuda", "--gpu=0"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_THAT(out, HasSubstr("built without CUDA"));
}
#endif

// The KV memory share sizes a CPU worker's paged pool too: (0, 1], named when outside.
TEST(WorkerLinkTest, CpuBackendRefusesKvFractionOutsideZeroOne) {
  for (const char* bad : {"0", "1.5"}) {
    auto [rc, out] = RunWorker({"--backend=cpu", absl::StrCat("--kv_memory_fraction=", bad)});
    EXPECT_EQ(rc, 2) << out;
    EXPECT_THAT(out, HasSubstr("(expected a share in (0, 1])")) << bad;
  }
  // At the bound the worker starts and serves.
  absl::StatusOr<std::unique_ptr<Process>> p = Process::Start(
      {TANDEM_WORKER_BIN, "--coordinator=127.0.0.1:1", "--listen=127.0.0.1:0", "--metrics_address=",
       "--backend=cpu", "--kv_memory_fraction=1"},
      TempPath("cpu-worker-kv-fraction-1.log"));
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<int> port = (*p)->WaitForPort();
  EXPECT_TRUE(port.ok()) << port.status() << (*p)->Log();
}

// A CPU worker process serving on a free port (no coordinator: it only warns that it cannot
// register).
class WorkerLinkProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Process>> p = Process::Start(
        {TANDEM_WORKER_BIN, "--coordinator=127.0.0.1:1", "--listen=127.0.0.1:0",
         "--metrics_address="},
        // A log of its own per test: an earlier worker's "listening on port" line must not be
        // read as this one's.
        TempPath(absl::StrCat("cpu-worker-",
                              ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                              ".log")));
    ASSERT_TRUE(p.ok()) << p.status();
    worker_ = *std::move(p);
    absl::StatusOr<int> port = worker_->WaitForPort();
    ASSERT_TRUE(port.ok()) << port.status() << worker_->Log();
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", *port),
                                   grpc::InsecureChannelCredentials());
  }

  grpc::Status Assign(const std::string& transport, v1::AssignStageResponse* resp) {
    v1::AssignStageRequest req;
    req.set_assignment_id(5);
    req.set_stage(0);
    req.set_num_stages(2);
    req.set_next_address("127.0.0.1:1");
    req.set_model_dir("/nonexistent-model");
    req.set_first_layer(0);
    req.set_last_layer(1);
    req.set_max_slots(1);
    req.set_transport(transport);
    if (transport == "nccl") req.set_nccl_id(std::string(128, '\1'));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    return v1::Worker::NewStub(channel_)->AssignStage(&ctx, req, resp);
  }

  std::unique_ptr<Process> worker_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(WorkerLinkProcessTest, PrepareLinkOffersGrpc) {
  v1::PrepareLinkRequest req;
  req.set_assignment_id(3);
  req.set_num_stages(2);
  v1::PrepareLinkResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  grpc::Status s = v1::Worker::NewStub(channel_)->PrepareLink(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.transport(), "grpc");
  EXPECT_TRUE(resp.nccl_id().empty());
}

TEST_F(WorkerLinkProcessTest, NcclAssignmentFailsWithoutNccl) {
  v1::AssignStageResponse resp;
  grpc::Status s = Assign("nccl", &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("transport nccl"));
}

TEST_F(WorkerLinkProcessTest, UnknownTransportInAssignmentIsInvalid) {
  v1::AssignStageResponse resp;
  grpc::Status s = Assign("carrier-pigeon", &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("transport: 'carrier-pigeon'"));
}

grpc::Status SendRaw(const std::shared_ptr<grpc::Channel>& channel,
                     const v1::ActivationsMessage& msg) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::ActivationsAck ack;
  auto writer = v1::StageLink::NewStub(channel)->Activations(&ctx, &ack);
  writer->Write(msg);
  writer->WritesDone();
  return writer->Finish();
}

TEST_F(WorkerLinkProcessTest, ActivationsWithUnknownDtypeAreRefused) {
  v1::ActivationsMessage msg;
  msg.set_assignment_id(1);
  msg.set_rows(1);
  msg.set_cols(2);
  msg.set_dtype("F8");
  msg.set_data(std::string(2, '\0'));
  grpc::Status s = SendRaw(channel_, msg);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("dtype 'F8'"));
}

TEST_F(WorkerLinkProcessTest, HalfActivationsOfTheWrongSizeAreRefused) {
  v1::ActivationsMessage msg;
  msg.set_assignment_id(1);
  msg.set_rows(2);
  msg.set_cols(3);
  msg.set_dtype("F16");
  msg.set_data(std::string(2 * 3 * 4, '\0'));  // fp32-sized: twice too many bytes
  grpc::Status s = SendRaw(channel_, msg);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("24 bytes for [2, 3] F16"));
}

// In-process: GrpcTransport to a StageLinkService, as between two stage workers.
class WorkerLinkGrpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(&service_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    inbox_.Reset(9);
  }
  void TearDown() override { server_->Shutdown(); }

  ActivationInbox inbox_;
  StageLinkService service_{inbox_};
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

Activations HostRows(DType t, int64_t rows, int64_t cols, const std::vector<uint16_t>& bits) {
  Activations a;
  a.rows = rows;
  a.cols = cols;
  a.dtype = t;
  auto buf = std::shared_ptr<uint16_t[]>(new uint16_t[bits.size()]);
  std::copy(bits.begin(), bits.end(), buf.get());
  a.data = std::shared_ptr<void>(buf, buf.get());
  return a;
}

TEST_F(WorkerLinkGrpcTest, HalfAndBf16RowsArriveAsSentWithTheirDtype) {
  GrpcTransport send(nullptr, 9, absl::StrCat("127.0.0.1:", port_), absl::Seconds(5));
  GrpcTransport recv(&inbox_, 9, "", absl::Seconds(5));
  const std::vector<uint16_t> f16 = {FloatToHalf(1.5f), FloatToHalf(-2.0f), FloatToHalf(3.25f),
                                     FloatToHalf(0.0f), FloatToHalf(65504.0f), FloatToHalf(-1e-3f)};
  const std::vector<uint16_t> bf16 = {FloatToBF16(7.0f), FloatToBF16(-0.5f)};
  ASSERT_TRUE(send.Send(1, HostRows(DType::kF16, 2, 3, f16)).ok());
  ASSERT_TRUE(send.Send(2, HostRows(DType::kBF16, 1, 2, bf16)).ok());
  auto never = [] { return false; };
  absl::StatusOr<Activations> a = recv.Recv(1, never);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->dtype, DType::kF16);
  EXPECT_EQ(a->where, Where::kHost);
  EXPECT_EQ(a->rows, 2);
  EXPECT_EQ(a->cols, 3);
  EXPECT_EQ(a->nbytes(), 12u);
  const auto* got = static_cast<const uint16_t*>(a->data.get());
  EXPECT_EQ(std::vector<uint16_t>(got, got + 6), f16);
  absl::StatusOr<Activations> b = recv.Recv(2, never);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->dtype, DType::kBF16);
  const auto* gotb = static_cast<const uint16_t*>(b->data.get());
  EXPECT_EQ(std::vector<uint16_t>(gotb, gotb + 2), bf16);
}

TEST_F(WorkerLinkGrpcTest, Fp32RowsStillArriveAsFp32) {
  GrpcTransport send(nullptr, 9, absl::StrCat("127.0.0.1:", port_), absl::Seconds(5));
  GrpcTransport recv(&inbox_, 9, "", absl::Seconds(5));
  Activations a;
  a.rows = 1;
  a.cols = 2;
  auto buf = std::shared_ptr<float[]>(new float[2]{0.25f, -4.0f});
  a.data = std::shared_ptr<void>(buf, buf.get());
  ASSERT_TRUE(send.Send(4, a).ok());
  absl::StatusOr<Activations> got = recv.Recv(4, [] { return false; });
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->dtype, DType::kF32);
  const auto* f = static_cast<const float*>(got->data.get());
  EXPECT_EQ(f[0], 0.25f);
  EXPECT_EQ(f[1], -4.0f);
}

// The gRPC link has no device to queue a step on: a posted receive is the blocking one, whole.
TEST_F(WorkerLinkGrpcTest, PostedReceiveReturnsTheRowsOnArrival) {
  GrpcTransport send(nullptr, 9, absl::StrCat("127.0.0.1:", port_), absl::Seconds(5));
  GrpcTransport recv(&inbox_, 9, "", absl::Seconds(5));
  const std::vector<uint16_t> f16 = {FloatToHalf(0.5f), FloatToHalf(-8.0f)};
  ASSERT_TRUE(send.Send(5, HostRows(DType::kF16, 1, 2, f16)).ok());
  ActivationTransport& t = recv;
  absl::StatusOr<Activations> a = t.PostRecv(5, 1, [] { return false; });
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->where, Where::kHost);
  EXPECT_EQ(a->ready, nullptr);
  EXPECT_FALSE(a->arrival);
  const auto* got = static_cast<const uint16_t*>(a->data.get());
  EXPECT_EQ(std::vector<uint16_t>(got, got + 2), f16);
}

TEST_F(WorkerLinkGrpcTest, DeviceActivationsAreRefusedByTheHostLink) {
  GrpcTransport send(nullptr, 9, absl::StrCat("127.0.0.1:", port_), absl::Seconds(5));
  Activations a = HostRows(DType::kF16, 1, 1, {FloatToHalf(1.0f)});
  a.where = Where::kDevice;
  absl::Status s = send.Send(1, a);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("host activations only"));
}

}  // namespace
}  // namespace tandem::testing
