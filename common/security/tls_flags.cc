// TLS flags shared by the coordinator, the worker, tandem-cli and tandem-loadgen.
#include "common/security/tls_flags.h"

#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain this process presents (as server, and as client for mutual TLS "
          "between cluster members); with --tls_key (env TANDEM_TLS_CERT). Empty: no TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert (env TANDEM_TLS_KEY)");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificate(s) that peers' certificates must chain to; on servers it turns on "
          "mutual TLS for cluster members (env TANDEM_TLS_CA). Empty on a client with TLS: the "
          "system's roots");

namespace tandem {

TlsFiles TlsFilesFromFlags() {
  return TlsFiles{.cert = FlagOrEnv(absl::GetFlag(FLAGS_tls_cert), "TANDEM_TLS_CERT"),
                  .key = FlagOrEnv(absl::GetFlag(FLAGS_tls_key), "TANDEM_TLS_KEY"),
                  .ca = FlagOrEnv(absl::GetFlag(FLAGS_tls_ca), "TANDEM_TLS_CA")};
}

}  // namespace tandem
