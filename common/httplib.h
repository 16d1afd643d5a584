// cpp-httplib (Debian's libcpp-httplib) as every tandem server and client uses it, and the one
// way tandem's HTTP servers bind their listening socket.
#pragma once

#include <httplib.h>  // IWYU pragma: export
#include <sys/socket.h>

#include <memory>
#include <string>

namespace tandem {

// Pending connections the kernel queues for accept(). Debian's compiled httplib listens with a
// backlog of 5: 64 clients connecting at once overflowed it (77 drops in one 384-request sweep),
// the dropped handshakes came back after 1 s (a TTFT p90 of 1 s) and some connections were reset.
// Linux caps it at net.core.somaxconn.
inline constexpr int kHttpListenBacklog = 1024;

// Binds `server` to host:port (port 0: a free port) with SO_REUSEADDR only (httplib's default
// adds SO_REUSEPORT, which would let two servers share a port instead of reporting the second as
// unavailable) and listens with kHttpListenBacklog. Returns the port bound, or -1.
inline int BindHttpServer(httplib::Server& server, const std::string& host, int port) {
  auto bound_socket = std::make_shared<socket_t>(INVALID_SOCKET);
  server.set_socket_options([bound_socket](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    *bound_socket = sock;
  });
  const int bound = port == 0 ? server.bind_to_any_port(host)
                              : (server.bind_to_port(host, port) ? port : -1);
  if (bound <= 0) return -1;
  // listen() again on the listening socket only changes its backlog.
  if (*bound_socket != INVALID_SOCKET) ::listen(*bound_socket, kHttpListenBacklog);
  return bound;
}

}  // namespace tandem
