// tandem-coordinator: serves Inference, Admin, Registry, health and reflection on one port, and
// with --http_listen the OpenAI-compatible HTTP API on another.
// Settings come from --config (YAML) and are overridden by the flags given on the command line.
// Keys and TLS come from flags (keys also from the environment) only: they do not belong in a
// config file that is copied around.
#include <csignal>
#include <filesystem>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/flags_usage.h"
#include "coordinator/config.h"
#include "coordinator/coordinator.h"
#include "coordinator/grpc_services.h"
#include "coordinator/openai/http_api.h"
#include "common/metrics.h"
#include "common/security/credentials.h"
#include "common/security/listen.h"
#include "common/security/tls_flags.h"
#include "common/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, config, "",
          "YAML config file of the settings below (its keys are the flags' names); flags given "
          "on the command line override it");
// A flag per setting of CoordinatorConfig, with its default and help (coordinator/config.h).
TANDEM_DEFINE_SETTING_FLAGS(TANDEM_COORDINATOR_SETTINGS, tandem::CoordinatorConfig,
                            OverrideWithFlagsGiven)
ABSL_FLAG(std::string, metrics_address, "127.0.0.1:9464",
          "host:port serving Prometheus /metrics (0.0.0.0:PORT: every interface; port 0: any free "
          "port; empty: off)");
ABSL_FLAG(std::string, api_key, "",
          "key that Inference callers (and the HTTP API) present as 'authorization: Bearer KEY' "
          "(env TANDEM_API_KEY; empty: no key needed)");
ABSL_FLAG(std::string, admin_key, "",
          "key that Admin callers present as 'authorization: Bearer KEY' (env TANDEM_ADMIN_KEY; "
          "empty: the --api_key)");
ABSL_FLAG(std::string, cluster_secret, "",
          "secret shared with the workers: they present it to Registry, the coordinator to them "
          "(env TANDEM_CLUSTER_SECRET; empty: none; with --tls_ca, workers also need a "
          "certificate the CA signed)");
ABSL_FLAG(bool, allow_insecure, false,
          "serve --listen on an address other hosts reach without --cluster_secret or --tls_ca "
          "(any process that reaches the port can then register as a worker and receive "
          "prompts): for a network where every host is trusted");
ABSL_FLAG(bool, trust_worker_addresses, false,
          "accept a worker's registered address even where it is not the caller's own (NAT, "
          "proxies)");

namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }

// The settings: --config's file, then the flags given on the command line.
absl::StatusOr<tandem::CoordinatorConfig> LoadConfig() {
  tandem::CoordinatorConfig config;
  if (const std::string path = absl::GetFlag(FLAGS_config); !path.empty()) {
    absl::StatusOr<tandem::CoordinatorConfig> c = tandem::LoadCoordinatorConfig(path);
    if (!c.ok()) return absl::InvalidArgumentError(absl::StrCat("--config: ", c.status().message()));
    config = *c;
  }
  // A flag given on the command line overrides the config file, even with its default value.
  OverrideWithFlagsGiven(config);
  // Workers run in folders (and on nodes) of their own: a relative folder means this process's
  // working directory, so the workers are sent the absolute path.
  if (!config.model_dir.empty()) {
    config.model_dir = std::filesystem::absolute(config.model_dir).lexically_normal();
  }
  return config;
}

// Keys, TLS and the check that --listen is not open to other hosts without them.
struct Security {
  tandem::TlsFiles tls;
  std::string api_key, admin_key, cluster_secret;
  std::shared_ptr<grpc::ServerCredentials> server_credentials;
  tandem::ClientAuth worker_auth;
};

absl::StatusOr<Security> SecurityFromFlags(const tandem::CoordinatorConfig& config) {
  Security s;
  s.tls = tandem::TlsFilesFromFlags();
  s.api_key = tandem::FlagOrEnv(absl::GetFlag(FLAGS_api_key), "TANDEM_API_KEY");
  s.admin_key = tandem::FlagOrEnv(absl::GetFlag(FLAGS_admin_key), "TANDEM_ADMIN_KEY");
  if (s.admin_key.empty()) s.admin_key = s.api_key;
  s.cluster_secret =
      tandem::FlagOrEnv(absl::GetFlag(FLAGS_cluster_secret), "TANDEM_CLUSTER_SECRET");
  ASSIGN_OR_RETURN(s.server_credentials,
                   tandem::MakeServerCredentials(s.tls, tandem::ClientCerts::kVerifyIfPresented));
  ASSIGN_OR_RETURN(s.worker_auth, tandem::MakeClientAuth(s.tls, s.cluster_secret));
  RETURN_IF_ERROR(tandem::CheckClusterListen(
      "--listen", config.listen,
      {.has_secret = !s.cluster_secret.empty(),
       .has_client_ca = !s.tls.ca.empty(),
       .allow_insecure = absl::GetFlag(FLAGS_allow_insecure)}));
  if (s.cluster_secret.empty() && s.tls.ca.empty()) {
    spdlog::warn("no --cluster_secret or --tls_ca: any process that reaches {} can register as a "
                 "worker", config.listen);
  }
  if (s.api_key.empty()) spdlog::warn("no --api_key: Inference is open to every caller");
  return s;
}

// Metrics are an aid, not a requirement: a taken port is logged and the service runs on (null).
std::unique_ptr<tandem::MetricsServer> StartMetrics(
    std::shared_ptr<prometheus::Registry> registry) {
  const std::string addr = absl::GetFlag(FLAGS_metrics_address);
  if (addr.empty()) return nullptr;
  absl::StatusOr<std::unique_ptr<tandem::MetricsServer>> m =
      tandem::MetricsServer::Start(addr, std::move(registry));
  if (!m.ok()) {
    spdlog::error("--metrics_address: {}; serving without metrics", m.status().ToString());
    return nullptr;
  }
  std::printf("tandem-coordinator metrics on port %d\n", (*m)->port());
  return *std::move(m);
}

// The gRPC services on --listen, and the port bound (0 when nothing could be bound).
struct GrpcServices {
  GrpcServices(tandem::Coordinator& coordinator, const Security& security)
      : inference(coordinator, {.key = security.api_key, .key_name = "api key"}),
        admin(coordinator, {.key = security.admin_key, .key_name = "admin key"}),
        registry(coordinator,
                 {.key = security.cluster_secret,
                  .require_client_cert = !security.tls.ca.empty(),
                  .key_name = "cluster secret"},
                 absl::GetFlag(FLAGS_trust_worker_addresses)) {}
  tandem::InferenceService inference;
  tandem::AdminService admin;
  tandem::RegistryService registry;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

void StartGrpc(const tandem::CoordinatorConfig& config, const Security& security,
               tandem::Coordinator& coordinator, GrpcServices& services) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(config.listen, security.server_credentials, &services.port);
  tandem::RefusePortSharing(builder);
  // Sized from the largest legal request (prompt bytes, token ids, stop strings).
  builder.SetMaxReceiveMessageSize(static_cast<int>(
      std::min<int64_t>(tandem::MaxRequestBytes(coordinator.limits()), INT32_MAX)));
  // Idle threads are kept up to this many (gRPC's default: 2; CoordinatorConfig::grpc_threads).
  builder.SetSyncServerOption(
      grpc::ServerBuilder::SyncServerOption::MAX_POLLERS,
      config.grpc_threads > 0 ? config.grpc_threads : tandem::RequestThreads(config));
  builder.RegisterService(&services.inference);
  builder.RegisterService(&services.admin);
  builder.RegisterService(&services.registry);
  services.server = builder.BuildAndStart();
  if (services.server == nullptr) services.port = 0;
}

}  // namespace

int main(int argc, char** argv) {
  tandem::SetProgramUsage("tandem-coordinator --model_dir DIR [--config FILE] [--listen ADDR]");
  tandem::ParseFlags(argc, argv);
  absl::StatusOr<tandem::CoordinatorConfig> loaded = LoadConfig();
  if (!loaded.ok()) {
    spdlog::error("{}", std::string(loaded.status().message()));
    return 2;
  }
  const tandem::CoordinatorConfig& config = *loaded;
  absl::StatusOr<Security> security = SecurityFromFlags(config);
  if (!security.ok()) {
    spdlog::error("{}", std::string(security.status().message()));
    return 2;
  }
  absl::StatusOr<std::unique_ptr<tandem::Coordinator>> coordinator =
      tandem::Coordinator::Create(config);
  if (!coordinator.ok()) {
    spdlog::error("{}", coordinator.status().ToString());
    return 2;
  }
  auto metrics_registry = std::make_shared<prometheus::Registry>();
  tandem::CoordinatorMetrics metrics(*metrics_registry);
  // The KV-cache the stages are assigned: 1 on the series of its dtype.
  prometheus::BuildGauge()
      .Name("tandem_kv_cache_info")
      .Help("The KV-cache's element type the stages are assigned (--kv_cache_dtype: auto, the "
            "model's dtype as each backend computes it, or fp8_e4m3)")
      .Register(*metrics_registry)
      .Add({{"dtype", std::string(tandem::KvCacheDTypeName(
                          tandem::KvCacheDTypeOf((*coordinator)->config())))}})
      .Set(1);
  std::unique_ptr<tandem::MetricsServer> metrics_server = StartMetrics(metrics_registry);
  if (metrics_server != nullptr) (*coordinator)->set_metrics(&metrics);
  (*coordinator)->set_worker_auth(security->worker_auth);
  GrpcServices services(**coordinator, *security);
  StartGrpc(config, *security, **coordinator, services);
  if (services.port == 0) {
    spdlog::error("{}", tandem::CannotListenMessage("--listen", config.listen));
    return 2;
  }
  // Readiness per service: Inference is SERVING only while a pipeline serves; "" (the process)
  // stays SERVING while it is up, for liveness probes.
  grpc::HealthCheckServiceInterface* health = services.server->GetHealthCheckService();
  health->SetServingStatus(tandem::v1::Inference::service_full_name(), false);
  (*coordinator)->set_readiness_observer([health](bool serving) {
    health->SetServingStatus(tandem::v1::Inference::service_full_name(), serving);
  });
  (*coordinator)->Start();
  // A client that leaves mid-stream must fail the write, not kill the process.
  std::signal(SIGPIPE, SIG_IGN);
  std::unique_ptr<tandem::openai::HttpServer> http;
  if (!config.http_listen.empty()) {
    absl::StatusOr<std::unique_ptr<tandem::openai::HttpServer>> h =
        tandem::openai::StartHttpApi(**coordinator, security->api_key, security->tls);
    if (!h.ok()) {
      spdlog::error("{}", h.status().ToString());
      return 1;
    }
    http = *std::move(h);
    std::printf("tandem-coordinator http on port %d\n", http->port());
  }
  // The bound port on stdout (one line) lets scripts and tests use --listen=127.0.0.1:0.
  std::printf("tandem-coordinator listening on port %d\n", services.port);
  std::fflush(stdout);
  const tandem::CoordinatorConfig& resolved = (*coordinator)->config();
  spdlog::info(
      "coordinator serving {} on {} (port {}), waiting for {} x {} workers; KV-cache {} "
      "in {}",
      config.model_dir.string(), config.listen, services.port, config.stages, config.replicas,
      tandem::KvCacheDTypeName(tandem::KvCacheDTypeOf(resolved)),
      resolved.kv_page_size > 0 ? absl::StrCat("pages of ", resolved.kv_page_size, " tokens")
                                : std::string("contiguous slots"));

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  spdlog::info("shutting down");
  (*coordinator)->Shutdown();
  http.reset();
  services.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}
