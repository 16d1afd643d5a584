// The cluster's gRPC listening sockets (the coordinator's and each worker's --listen): never
// shared with another process, and on an address other hosts reach only when callers prove they
// are cluster members, or the operator says that is not needed.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace tandem {

// Whether a gRPC listening address ("host:port", "[v6]:port", "unix:PATH") is reachable from this
// host only: 127.0.0.0/8, [::1], localhost or a unix socket. "0.0.0.0", "[::]", ":PORT" and every
// other host are not.
bool IsLoopbackAddress(absl::string_view address);

// How callers of a cluster port prove they are members.
struct ClusterAccess {
  bool has_secret = false;      // --cluster_secret (or TANDEM_CLUSTER_SECRET) is set
  bool has_client_ca = false;   // --tls_ca: callers need a certificate the CA signed
  bool allow_insecure = false;  // --allow_insecure: neither, on purpose
};

// OK when `address` (the value of `flag`) is loopback, or callers must prove membership, or
// insecure serving was asked for; else FAILED_PRECONDITION naming the address and the ways out.
absl::Status CheckClusterListen(absl::string_view flag, absl::string_view address,
                                const ClusterAccess& access);

// Turns SO_REUSEPORT off (gRPC turns it on): a port that another process holds then fails to
// bind instead of being shared with it, calls split between the two.
void RefusePortSharing(grpc::ServerBuilder& builder);

// What to say when BuildAndStart could not listen on `address` (the value of `flag`).
std::string CannotListenMessage(absl::string_view flag, absl::string_view address);

}  // namespace tandem
