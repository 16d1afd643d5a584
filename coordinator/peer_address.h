// Whether a worker's registration comes from the address it registers: a caller may only register
// where it itself runs, so that nobody can take over (or make look dead) another worker's address.
#pragma once

#include "absl/strings/string_view.h"

#include "absl/status/status.h"

namespace tandem {

// OK when `address` (host:port, host a name or an IP; IPv6 in brackets) is where the caller at
// `peer` (gRPC's ServerContext::peer(): "ipv4:10.0.0.5:41234", "ipv6:[::1]:5000", "unix:...")
// runs: the host resolves to the peer's IP, or the peer is on this machine (loopback, one of its
// interfaces' addresses, a Unix socket) and the host resolves to this machine too.
// PERMISSION_DENIED otherwise, naming both.
absl::Status CheckAddressMatchesPeer(absl::string_view address, absl::string_view peer);

}  // namespace tandem
