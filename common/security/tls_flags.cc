// TLS flags shared by the coordinator, the worker, tandem-cli and tandem-loadgen.
#include "common/security/tls_flags.h"

#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain this process presents (as server, and as client for mutual TLS "
          "between cluster members); with --tls_key. Empty: no TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificate(s) that peers' certificates must chain to; on servers it turns on "
          "mutual TLS for cluster members. Empty on a client: the system's roots");

namespace tandem {

TlsFiles TlsFilesFromFlags() {
  return TlsFiles{.cert = absl::GetFlag(FLAGS_tls_cert),
                  .key = absl::GetFlag(FLAGS_tls_key),
                  .ca = absl::GetFlag(FLAGS_tls_ca)};
}

}  // namespace tandem
