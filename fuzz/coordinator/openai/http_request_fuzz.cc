// The HTTP server's raw request bytes (framing, headers, chunking, pipelining): any bytes on a
// connection to HttpDaemon (coordinator/openai/http_daemon.cc) with the limits the coordinator
// uses, scaled down, and handlers that answer at once or as a stream.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "coordinator/openai/http_daemon.h"
#include "spdlog/spdlog.h"

namespace {

using tandem::openai::HttpDaemon;
using tandem::openai::HttpExchange;
using tandem::openai::HttpRequest;
using tandem::openai::HttpResponse;

HttpResponse Text(int status, std::string body) {
  HttpResponse r;
  r.status = status;
  r.content_type = "text/plain";
  r.body = std::move(body);
  return r;
}

HttpDaemon& Daemon() {
  // The logger first: statics end in reverse order, so the daemon (whose threads log) stops
  // before the logger is destroyed at exit.
  spdlog::default_logger_raw();
  static std::unique_ptr<HttpDaemon> daemon = [] {
    absl::StatusOr<std::unique_ptr<HttpDaemon>> d = HttpDaemon::Start(
        {.host = "127.0.0.1",
         .port = 0,
         .threads = 1,
         .max_connections = 64,
         .header_timeout = absl::Seconds(2),
         .body_timeout = absl::Seconds(2),
         .max_header_bytes = 4096,
         .max_body_bytes = 4096,
         .tls_cert_pem = "",
         .tls_key_pem = ""},
        [](const HttpRequest& head) -> std::optional<HttpResponse> {
          if (head.path == "/refused") return Text(403, "refused");
          return std::nullopt;
        },
        [](const HttpRequest& req, std::shared_ptr<HttpExchange> ex) {
          if (req.path == "/stream") {
            ex->StartStream(Text(200, ""));
            ex->Write(req.body);
            ex->Write("data: [DONE]\n\n");
            ex->End();
            return;
          }
          ex->Respond(Text(200, req.method + " " + req.body));
        },
        [](int status, std::string_view message) { return Text(status, std::string(message)); });
    if (!d.ok()) std::abort();
    return *std::move(d);
  }();
  return *daemon;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  HttpDaemon& daemon = Daemon();
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) std::abort();
  if (!daemon.AddConnection(fds[0]).ok()) {
    close(fds[0]);
    close(fds[1]);
    return 0;
  }
  // Writes the input, reading answers all along so that neither side blocks, until the server
  // ends the connection or says nothing more for a moment once everything is written. A server
  // that stops reading without closing, or a sanitizer report, is a finding.
  size_t sent = 0;
  char buf[65536];
  for (;;) {
    const bool writing = sent < size;
    pollfd p{
        .fd = fds[1], .events = static_cast<short>(POLLIN | (writing ? POLLOUT : 0)), .revents = 0};
    const int ready = poll(&p, 1, writing ? 10000 : 200);
    if (ready <= 0) {
      if (writing) std::abort();  // the server stopped reading and did not close
      break;
    }
    if ((p.revents & POLLOUT) != 0 && writing) {
      const ssize_t n = send(fds[1], data + sent, size - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && errno != EAGAIN) break;
      if (n > 0) sent += static_cast<size_t>(n);
    }
    if ((p.revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
      const ssize_t n = recv(fds[1], buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN)) break;
    }
  }
  close(fds[1]);
  return 0;
}
