// Matching a registered host:port against the caller's IP (getaddrinfo for names, getifaddrs for
// this machine's own addresses).
#include "coordinator/peer_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace tandem {
namespace {

// An IP as its network-order bytes: 4 for IPv4 (IPv4-mapped IPv6 included), 16 for IPv6.
using Ip = std::string;

Ip FromSockaddr(const sockaddr* sa) {
  if (sa == nullptr) return "";
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    return Ip(reinterpret_cast<const char*>(&in->sin_addr), 4);
  }
  if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
      return Ip(reinterpret_cast<const char*>(&in6->sin6_addr) + 12, 4);
    }
    return Ip(reinterpret_cast<const char*>(&in6->sin6_addr), 16);
  }
  return "";
}

bool IsLoopback(const Ip& ip) {
  if (ip.size() == 4) return static_cast<unsigned char>(ip[0]) == 127;
  return ip == std::string(15, '\0') + '\1';
}

// Every address `host` resolves to (none when it does not resolve). `flags`: getaddrinfo's
// ai_flags (AI_NUMERICHOST: no name lookup).
std::vector<Ip> Resolve(const std::string& host, int flags = 0) {
  std::vector<Ip> ips;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_flags = flags;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return ips;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    if (Ip ip = FromSockaddr(a->ai_addr); !ip.empty()) ips.push_back(ip);
  }
  freeaddrinfo(res);
  return ips;
}

// Whether `ip` belongs to this machine: loopback or an address of one of its interfaces.
bool IsLocal(const Ip& ip) {
  if (IsLoopback(ip)) return true;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return false;
  bool local = false;
  for (ifaddrs* i = list; i != nullptr && !local; i = i->ifa_next) {
    local = FromSockaddr(i->ifa_addr) == ip;
  }
  freeifaddrs(list);
  return local;
}

// "a.b.c.d:port" or "[v6]:port" -> the host part without brackets; "" when malformed.
std::string HostOf(absl::string_view host_port) {
  const size_t colon = host_port.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) return "";
  absl::string_view host = host_port.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return std::string(host);
}

}  // namespace

absl::Status CheckAddressMatchesPeer(absl::string_view address, absl::string_view peer) {
  const std::string host = HostOf(address);
  if (host.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("address '", address, "': expected host:port"));
  }
  bool peer_local = false;
  Ip peer_ip;
  if (absl::StartsWith(peer, "unix:")) {
    peer_local = true;
  } else if (absl::StartsWith(peer, "ipv4:") || absl::StartsWith(peer, "ipv6:")) {
    std::string ip_text = HostOf(peer.substr(5));
    if (const size_t zone = ip_text.find('%'); zone != std::string::npos) ip_text.resize(zone);
    const std::vector<Ip> ips = Resolve(ip_text, AI_NUMERICHOST);
    if (!ips.empty()) peer_ip = ips.front();
    peer_local = !peer_ip.empty() && IsLocal(peer_ip);
  }
  const std::vector<Ip> resolved = Resolve(host);
  if (!peer_ip.empty() && std::find(resolved.begin(), resolved.end(), peer_ip) != resolved.end()) {
    return absl::OkStatus();
  }
  if (peer_local && std::any_of(resolved.begin(), resolved.end(), IsLocal)) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "address '", address, "' is not where the caller runs (peer ", peer,
      resolved.empty() ? "; the host does not resolve" : "",
      "): a worker registers its own address (the coordinator's --trust_worker_addresses "
      "turns this check off)"));
}

}  // namespace tandem
