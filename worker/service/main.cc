// tandem-worker: one pipeline stage on one device. Serves Worker and StageLink (plus health and
// reflection), registers with the coordinator and heartbeats; the coordinator assigns its layers.
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "common/nvml.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "spdlog/spdlog.h"
#include "worker/cpu/cpu_stage.h"
#include "worker/service/worker_service.h"
#include "worker/transport/grpc_transport.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:50051", "the coordinator's host:port");
ABSL_FLAG(std::string, listen, "0.0.0.0:0", "host:port to serve on (port 0: any free port)");
ABSL_FLAG(std::string, advertise_host, "127.0.0.1",
          "host name the coordinator and the other workers use to reach this worker");
ABSL_FLAG(std::string, backend, "cpu", "compute backend: cpu");
ABSL_FLAG(int, recv_timeout_s, 300, "how long a stage waits for its input before failing a step");
ABSL_FLAG(std::string, metrics_address, "0.0.0.0:0",
          "host:port serving Prometheus /metrics (port 0: any free port, printed; empty: off)");

namespace {
std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }
}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("tandem-worker --coordinator HOST:PORT [--listen ADDR] [--backend cpu]");
  absl::ParseCommandLine(argc, argv);
  const std::string backend = absl::GetFlag(FLAGS_backend);
  tandem::StageFactory factory;
  if (backend == "cpu") {
    factory = [](const tandem::StageSpec& spec) { return tandem::MakeCpuStage(spec); };
  } else {
    spdlog::error("--backend: '{}' is not available in this build (available: cpu)", backend);
    return 2;
  }

  tandem::ActivationInbox inbox;
  tandem::WorkerService worker(factory, inbox,
                               absl::Seconds(absl::GetFlag(FLAGS_recv_timeout_s)));
  tandem::StageLinkService link(inbox);
  // Metrics are an aid, not a requirement: a taken port is logged and the worker runs on. GPU
  // readings appear where NVML is present.
  auto registry = std::make_shared<prometheus::Registry>();
  tandem::WorkerMetrics metrics(*registry);
  tandem::GpuMetrics gpu_metrics(*registry);
  std::unique_ptr<tandem::GpuSampler> gpu_sampler;
  std::unique_ptr<tandem::MetricsServer> metrics_server;
  if (const std::string addr = absl::GetFlag(FLAGS_metrics_address); !addr.empty()) {
    absl::StatusOr<std::unique_ptr<tandem::MetricsServer>> m =
        tandem::MetricsServer::Start(addr, registry);
    if (m.ok()) {
      metrics_server = *std::move(m);
      worker.set_metrics(&metrics);
      std::printf("tandem-worker metrics on port %d\n", metrics_server->port());
      absl::StatusOr<std::unique_ptr<tandem::Nvml>> nvml = tandem::Nvml::Load();
      absl::StatusOr<int> gpus = nvml.ok() ? (*nvml)->DeviceCount() : absl::StatusOr<int>(0);
      if (nvml.ok() && gpus.ok() && *gpus > 0) {
        gpu_sampler = std::make_unique<tandem::GpuSampler>(
            *std::move(nvml), tandem::VisibleGpuIndices(std::getenv("CUDA_VISIBLE_DEVICES"), *gpus),
            gpu_metrics, absl::Milliseconds(500));
      } else {
        spdlog::info("no GPU metrics: {}", nvml.ok() ? "no GPU" : nvml.status().ToString());
      }
    } else {
      spdlog::error("--metrics_address: {}; serving without metrics", m.status().ToString());
    }
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  builder.RegisterService(&worker);
  builder.RegisterService(&link);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    spdlog::error("--listen: cannot listen on {}", absl::GetFlag(FLAGS_listen));
    return 1;
  }
  const std::string address = absl::StrCat(absl::GetFlag(FLAGS_advertise_host), ":", port);
  std::printf("tandem-worker listening on port %d\n", port);
  std::fflush(stdout);
  spdlog::info("worker ({}) serving on {}, coordinator {}", backend, address,
               absl::GetFlag(FLAGS_coordinator));
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  {
    tandem::Registrar registrar(absl::GetFlag(FLAGS_coordinator), address, backend);
    while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  spdlog::info("shutting down");
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  return 0;
}
