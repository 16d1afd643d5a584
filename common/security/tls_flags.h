// The --tls_cert, --tls_key and --tls_ca flags, defined once for every tandem program, with the
// environment (TANDEM_TLS_CERT, TANDEM_TLS_KEY, TANDEM_TLS_CA) as their fallback.
#pragma once

#include "common/security/credentials.h"

namespace tandem {

// The TLS files the command line (else the environment) names.
TlsFiles TlsFilesFromFlags();

}  // namespace tandem
