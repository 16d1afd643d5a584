// tandem-coordinator's OpenAI-compatible HTTP front end, in process with the coordinator:
// /v1/models, /v1/models/{id}, /v1/completions, /v1/chat/completions, /v1/responses (with
// server-sent events), /tokenize (a prompt or chat messages), /detokenize, /health (readiness: 200
// only while a pipeline serves) and /version.
//
// Served by HttpDaemon (libmicrohttpd, http_daemon.h: deadlines, connection and size bounds,
// strict framing). Before a body is read, a request is checked for its API key (every endpoint
// but /health and /version), its endpoint (404) and, on the JSON endpoints, its Content-Type
// (application/json, else 415: a web page cannot post a "simple" cross-origin request).
//
// Threads: the daemon's event threads run the routes and submit generations; each submitted
// generation is followed on a thread of its own until it ends (GenerationHandler).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "coordinator/coordinator.h"
#include "coordinator/openai/generation_handler.h"
#include "coordinator/openai/http_daemon.h"
#include "coordinator/openai/tool_calls.h"

namespace tandem::openai {

struct HttpServerOptions {
  std::string listen;      // host:port; port 0 picks a free one
  std::string model_name;  // the id /v1/models lists and requests may name
  // How the model writes tool calls; kNone: chat requests with tools are refused.
  ToolCallFormat tool_format = ToolCallFormat::kNone;
  int threads = 4;         // event threads
  int max_connections = 4096;
  int header_timeout_s = 10;  // total, for a request's headers (HttpDaemonOptions)
  int body_timeout_s = 60;    // total, for its body
  // What every endpoint but /health and /version requires as `Authorization: Bearer <key>`
  // (401 with OpenAI's error body otherwise); empty: no key needed.
  std::string api_key;
  // PEM certificate chain and private key: HTTPS with them; empty: plain HTTP.
  std::string tls_cert;
  std::string tls_key;
};

class HttpServer {
 public:
  // INVALID_ARGUMENT for a malformed address or TLS files that cannot be loaded, UNAVAILABLE
  // when it cannot be bound.
  // `render_chat`: null when the model has no tokenizer.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(Coordinator& c,
                                                           const HttpServerOptions& options,
                                                           ChatRenderer render_chat);
  ~HttpServer();  // cancels the requests still followed, then stops the daemon
  int port() const { return port_; }

 private:
  HttpServer(Coordinator& c, const HttpServerOptions& options, ChatRenderer render_chat);
  // The refusal (401, 404, 415) for a request whose headers say it cannot be served.
  std::optional<HttpResponse> Check(const HttpRequest& head) const;
  void Route(const HttpRequest& req, std::shared_ptr<HttpExchange> exchange);

  Coordinator& c_;
  const HttpServerOptions options_;
  const ChatRenderer render_chat_;  // for /tokenize with messages
  GenerationHandler generation_;
  std::unique_ptr<HttpDaemon> http_;
  int port_ = 0;
};

}  // namespace tandem::openai
