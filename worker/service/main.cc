// tandem-worker: one pipeline stage on one device. Serves Worker and StageLink (plus health and
// reflection), registers with the coordinator and heartbeats; the coordinator assigns its layers.
#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/flags_usage.h"
#include "common/metrics.h"
#include "common/nvml.h"
#include "common/security/credentials.h"
#include "common/security/listen.h"
#include "common/security/tls_flags.h"
#include "common/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "prometheus/gauge.h"
#include "spdlog/spdlog.h"
#include "worker/cpu/cpu_backend.h"
#include "worker/cpu/cpu_stage.h"
#include "worker/service/worker_config.h"
#include "worker/service/worker_service.h"
#include "worker/transport/grpc_transport.h"
#ifdef TANDEM_HAVE_CUDA
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_tensor_parallel.h"
#include "worker/cuda/cuda_stage.h"
#endif

// A flag per setting of WorkerConfig, with its default and help (worker/service/worker_config.h).
TANDEM_DEFINE_SETTING_FLAGS(TANDEM_WORKER_SETTINGS, tandem::WorkerConfig, SetFromFlags)
ABSL_FLAG(std::string, cluster_secret, "",
          "secret shared with the coordinator and the other workers, presented on every call "
          "between them and required of every caller (env TANDEM_CLUSTER_SECRET; empty: none)");

namespace {
std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }

// --kv_memory_fraction, checked: a share in (0, 1].
absl::StatusOr<double> KvMemoryFraction(const tandem::WorkerConfig& config) {
  const double kv = config.kv_memory_fraction;
  if (!(kv > 0.0 && kv <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_memory_fraction: ", kv, " (expected a share in (0, 1])"));
  }
  return kv;
}

// The compute backend the flags ask for. A bad flag is INVALID_ARGUMENT with the message to
// print.
absl::StatusOr<std::unique_ptr<tandem::Backend>> CpuBackendFromFlags(
    const tandem::WorkerConfig& config, const std::string& transport) {
  if (transport == "nccl")
    return absl::InvalidArgumentError("--transport=nccl needs --backend=cuda");
  if (config.batch_invariant) {
    return absl::InvalidArgumentError(
        "--batch_invariant needs --backend=cuda (the cpu backend has no such mode)");
  }
  if (absl::Status s = tandem::SetCpuThreads(config.cpu_threads); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--cpu_threads: ", s.message()));
  }
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (config.tensor_parallel > cores && cores > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tensor_parallel: ", config.tensor_parallel, " ranks on a host of ", cores,
                     " cores (the cpu backend runs one thread per rank; at most ", cores, ")"));
  }
  absl::StatusOr<double> kv = KvMemoryFraction(config);
  if (!kv.ok()) return kv.status();
  return std::make_unique<tandem::CpuBackend>(config.quantization == "fp8",
                                              config.tensor_parallel, *kv);
}

#ifdef TANDEM_HAVE_CUDA
absl::StatusOr<tandem::CudaOptions> CudaOptionsFromFlags(
    const tandem::WorkerConfig& config) {
  tandem::CudaOptions options;
  options.device = config.gpu;
  absl::StatusOr<tandem::DType> dtype =
      tandem::ParseHalfDTypeFlag(config.dtype, "--dtype");
  if (!dtype.ok()) return absl::InvalidArgumentError(dtype.status().message());
  options.dtype = *dtype;
  absl::StatusOr<double> kv = KvMemoryFraction(config);
  if (!kv.ok()) return kv.status();
  options.kv_memory_fraction = static_cast<float>(*kv);
  options.batch_invariant = config.batch_invariant;
  if (options.device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gpu: ", options.device, " (expected a CUDA device index >= 0)"));
  }
  return options;
}
#endif

absl::StatusOr<std::unique_ptr<tandem::Backend>> CudaBackendFromFlags(
    const tandem::WorkerConfig& config) {
#ifdef TANDEM_HAVE_CUDA
  absl::StatusOr<tandem::CudaOptions> options = CudaOptionsFromFlags(config);
  if (!options.ok()) return options.status();
  if (config.tensor_parallel > 1) {
    if (absl::Status s = tandem::CheckTensorParallelDevices(options->device,
                                                            config.tensor_parallel);
        !s.ok()) {
      return absl::InvalidArgumentError(s.message());
    }
  }
  return std::make_unique<tandem::CudaBackend>(
      tandem::CudaBackendOptions{.stage = *options,
                                 .recv_timeout = absl::Seconds(config.recv_timeout_s),
                                 .kv_over_nccl = config.kv_over_nccl,
                                 .quantize_fp8 = config.quantization == "fp8",
                                 .tensor_parallel = config.tensor_parallel});
#else
  (void)config;
  return absl::InvalidArgumentError(
      "--backend=cuda: this tandem-worker was built without CUDA (available: cpu)");
#endif
}

// The backend and what PrepareLink offers ("auto": nccl on the cuda backend, grpc otherwise).
struct BackendChoice {
  std::unique_ptr<tandem::Backend> backend;
  std::string transport;
};

absl::StatusOr<BackendChoice> BackendFromFlags(const tandem::WorkerConfig& config) {
  const std::string backend = config.backend;
  const std::string transport = config.transport;
  if (transport != "grpc" && transport != "nccl" && transport != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("--transport: '", transport, "' (expected grpc, nccl or auto)"));
  }
  if (!config.quantization.empty() && config.quantization != "fp8") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--quantization: '", config.quantization, "' (expected fp8, or empty for none)"));
  }
  absl::StatusOr<std::unique_ptr<tandem::Backend>> b;
  if (backend == "cpu") {
    b = CpuBackendFromFlags(config, transport);
  } else if (backend == "cuda") {
    b = CudaBackendFromFlags(config);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend: '", backend, "' is not a backend (expected cpu or cuda)"));
  }
  if (!b.ok()) return b.status();
  return BackendChoice{*std::move(b), transport != "auto" ? transport
                                      : backend == "cuda" ? "nccl"
                                                          : "grpc"};
}

// Cluster members only: the secret on every call, and with --tls_ca a certificate the CA signed
// (the TLS handshake refuses clients without one).
struct Access {
  std::shared_ptr<grpc::ServerCredentials> server_credentials;
  tandem::ClientAuth cluster_auth;
  tandem::CallerPolicy callers;
};

absl::StatusOr<Access> AccessFromFlags(const tandem::WorkerConfig& config) {
  const tandem::TlsFiles tls = tandem::TlsFilesFromFlags();
  const std::string cluster_secret =
      tandem::FlagOrEnv(absl::GetFlag(FLAGS_cluster_secret), "TANDEM_CLUSTER_SECRET");
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server_credentials =
      tandem::MakeServerCredentials(tls, tandem::ClientCerts::kRequired);
  if (!server_credentials.ok()) return server_credentials.status();
  absl::StatusOr<tandem::ClientAuth> cluster_auth = tandem::MakeClientAuth(tls, cluster_secret);
  if (!cluster_auth.ok()) return cluster_auth.status();
  RETURN_IF_ERROR(
      tandem::CheckClusterListen("--listen", config.listen,
                                 {.has_secret = !cluster_secret.empty(),
                                  .has_client_ca = !tls.ca.empty(),
                                  .allow_insecure = config.allow_insecure}));
  return Access{*std::move(server_credentials), *std::move(cluster_auth),
                tandem::CallerPolicy{.key = cluster_secret, .key_name = "cluster secret"}};
}

// Metrics are an aid, not a requirement: a taken port is logged and the worker runs on. GPU
// readings appear where NVML is present.
struct Monitoring {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  tandem::WorkerMetrics metrics{*registry};
  tandem::GpuMetrics gpu_metrics{*registry};
  std::unique_ptr<tandem::GpuSampler> gpu_sampler;
  std::unique_ptr<tandem::MetricsServer> server;
};

// The GPUs whose readings the worker reports: a CUDA worker the one it computes on (found by
// UUID: CUDA's and NVML's orders may differ), so that a sweep does not count a host's idle GPUs;
// otherwise every visible one.
std::vector<int> ReportedGpus(const tandem::WorkerConfig& config, tandem::Nvml& nvml,
                              int gpus) {
  std::vector<int> reported = tandem::VisibleGpuIndices(std::getenv("CUDA_VISIBLE_DEVICES"), gpus);
#ifdef TANDEM_HAVE_CUDA
  if (config.backend == "cuda") {
    absl::StatusOr<std::string> uuid = tandem::CudaDeviceUuid(config.gpu);
    absl::StatusOr<int> index =
        uuid.ok() ? nvml.IndexOfUuid(*uuid) : absl::StatusOr<int>(uuid.status());
    if (index.ok()) return {*index};
    spdlog::warn("GPU metrics of every visible GPU: {}", index.status().ToString());
  }
#else
  (void)nvml;
#endif
  return reported;
}

void StartMonitoring(const tandem::WorkerConfig& config, Monitoring& m,
                     tandem::WorkerService& worker) {
  const std::string addr = config.metrics_address;
  if (addr.empty()) return;
  absl::StatusOr<std::unique_ptr<tandem::MetricsServer>> server =
      tandem::MetricsServer::Start(addr, m.registry);
  if (!server.ok()) {
    spdlog::error("--metrics_address: {}; serving without metrics", server.status().ToString());
    return;
  }
  m.server = *std::move(server);
  worker.set_metrics(&m.metrics);
  // Which precision this worker computes in: 1 on the series of its settings.
  prometheus::BuildGauge()
      .Name("tandem_worker_precision_info")
      .Help(
          "The worker's precision: backend, activation dtype, and linear-layer weights (fp8: "
          "quantized at load; as_stored: the checkpoint's, FP8 where it is an FP8 checkpoint); "
          "and the ranks (GPUs or threads) each layer is split over (--tensor_parallel)")
      .Register(*m.registry)
      .Add({{"backend", config.backend},
            {"dtype", config.backend == "cuda" ? config.dtype : std::string("f32")},
            {"weights",
             config.quantization.empty() ? std::string("as_stored") : config.quantization},
            {"tensor_parallel", std::to_string(config.tensor_parallel)}})
      .Set(1);
  std::printf("tandem-worker metrics on port %d\n", m.server->port());
  absl::StatusOr<std::unique_ptr<tandem::Nvml>> nvml = tandem::Nvml::Load();
  absl::StatusOr<int> gpus = nvml.ok() ? (*nvml)->DeviceCount() : absl::StatusOr<int>(0);
  if (!nvml.ok() || !gpus.ok() || *gpus == 0) {
    spdlog::info("no GPU metrics: {}", nvml.ok() ? "no GPU" : nvml.status().ToString());
    return;
  }
  std::vector<int> reported = ReportedGpus(config, **nvml, *gpus);
  m.gpu_sampler = std::make_unique<tandem::GpuSampler>(*std::move(nvml), std::move(reported),
                                                       m.gpu_metrics, absl::Milliseconds(500));
}

}  // namespace

int main(int argc, char** argv) {
  tandem::SetProgramUsage(
      "tandem-worker --coordinator HOST:PORT [--listen ADDR] [--backend cpu|cuda [--gpu N] "
      "[--dtype f16|bf16] [--transport auto|grpc|nccl]]");
  tandem::ParseFlags(argc, argv);
  tandem::WorkerConfig config;
  SetFromFlags(config);
  if (absl::Status s = tandem::ValidateWorkerConfig(config); !s.ok()) {
    spdlog::error("{}", std::string(s.message()));
    return 2;
  }
  absl::StatusOr<BackendChoice> backend = BackendFromFlags(config);
  if (!backend.ok()) {
    spdlog::error("{}", std::string(backend.status().message()));
    return 2;
  }
  const std::string launch_flag = config.launch_ahead;
  std::optional<tandem::WorkerService::LaunchAhead> launch_ahead;
  if (launch_flag == "auto") launch_ahead = tandem::WorkerService::LaunchAhead::kAuto;
  if (launch_flag == "always") launch_ahead = tandem::WorkerService::LaunchAhead::kAlways;
  if (launch_flag == "off") launch_ahead = tandem::WorkerService::LaunchAhead::kOff;
  if (!launch_ahead) {
    spdlog::error("--launch_ahead: '{}' (expected auto, always or off)", launch_flag);
    return 2;
  }
  absl::StatusOr<Access> access = AccessFromFlags(config);
  if (!access.ok()) {
    spdlog::error("{}", std::string(access.status().message()));
    return 2;
  }
  if (const std::string root = config.model_root;
      !root.empty() && !std::filesystem::is_directory(root)) {
    spdlog::error("--model_root: '{}' is not a folder", root);
    return 2;
  }

  tandem::ActivationInbox inbox;
  tandem::WorkerService worker(
      std::move(backend->backend), inbox, absl::Seconds(config.recv_timeout_s),
      {.transport = backend->transport, .peer_auth = access->cluster_auth});
  worker.set_access(access->callers, config.model_root);
  worker.set_launch_ahead(*launch_ahead);
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> step_trace(nullptr, &std::fclose);
  if (const std::string path = config.step_trace; !path.empty()) {
    step_trace.reset(std::fopen(path.c_str(), "a"));
    if (step_trace == nullptr) {
      spdlog::error("--step_trace: cannot open '{}' for appending", path);
      return 2;
    }
    std::setvbuf(step_trace.get(), nullptr, _IOLBF, 0);  // whole lines, even if killed
    worker.set_step_trace(step_trace.get());
  }
  tandem::StageLinkService link(inbox, access->callers);
  Monitoring monitoring;
  StartMonitoring(config, monitoring, worker);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(config.listen, access->server_credentials, &port);
  tandem::RefusePortSharing(builder);
  // The largest message is a step's activations on StageLink (AssignStage keeps steps within).
  builder.SetMaxReceiveMessageSize(static_cast<int>(tandem::kMaxStageMessageBytes));
  builder.RegisterService(&worker);
  builder.RegisterService(&link);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    spdlog::error("{}", tandem::CannotListenMessage("--listen", config.listen));
    return 2;
  }
  const std::string address = absl::StrCat(config.advertise_host, ":", port);
  std::printf("tandem-worker listening on port %d\n", port);
  std::fflush(stdout);
  spdlog::info("worker ({}, tensor parallel {}) serving on {}, coordinator {}", config.backend,
               config.tensor_parallel, address, config.coordinator);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  {
    tandem::Registrar registrar(config.coordinator, address,
                                config.backend, std::move(access->cluster_auth),
                                config.tensor_parallel);
    while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  spdlog::info("shutting down");
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  return 0;
}
