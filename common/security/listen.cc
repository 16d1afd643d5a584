// Cluster listening sockets: loopback unless secured or told otherwise, never shared
// (common/security/listen.h).
#include "common/security/listen.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tandem {
namespace {

// The host of "host:port" or "[v6]:port" (brackets removed); the whole text without a port.
absl::string_view HostOf(absl::string_view address) {
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    return close == absl::string_view::npos ? address.substr(1) : address.substr(1, close - 1);
  }
  const size_t colon = address.rfind(':');
  return colon == absl::string_view::npos ? address : address.substr(0, colon);
}

absl::string_view PortOf(absl::string_view address) {
  const size_t colon = address.rfind(':');
  return colon == absl::string_view::npos ? absl::string_view() : address.substr(colon + 1);
}

}  // namespace

bool IsLoopbackAddress(absl::string_view address) {
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:")) {
    return true;
  }
  const absl::string_view host = HostOf(address);
  if (host == "localhost" || host == "::1") return true;
  // 127.0.0.0/8: four decimal octets, the first 127.
  const std::vector<absl::string_view> octets = absl::StrSplit(host, '.');
  if (octets.size() != 4 || octets[0] != "127") return false;
  for (absl::string_view o : octets) {
    int v = 0;
    if (!absl::SimpleAtoi(o, &v) || v < 0 || v > 255) return false;
  }
  return true;
}

absl::Status CheckClusterListen(absl::string_view flag, absl::string_view address,
                                const ClusterAccess& access) {
  if (IsLoopbackAddress(address) || access.has_secret || access.has_client_ca ||
      access.allow_insecure) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      flag, " ", address,
      ": other hosts can reach this address, and without a cluster secret any of them could "
      "join the cluster (register as a worker, send and receive prompts). Set --cluster_secret "
      "(or TANDEM_CLUSTER_SECRET) on the coordinator and every worker, or --tls_ca with "
      "--tls_cert and --tls_key; or listen on 127.0.0.1; or pass --allow_insecure if the "
      "network is trusted"));
}

void RefusePortSharing(grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
}

std::string CannotListenMessage(absl::string_view flag, absl::string_view address) {
  const absl::string_view port = PortOf(address);
  return absl::StrCat(flag, " ", address, ": cannot listen there: ",
                      port.empty() ? std::string("the address has no port")
                                   : absl::StrCat("port ", port,
                                                  " is taken by another process, or the host "
                                                  "is not one of this machine's addresses"),
                      "; choose a free port (port 0: any free one) or stop the process that "
                      "holds it");
}

}  // namespace tandem
