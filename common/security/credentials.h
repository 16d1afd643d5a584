// TLS and keys for tandem's gRPC servers and channels, both sides built from one set of settings.
//
// Three credentials guard the services: an API key for Inference (and the HTTP API), an admin key
// for Admin, and a cluster secret for what only cluster members call (Registry, Worker,
// StageLink). A key travels in every call's metadata as `authorization: Bearer <key>` (as vLLM's
// and OpenAI's API keys do). With a CA, cluster members also prove themselves by mutual TLS: a
// worker accepts only clients whose certificate the CA signed, and the coordinator's Registry
// only such workers.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace tandem {

// PEM file paths. cert + key: this process's certificate chain and private key (the server's,
// and the client's in mutual TLS); both or neither. ca: the roots that peers' certificates must
// chain to (empty on a client: the system's roots). No cert, key or ca: plain TCP.
struct TlsFiles {
  std::string cert;
  std::string key;
  std::string ca;
  bool enabled() const { return !cert.empty() || !ca.empty(); }
};

// Whether a TLS server with a CA asks its clients for certificates.
enum class ClientCerts {
  kVerifyIfPresented,  // clients without one connect (public services share the port)
  kRequired,           // the handshake fails without a certificate the CA signed
};

// TLS server credentials (insecure ones without cert and key). INVALID_ARGUMENT names the flag
// of a file that cannot be read or a ca without cert and key.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& tls, ClientCerts client_certs);

// How a client reaches a server: channel credentials and the key sent with every call.
struct ClientAuth {
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // null: plain TCP
  std::string key;                                        // empty: none sent
};

// TLS channel credentials from `tls` (plain TCP when it is empty), with `key` as the bearer
// token. INVALID_ARGUMENT names the flag of a file that cannot be read.
absl::StatusOr<ClientAuth> MakeClientAuth(const TlsFiles& tls, std::string key);

// A channel to `target` that presents `auth` on every call.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, const ClientAuth& auth,
                                           const grpc::ChannelArguments& args = {});

// Which callers a service accepts.
struct CallerPolicy {
  std::string key;                   // the bearer token callers present; empty: none needed
  bool require_client_cert = false;  // a client certificate verified against the server's CA
  std::string key_name;              // "api key", "admin key", "cluster secret" (messages)
};

// OK, or UNAUTHENTICATED saying what is missing (never what the key is).
grpc::Status CheckCaller(const grpc::ServerContext& ctx, const CallerPolicy& policy);
// The same check of an HTTP `Authorization` header value: OK or UNAUTHENTICATED.
absl::Status CheckBearer(std::string_view authorization, const CallerPolicy& policy);

// Equal strings, in a time that depends on their lengths only (not on where they differ).
bool ConstantTimeEquals(std::string_view a, std::string_view b);

// `flag` when set, else the environment variable `env` (keys stay out of `ps` that way), else "".
std::string FlagOrEnv(const std::string& flag, const char* env);

}  // namespace tandem
