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
#include "absl/flags/reflection.h"
#include "common/flags_usage.h"
#include "coordinator/config.h"
#include "coordinator/coordinator.h"
#include "coordinator/grpc_services.h"
#include "coordinator/openai/http_api.h"
#include "common/metrics.h"
#include "common/security/credentials.h"
#include "common/security/listen.h"
#include "common/security/tls_flags.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "spdlog/spdlog.h"

namespace {
// The flags' defaults are the config's: one place says them, --help shows them.
const tandem::CoordinatorConfig kDefaults;
}  // namespace

ABSL_FLAG(std::string, config, "",
          "YAML config file of the settings below (its keys are the flags' names); flags given "
          "on the command line override it");
ABSL_FLAG(std::string, listen, kDefaults.listen,
          "host:port of Inference, Admin and Registry (0.0.0.0:PORT: every interface, for "
          "workers on other hosts, with --cluster_secret, --tls_ca or --allow_insecure)");
ABSL_FLAG(std::string, model_dir, kDefaults.model_dir.string(), "Hugging Face checkpoint folder");
ABSL_FLAG(int, stages, kDefaults.stages, "pipeline stages per replica");
ABSL_FLAG(int, replicas, kDefaults.replicas, "data-parallel pipelines");
ABSL_FLAG(int, max_batch, kDefaults.max_batch, "sequences per step");
ABSL_FLAG(int, max_slots, kDefaults.max_slots, "KV-cache slots per pipeline");
ABSL_FLAG(int, max_seq_len, kDefaults.max_seq_len, "KV-cache positions per slot (0: model)");
ABSL_FLAG(int, micro_batches, kDefaults.micro_batches, "steps in flight per pipeline (0: stages)");
ABSL_FLAG(int, max_waiting, -1,
          "requests held beyond the KV slots, running or waiting; beyond them RESOURCE_EXHAUSTED "
          "(-1: as many as the slots of the replicas that decode, at least 128)");
ABSL_FLAG(int, prefill_chunk, kDefaults.prefill_chunk, "prompt tokens per sequence per step");
ABSL_FLAG(int, prefill_budget, kDefaults.prefill_budget,
          "prompt tokens per step across its sequences (0: no bound)");
ABSL_FLAG(bool, decode_ahead, kDefaults.decode_ahead,
          "send a sequence's next decode step while the step before runs (one-stage pipelines, "
          "and NCCL pipelines, whose first stage gets the last one's tokens over the link)");
ABSL_FLAG(double, decode_ahead_ms, kDefaults.decode_ahead_ms,
          "with --decode_ahead, a sequence goes as many steps ahead as fit in this much of its "
          "pipeline's measured step time (at least 1, at most 16)");
ABSL_FLAG(double, admission_quiet_ms, kDefaults.admission_quiet_ms,
          "new requests are admitted once neither has a request arrived nor a sequence ended for "
          "this long, and not while a quarter of a pipeline's sequences are about to end by "
          "length (at most --admission_wait_ms; at once when --max_batch wait), so that prompts "
          "arriving together share one prompt step (0: admitted at once)");
ABSL_FLAG(double, admission_wait_ms, kDefaults.admission_wait_ms,
          "the longest a new request is held back for others to arrive");
ABSL_FLAG(int, prefill_replicas, kDefaults.prefill_replicas,
          "replicas that run prompts only and hand each sequence's KV-cache to the other replicas, "
          "which decode (0: every replica does both)");
ABSL_FLAG(int, max_resumes, kDefaults.max_resumes,
          "times a running request whose pipeline is lost (a worker down) continues on another, "
          "its KV-cache recomputed, before it fails (0: fails at once)");
ABSL_FLAG(bool, move_kv, kDefaults.move_kv,
          "on a topology change, move running requests with their KV-cache to the new layout "
          "(false: let them finish on the old one, up to --drain_timeout_s)");
ABSL_FLAG(int, heartbeat_interval_ms, kDefaults.heartbeat_interval_ms, "worker heartbeat period");
ABSL_FLAG(int, heartbeat_timeout_ms, kDefaults.heartbeat_timeout_ms,
          "silence before a worker is declared down");
ABSL_FLAG(double, drain_timeout_s, kDefaults.drain_timeout_s, "topology change drain limit");
ABSL_FLAG(std::string, http_listen, kDefaults.http_listen,
          "host:port of the OpenAI-compatible HTTP API (port 0: any free port; empty: off)");
ABSL_FLAG(int, http_threads, kDefaults.http_threads,
          "HTTP event threads (epoll; each serves many connections; 0: 4)");
ABSL_FLAG(int, http_max_connections, kDefaults.http_max_connections,
          "open HTTP connections at most; beyond them a new one is closed at once");
ABSL_FLAG(int, http_header_timeout_s, kDefaults.http_header_timeout_s,
          "seconds a client has for a request's headers, counted from the connection's start or "
          "the previous response (so also an idle keep-alive connection's life)");
ABSL_FLAG(int, http_body_timeout_s, kDefaults.http_body_timeout_s,
          "seconds a client has for a request's body once its headers are in");
ABSL_FLAG(int, grpc_threads, kDefaults.grpc_threads,
          "threads the gRPC server keeps for request streams once they end, so that a burst of "
          "new ones does not wait for threads to be made (0: running slots + waiting queue + 8)");
ABSL_FLAG(std::string, served_model_name, kDefaults.served_model_name,
          "the model's id in the HTTP API (empty: the name of --model_dir)");
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

template <typename T, typename Field>
void Override(const absl::Flag<T>& flag, Field& field) {
  if (tandem::FlagGiven(absl::GetFlagReflectionHandle(flag).Name())) field = absl::GetFlag(flag);
}

}  // namespace

int main(int argc, char** argv) {
  tandem::SetProgramUsage("tandem-coordinator --model_dir DIR [--config FILE] [--listen ADDR]");
  tandem::ParseFlags(argc, argv);
  using tandem::CoordinatorConfig;
  CoordinatorConfig config;
  if (const std::string path = absl::GetFlag(FLAGS_config); !path.empty()) {
    absl::StatusOr<CoordinatorConfig> c = tandem::LoadCoordinatorConfig(path);
    if (!c.ok()) {
      spdlog::error("--config: {}", std::string(c.status().message()));
      return 2;
    }
    config = *c;
  }
  // A flag given on the command line overrides the config file, even with its default value.
  Override(FLAGS_listen, config.listen);
  Override(FLAGS_model_dir, config.model_dir);
  Override(FLAGS_stages, config.stages);
  Override(FLAGS_replicas, config.replicas);
  Override(FLAGS_max_batch, config.max_batch);
  Override(FLAGS_max_slots, config.max_slots);
  Override(FLAGS_max_seq_len, config.max_seq_len);
  Override(FLAGS_micro_batches, config.micro_batches);
  if (tandem::FlagGiven("max_waiting")) {
    const int v = absl::GetFlag(FLAGS_max_waiting);
    config.max_waiting = v < 0 ? std::nullopt : std::optional<int>(v);
  }
  Override(FLAGS_prefill_chunk, config.prefill_chunk);
  Override(FLAGS_prefill_budget, config.prefill_budget);
  Override(FLAGS_decode_ahead, config.decode_ahead);
  Override(FLAGS_decode_ahead_ms, config.decode_ahead_ms);
  Override(FLAGS_max_resumes, config.max_resumes);
  Override(FLAGS_admission_quiet_ms, config.admission_quiet_ms);
  Override(FLAGS_admission_wait_ms, config.admission_wait_ms);
  Override(FLAGS_prefill_replicas, config.prefill_replicas);
  Override(FLAGS_move_kv, config.move_kv);
  Override(FLAGS_heartbeat_interval_ms, config.heartbeat_interval_ms);
  Override(FLAGS_heartbeat_timeout_ms, config.heartbeat_timeout_ms);
  Override(FLAGS_drain_timeout_s, config.drain_timeout_s);
  Override(FLAGS_http_listen, config.http_listen);
  Override(FLAGS_http_threads, config.http_threads);
  Override(FLAGS_http_max_connections, config.http_max_connections);
  Override(FLAGS_http_header_timeout_s, config.http_header_timeout_s);
  Override(FLAGS_http_body_timeout_s, config.http_body_timeout_s);
  Override(FLAGS_grpc_threads, config.grpc_threads);
  Override(FLAGS_served_model_name, config.served_model_name);
  // Workers run in folders (and on nodes) of their own: a relative folder means this process's
  // working directory, so the workers are sent the absolute path.
  if (!config.model_dir.empty()) {
    config.model_dir = std::filesystem::absolute(config.model_dir).lexically_normal();
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

  if (absl::Status s =
          tandem::CheckClusterListen("--listen", config.listen,
                                     {.has_secret = !cluster_secret.empty(),
                                      .has_client_ca = !tls.ca.empty(),
                                      .allow_insecure = absl::GetFlag(FLAGS_allow_insecure)});
      !s.ok()) {
    spdlog::error("{}", std::string(s.message()));
    return 2;
  }
  if (cluster_secret.empty() && tls.ca.empty()) {
    spdlog::warn("no --cluster_secret or --tls_ca: any process that reaches {} can register as a "
                 "worker", config.listen);
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
  (*coordinator)->set_worker_auth(*std::move(worker_auth));
  tandem::InferenceService inference(**coordinator, {.key = api_key, .key_name = "api key"});
  tandem::AdminService admin(**coordinator, {.key = admin_key, .key_name = "admin key"});
  tandem::RegistryService registry(
      **coordinator,
      {.key = cluster_secret, .require_client_cert = !tls.ca.empty(), .key_name = "cluster secret"},
      absl::GetFlag(FLAGS_trust_worker_addresses));
  if (api_key.empty()) spdlog::warn("no --api_key: Inference is open to every caller");
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(config.listen, *server_credentials, &port);
  tandem::RefusePortSharing(builder);
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
    spdlog::error("{}", tandem::CannotListenMessage("--listen", config.listen));
    return 2;
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
