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
#include "absl/flags/parse.h"
#include "common/flags_usage.h"
#include "coordinator/config.h"
#include "coordinator/coordinator.h"
#include "coordinator/grpc_services.h"
#include "coordinator/openai/http_api.h"
#include "common/metrics.h"
#include "common/security/credentials.h"
#include "common/security/tls_flags.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, config, "", "YAML config file (optional)");
ABSL_FLAG(std::optional<std::string>, listen, std::nullopt, "host:port to serve on");
ABSL_FLAG(std::optional<std::string>, model_dir, std::nullopt, "Hugging Face checkpoint folder");
ABSL_FLAG(std::optional<int>, stages, std::nullopt, "pipeline stages per replica");
ABSL_FLAG(std::optional<int>, replicas, std::nullopt, "data-parallel pipelines");
ABSL_FLAG(std::optional<int>, max_batch, std::nullopt, "sequences per step");
ABSL_FLAG(std::optional<int>, max_slots, std::nullopt, "KV-cache slots per pipeline");
ABSL_FLAG(std::optional<int>, max_seq_len, std::nullopt, "KV-cache positions per slot (0: model)");
ABSL_FLAG(std::optional<int>, micro_batches, std::nullopt, "steps in flight per pipeline (0: stages)");
ABSL_FLAG(std::optional<int>, max_waiting, std::nullopt, "waiting queue bound");
ABSL_FLAG(std::optional<int>, prefill_chunk, std::nullopt, "prompt tokens per sequence per step");
ABSL_FLAG(std::optional<int>, prefill_budget, std::nullopt,
          "prompt tokens per step across its sequences (0: no bound)");
ABSL_FLAG(std::optional<bool>, decode_ahead, std::nullopt,
          "send a sequence's next decode step while the step before runs (one-stage pipelines, "
          "and NCCL pipelines, whose first stage gets the last one's tokens over the link)");
ABSL_FLAG(std::optional<double>, decode_ahead_ms, std::nullopt,
          "with --decode_ahead, a sequence goes as many steps ahead as fit in this much of its "
          "pipeline's measured step time (at least 1, at most 16; default 1)");
ABSL_FLAG(std::optional<double>, admission_quiet_ms, std::nullopt,
          "new requests are admitted once neither has a request arrived nor a sequence ended for "
          "this long, and not while a quarter of a pipeline's sequences are about to end by "
          "length (at most --admission_wait_ms; at once when --max_batch wait), so that prompts "
          "arriving together share one prompt step (default 0.5; 0: admitted at once)");
ABSL_FLAG(std::optional<double>, admission_wait_ms, std::nullopt,
          "the longest a new request is held back for others to arrive (default 20)");
ABSL_FLAG(std::optional<int>, prefill_replicas, std::nullopt,
          "replicas that run prompts only and hand each sequence's KV-cache to the other replicas, "
          "which decode (default 0: every replica does both)");
ABSL_FLAG(std::optional<int>, max_resumes, std::nullopt,
          "times a running request whose pipeline is lost (a worker down) continues on another, "
          "its KV-cache recomputed, before it fails (default 3; 0: fails at once)");
ABSL_FLAG(std::optional<bool>, move_kv, std::nullopt,
          "on a topology change, move running requests with their KV-cache to the new layout "
          "(default true; false: let them finish on the old one, up to --drain_timeout_s)");
ABSL_FLAG(std::optional<int>, heartbeat_interval_ms, std::nullopt,
          "worker heartbeat period (default 1000)");
ABSL_FLAG(std::optional<int>, heartbeat_timeout_ms, std::nullopt,
          "silence before a worker is declared down (default 10000)");
ABSL_FLAG(std::optional<double>, drain_timeout_s, std::nullopt, "topology change drain limit");
ABSL_FLAG(std::optional<std::string>, http_listen, std::nullopt,
          "host:port of the OpenAI-compatible HTTP API (port 0: any free port; unset: off)");
ABSL_FLAG(std::optional<int>, http_threads, std::nullopt,
          "HTTP event threads (epoll; each serves many connections; default 4, 0: 4)");
ABSL_FLAG(std::optional<int>, http_max_connections, std::nullopt,
          "open HTTP connections at most; beyond them a new one is closed at once (default 4096)");
ABSL_FLAG(std::optional<int>, http_header_timeout_s, std::nullopt,
          "seconds a client has for a request's headers, counted from the connection's start or "
          "the previous response (so also an idle keep-alive connection's life; default 10)");
ABSL_FLAG(std::optional<int>, http_body_timeout_s, std::nullopt,
          "seconds a client has for a request's body once its headers are in (default 60)");
ABSL_FLAG(std::optional<int>, grpc_threads, std::nullopt,
          "threads the gRPC server keeps for request streams once they end, so that a burst of "
          "new ones does not wait for threads to be made (0: running slots + waiting queue + 8)");
ABSL_FLAG(std::optional<std::string>, served_model_name, std::nullopt,
          "the model's id in the HTTP API (default: the name of --model_dir)");
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
ABSL_FLAG(bool, trust_worker_addresses, false,
          "accept a worker's registered address even where it is not the caller's own (NAT, "
          "proxies)");

namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }


}  // namespace

int main(int argc, char** argv) {
  tandem::SetProgramUsage("tandem-coordinator --model_dir DIR [--config FILE] [--listen ADDR]");
  absl::ParseCommandLine(argc, argv);
  using tandem::CoordinatorConfig;
  CoordinatorConfig config;
  if (const std::string path = absl::GetFlag(FLAGS_config); !path.empty()) {
    absl::StatusOr<CoordinatorConfig> c = tandem::LoadCoordinatorConfig(path);
    if (!c.ok()) {
      spdlog::error("{}", c.status().ToString());
      return 2;
    }
    config = *c;
  }
  if (auto v = absl::GetFlag(FLAGS_listen)) config.listen = *v;
  if (auto v = absl::GetFlag(FLAGS_model_dir)) config.model_dir = *v;
  if (auto v = absl::GetFlag(FLAGS_stages)) config.stages = *v;
  if (auto v = absl::GetFlag(FLAGS_replicas)) config.replicas = *v;
  if (auto v = absl::GetFlag(FLAGS_max_batch)) config.max_batch = *v;
  if (auto v = absl::GetFlag(FLAGS_max_slots)) config.max_slots = *v;
  if (auto v = absl::GetFlag(FLAGS_max_seq_len)) config.max_seq_len = *v;
  if (auto v = absl::GetFlag(FLAGS_micro_batches)) config.micro_batches = *v;
  if (auto v = absl::GetFlag(FLAGS_max_waiting)) config.max_waiting = *v;
  if (auto v = absl::GetFlag(FLAGS_prefill_chunk)) config.prefill_chunk = *v;
  if (auto v = absl::GetFlag(FLAGS_prefill_budget)) config.prefill_budget = *v;
  if (auto v = absl::GetFlag(FLAGS_decode_ahead)) config.decode_ahead = *v;
  if (auto v = absl::GetFlag(FLAGS_decode_ahead_ms)) config.decode_ahead_ms = *v;
  if (auto v = absl::GetFlag(FLAGS_max_resumes)) config.max_resumes = *v;
  if (auto v = absl::GetFlag(FLAGS_admission_quiet_ms)) config.admission_quiet_ms = *v;
  if (auto v = absl::GetFlag(FLAGS_admission_wait_ms)) config.admission_wait_ms = *v;
  if (auto v = absl::GetFlag(FLAGS_prefill_replicas)) config.prefill_replicas = *v;
  if (auto v = absl::GetFlag(FLAGS_move_kv)) config.move_kv = *v;
  if (auto v = absl::GetFlag(FLAGS_heartbeat_interval_ms)) config.heartbeat_interval_ms = *v;
  if (auto v = absl::GetFlag(FLAGS_heartbeat_timeout_ms)) config.heartbeat_timeout_ms = *v;
  if (auto v = absl::GetFlag(FLAGS_drain_timeout_s)) config.drain_timeout_s = *v;
  if (auto v = absl::GetFlag(FLAGS_http_listen)) config.http_listen = *v;
  if (auto v = absl::GetFlag(FLAGS_http_threads)) config.http_threads = *v;
  if (auto v = absl::GetFlag(FLAGS_http_max_connections)) config.http_max_connections = *v;
  if (auto v = absl::GetFlag(FLAGS_http_header_timeout_s)) config.http_header_timeout_s = *v;
  if (auto v = absl::GetFlag(FLAGS_http_body_timeout_s)) config.http_body_timeout_s = *v;
  if (auto v = absl::GetFlag(FLAGS_grpc_threads)) config.grpc_threads = *v;
  if (auto v = absl::GetFlag(FLAGS_served_model_name)) config.served_model_name = *v;
  // Workers run in folders (and on nodes) of their own: a relative folder means this process's
  // working directory, so the workers are sent the absolute path.
  if (!config.model_dir.empty()) {
    config.model_dir = std::filesystem::absolute(config.model_dir).lexically_normal();
  }

  absl::StatusOr<std::unique_ptr<tandem::Coordinator>> coordinator =
      tandem::Coordinator::Create(config);
  if (!coordinator.ok()) {
    spdlog::error("{}", coordinator.status().ToString());
    return 2;
  }
  // Metrics are an aid, not a requirement: a taken port is logged and the service runs on.
  auto metrics_registry = std::make_shared<prometheus::Registry>();
  tandem::CoordinatorMetrics metrics(*metrics_registry);
  std::unique_ptr<tandem::MetricsServer> metrics_server;
  if (const std::string addr = absl::GetFlag(FLAGS_metrics_address); !addr.empty()) {
    absl::StatusOr<std::unique_ptr<tandem::MetricsServer>> m =
        tandem::MetricsServer::Start(addr, metrics_registry);
    if (m.ok()) {
      metrics_server = *std::move(m);
      (*coordinator)->set_metrics(&metrics);
      std::printf("tandem-coordinator metrics on port %d\n", metrics_server->port());
    } else {
      spdlog::error("--metrics_address: {}; serving without metrics", m.status().ToString());
    }
  }
  const tandem::TlsFiles tls = tandem::TlsFilesFromFlags();
  const std::string api_key = tandem::FlagOrEnv(absl::GetFlag(FLAGS_api_key), "TANDEM_API_KEY");
  std::string admin_key = tandem::FlagOrEnv(absl::GetFlag(FLAGS_admin_key), "TANDEM_ADMIN_KEY");
  if (admin_key.empty()) admin_key = api_key;
  const std::string cluster_secret =
      tandem::FlagOrEnv(absl::GetFlag(FLAGS_cluster_secret), "TANDEM_CLUSTER_SECRET");
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server_credentials =
      tandem::MakeServerCredentials(tls, tandem::ClientCerts::kVerifyIfPresented);
  absl::StatusOr<tandem::ClientAuth> worker_auth = tandem::MakeClientAuth(tls, cluster_secret);
  if (!server_credentials.ok() || !worker_auth.ok()) {
    spdlog::error("{}", (server_credentials.ok() ? worker_auth.status()
                                                 : server_credentials.status()).ToString());
    return 2;
  }
  (*coordinator)->set_worker_auth(*std::move(worker_auth));
  tandem::InferenceService inference(**coordinator, {.key = api_key, .key_name = "api key"});
  tandem::AdminService admin(**coordinator, {.key = admin_key, .key_name = "admin key"});
  tandem::RegistryService registry(
      **coordinator,
      {.key = cluster_secret, .require_client_cert = !tls.ca.empty(), .key_name = "cluster secret"},
      absl::GetFlag(FLAGS_trust_worker_addresses));
  if (api_key.empty()) spdlog::warn("no --api_key: Inference is open to every caller");
  if (cluster_secret.empty() && tls.ca.empty()) {
    spdlog::warn("no --cluster_secret or --tls_ca: any process that reaches the port can "
                 "register as a worker");
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(config.listen, *server_credentials, &port);
  // Sized from the largest legal request (prompt bytes, token ids, stop strings).
  builder.SetMaxReceiveMessageSize(static_cast<int>(
      std::min<int64_t>(tandem::MaxRequestBytes((*coordinator)->limits()), INT32_MAX)));
  // Idle threads are kept up to this many (gRPC's default: 2; CoordinatorConfig::grpc_threads).
  builder.SetSyncServerOption(
      grpc::ServerBuilder::SyncServerOption::MAX_POLLERS,
      config.grpc_threads > 0 ? config.grpc_threads : tandem::RequestThreads(config));
  builder.RegisterService(&inference);
  builder.RegisterService(&admin);
  builder.RegisterService(&registry);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    spdlog::error("cannot listen on {}", config.listen);
    return 1;
  }
  // Readiness per service: Inference is SERVING only while a pipeline serves; "" (the process)
  // stays SERVING while it is up, for liveness probes.
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
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
        tandem::openai::StartHttpApi(**coordinator, api_key, tls);
    if (!h.ok()) {
      spdlog::error("{}", h.status().ToString());
      return 1;
    }
    http = *std::move(h);
    std::printf("tandem-coordinator http on port %d\n", http->port());
  }
  // The bound port on stdout (one line) lets scripts and tests use --listen=127.0.0.1:0.
  std::printf("tandem-coordinator listening on port %d\n", port);
  std::fflush(stdout);
  spdlog::info("coordinator serving {} on {} (port {}), waiting for {} x {} workers",
               config.model_dir.string(), config.listen, port, config.stages, config.replicas);

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  spdlog::info("shutting down");
  (*coordinator)->Shutdown();
  http.reset();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}
