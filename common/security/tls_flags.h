// The --tls_cert, --tls_key and --tls_ca flags, defined once for every tandem program.
#pragma once

#include "common/security/credentials.h"

namespace tandem {

// The TLS files the command line names.
TlsFiles TlsFilesFromFlags();

}  // namespace tandem
