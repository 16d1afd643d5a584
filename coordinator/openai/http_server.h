// tandem-coordinator's OpenAI-compatible HTTP front end (cpp-httplib), in process with the
// coordinator: /v1/models, /v1/completions, /v1/chat/completions (with server-sent events),
// /tokenize, /detokenize, /health (readiness: 200 only while a pipeline serves) and /version.
//
// Threads: one accept thread ("http-accept") and a fixed pool of `threads` connection threads.
// A connection holds its thread for as long as it is open (a stream for its whole generation, an
// idle keep-alive connection up to 5 s), so the pool is sized for every request the coordinator
// can hold at once (running slots plus the waiting queue) plus a margin; connections beyond it
// wait for a free thread.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "coordinator/coordinator.h"
#include "coordinator/openai/generation_handler.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace tandem::openai {

struct HttpServerOptions {
  std::string listen;      // host:port; port 0 picks a free one
  std::string model_name;  // the id /v1/models lists and requests may name
  int threads = 0;         // connection threads; 0: RequestThreads (coordinator/config.h)
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
  ~HttpServer();  // stops accepting, ends the streams' waits and joins the threads
  int port() const { return port_; }

 private:
  HttpServer(Coordinator& c, const HttpServerOptions& options, ChatRenderer render_chat);
  void Route();

  Coordinator& c_;
  const HttpServerOptions options_;
  const GenerationHandler generation_;
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace tandem::openai
