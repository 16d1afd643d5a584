// gRPC's SSL credentials from PEM files, a client interceptor that adds the bearer token, and the
// server-side check of a caller's token and certificate.
#include "common/security/credentials.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/support/client_interceptor.h"

namespace tandem {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  if (in) ss << in.rdbuf();
  if (!in || ss.str().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read '", path, "' (expected a PEM file)"));
  }
  return ss.str();
}

absl::Status CheckPair(const TlsFiles& tls) {
  if (tls.cert.empty() != tls.key.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert and --tls_key: give both (the certificate and its private key) or neither");
  }
  return absl::OkStatus();
}

// Adds `authorization: Bearer <key>` to every call of a channel.
class BearerInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(std::string header) : header_(std::move(header)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("authorization", header_);
    }
    methods->Proceed();
  }

 private:
  const std::string header_;
};

class BearerInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerInterceptorFactory(const std::string& key) : header_("Bearer " + key) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerInterceptor(header_);  // gRPC owns interceptors
  }

 private:
  const std::string header_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& tls, ClientCerts client_certs) {
  if (absl::Status s = CheckPair(tls); !s.ok()) return s;
  if (tls.cert.empty()) {
    if (!tls.ca.empty()) {
      return absl::InvalidArgumentError(
          "--tls_ca without --tls_cert and --tls_key: a TLS server needs its own certificate");
    }
    return grpc::InsecureServerCredentials();
  }
  absl::StatusOr<std::string> cert = ReadPem(tls.cert, "--tls_cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(tls.key, "--tls_key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  if (!tls.ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(tls.ca, "--tls_ca");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
    options.client_certificate_request =
        client_certs == ClientCerts::kRequired
            ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
            : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  options.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<ClientAuth> MakeClientAuth(const TlsFiles& tls, std::string key) {
  if (absl::Status s = CheckPair(tls); !s.ok()) return s;
  ClientAuth auth;
  auth.key = std::move(key);
  if (!tls.enabled()) return auth;
  grpc::SslCredentialsOptions options;
  if (!tls.ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(tls.ca, "--tls_ca");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
  }
  if (!tls.cert.empty()) {
    absl::StatusOr<std::string> cert = ReadPem(tls.cert, "--tls_cert");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> pem_key = ReadPem(tls.key, "--tls_key");
    if (!pem_key.ok()) return pem_key.status();
    options.pem_cert_chain = *cert;
    options.pem_private_key = *pem_key;
  }
  auth.credentials = grpc::SslCredentials(options);
  return auth;
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, const ClientAuth& auth,
                                           const grpc::ChannelArguments& args) {
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      auth.credentials != nullptr ? auth.credentials : grpc::InsecureChannelCredentials();
  if (auth.key.empty()) return grpc::CreateCustomChannel(target, credentials, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<BearerInterceptorFactory>(auth.key));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, credentials, args,
                                                                 std::move(interceptors));
}

absl::Status CheckBearer(std::string_view authorization, const CallerPolicy& policy) {
  if (policy.key.empty()) return absl::OkStatus();
  constexpr std::string_view kScheme = "bearer ";
  if (authorization.empty()) {
    return absl::UnauthenticatedError(absl::StrCat(
        "no ", policy.key_name, " given (expected the header authorization: Bearer <key>)"));
  }
  if (authorization.size() < kScheme.size() ||
      !absl::EqualsIgnoreCase(absl::string_view(authorization.data(), kScheme.size()),
                              absl::string_view(kScheme.data(), kScheme.size()))) {
    return absl::UnauthenticatedError(absl::StrCat(
        "authorization: expected 'Bearer <key>' carrying the ", policy.key_name));
  }
  const absl::string_view token = absl::StripAsciiWhitespace(absl::string_view(
      authorization.data() + kScheme.size(), authorization.size() - kScheme.size()));
  if (!ConstantTimeEquals(std::string_view(token.data(), token.size()), policy.key)) {
    return absl::UnauthenticatedError(absl::StrCat("invalid ", policy.key_name));
  }
  return absl::OkStatus();
}

grpc::Status CheckCaller(const grpc::ServerContext& ctx, const CallerPolicy& policy) {
  if (policy.require_client_cert) {
    std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
    if (auth == nullptr || !auth->IsPeerAuthenticated()) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "a client certificate signed by the cluster's CA is required");
    }
  }
  if (policy.key.empty()) return grpc::Status::OK;
  std::string_view authorization;
  const auto& metadata = ctx.client_metadata();
  if (auto it = metadata.find("authorization"); it != metadata.end()) {
    authorization = std::string_view(it->second.data(), it->second.size());
  }
  absl::Status s = CheckBearer(authorization, policy);
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(s.message()));
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  // Every byte of the longer string is visited and no branch depends on the contents.
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

std::string FlagOrEnv(const std::string& flag, const char* env) {
  if (!flag.empty()) return flag;
  const char* value = std::getenv(env);
  return value != nullptr ? std::string(value) : std::string();
}

}  // namespace tandem
