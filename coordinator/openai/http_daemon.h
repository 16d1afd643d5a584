// The HTTP/1.1 server under the OpenAI-compatible API: libmicrohttpd on a few event-driven
// (epoll) threads, with the rules that keep it up under hostile clients, as nginx applies them:
//   - a total deadline for a request's headers (counted from the connection's start or the end of
//     the previous response, so it also bounds an idle keep-alive connection) and one for its body;
//   - a bound on open connections: beyond it a new connection is closed at once, not queued;
//   - headers bounded in size (431); a body bounded (413) whether it comes with Content-Length
//     (refused unread) or chunked (refused as soon as it passes the bound, never buffered whole);
//   - Transfer-Encoding together with Content-Length refused (400), codings other than chunked
//     refused (501), both closing the connection;
//   - keep-alive and pipelined requests answered in order; TCP_NODELAY on every connection.
//
// No event thread waits for an answer: a request whose handler does not answer at once is
// suspended until its HttpExchange is answered from another thread (whole, or as a stream of
// chunks that resume it as they come), and the exchange says when its client has gone.
//
// Threads: `threads` event threads (libmicrohttpd's, "MHD-...") and one that enforces the deadlines
// ("http-deadlines"); a handler runs on an event thread and must not block.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tandem::openai {

struct HttpRequest {
  std::string method;
  std::string path;                                          // without the query
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased, in order
  std::string body;
  // The value of header `name` (lower case), "" when absent.
  std::string Header(std::string_view name) const;
  bool HasHeader(std::string_view name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  bool close = false;  // close the connection after this response
};

// One request's answer, given once from any thread: whole (Respond), or as a stream (StartStream,
// then Write as often as needed, then End).
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;
  virtual void Respond(HttpResponse response) = 0;
  // `head`: status, type and headers; sent with the body as chunks.
  virtual void StartStream(HttpResponse head) = 0;
  // False once the client has gone (nothing more will be sent).
  virtual bool Write(std::string_view data) = 0;
  virtual void End() = 0;
  // Whether the client went away (closed its connection) or the server is stopping.
  virtual bool ClientGone() = 0;
};

// Everything the server was told about a request before its body: what the handler of that
// request will answer (a refusal) or nullopt to read the body and call the handler.
using HeadCheck = std::function<std::optional<HttpResponse>(const HttpRequest& head)>;
// Called on an event thread with the whole request; answers through the exchange, now or later.
using HttpHandler =
    std::function<void(const HttpRequest& request, std::shared_ptr<HttpExchange> exchange)>;
// The response for a refusal the server itself makes (413, 400, 501...), with its message.
using RefusalBody = std::function<HttpResponse(int status, std::string_view message)>;

struct HttpDaemonOptions {
  std::string host;  // an address or a name; "[::1]" style brackets allowed
  int port = 0;      // 0: a free one
  int threads = 4;   // event threads
  int max_connections = 4096;
  absl::Duration header_timeout = absl::Seconds(10);
  absl::Duration body_timeout = absl::Seconds(60);
  // Bytes of request line and headers; also sizes each connection's buffer (four times this).
  size_t max_header_bytes = 16 << 10;
  int64_t max_body_bytes = 8 << 20;
  // PEM text of a certificate chain and its key: HTTPS; empty: plain HTTP.
  std::string tls_cert_pem;
  std::string tls_key_pem;
};

class HttpDaemon {
 public:
  // INVALID_ARGUMENT for bad options or TLS material that cannot be used, UNAVAILABLE when the
  // address cannot be bound (also when another process listens on that port).
  static absl::StatusOr<std::unique_ptr<HttpDaemon>> Start(const HttpDaemonOptions& options,
                                                           HeadCheck check, HttpHandler handler,
                                                           RefusalBody refusal);
  // Ends every suspended exchange (their clients count as gone) and stops the threads. Callers
  // with work answering exchanges on other threads call AbandonAll and finish that work first.
  ~HttpDaemon();
  int port() const { return port_; }

  // Every exchange not yet answered now reports ClientGone.
  void AbandonAll();

  // Serves an already connected socket (takes it); for the fuzz target (a socketpair).
  absl::Status AddConnection(int fd);

  struct State;  // the daemon, its connections and exchanges (http_daemon.cc)

 private:
  explicit HttpDaemon(std::unique_ptr<State> state);

  std::unique_ptr<State> state_;
  int port_ = 0;
};

}  // namespace tandem::openai
