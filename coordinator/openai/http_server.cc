// Routes, the connection pool, and the small endpoints (models, tokenize, health, version).
#include "coordinator/openai/http_server.h"

#include "common/httplib.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/security/credentials.h"
#include "common/utf8.h"
#include "coordinator/openai/api_error.h"
#include "coordinator/openai/request_parsing.h"
#include "coordinator/openai/response_format.h"
#include "coordinator/request_stream.h"
#include "coordinator/request_validation.h"

#ifndef TANDEM_VERSION
#define TANDEM_VERSION "unknown"
#endif

namespace tandem::openai {
namespace {

using nlohmann::json;

void SetJson(httplib::Response& res, const json& body) {
  res.status = 200;
  res.set_content(JsonText(body), "application/json");
}

absl::StatusOr<json> JsonObject(const std::string& body) { return ParseJsonBody(body); }

// vLLM's POST /tokenize: {"prompt": text, "add_special_tokens": true} ->
// {"count", "max_model_len", "tokens"}.
void Tokenize(const Coordinator& c, const httplib::Request& req, httplib::Response& res) {
  absl::StatusOr<json> body = JsonObject(req.body);
  if (!body.ok()) return SetError(res, body.status());
  auto prompt = body->find("prompt");
  if (prompt == body->end()) return SetError(res, InvalidField("prompt", "is required"));
  if (!prompt->is_string()) return SetError(res, InvalidField("prompt", "must be a string"));
  auto special = body->find("add_special_tokens");
  if (special != body->end() && !special->is_null() && !special->is_boolean()) {
    return SetError(res, InvalidField("add_special_tokens", "must be a boolean"));
  }
  if (c.tokenizer() == nullptr) {
    return SetError(res, InvalidField("prompt", "this model has no tokenizer"));
  }
  absl::StatusOr<std::vector<int32_t>> ids = c.tokenizer()->Encode(prompt->get<std::string>());
  if (!ids.ok()) return SetError(res, InvalidField("prompt", ids.status().message()));
  SetJson(res, {{"count", ids->size()},
                {"max_model_len", c.limits().context_length},
                {"tokens", *ids}});
}

// vLLM's POST /detokenize: {"tokens": [ids]} -> {"prompt": text}.
void Detokenize(const Coordinator& c, const httplib::Request& req, httplib::Response& res) {
  absl::StatusOr<json> body = JsonObject(req.body);
  if (!body.ok()) return SetError(res, body.status());
  auto tokens = body->find("tokens");
  if (tokens == body->end()) return SetError(res, InvalidField("tokens", "is required"));
  if (!tokens->is_array()) return SetError(res, InvalidField("tokens", "must be a list of ids"));
  std::vector<int32_t> ids;
  for (size_t i = 0; i < tokens->size(); ++i) {
    const json& id = (*tokens)[i];
    const std::string param = absl::StrCat("tokens[", i, "]");
    if (!id.is_number_integer() && !id.is_number_unsigned()) {
      return SetError(res, InvalidField(param, "must be a token id (an integer)"));
    }
    const int64_t v = id.get<int64_t>();
    if (v < 0 || v >= c.limits().vocab_size) {
      return SetError(res, InvalidField(param, absl::StrCat(v, " is outside the vocabulary [0, ",
                                                            c.limits().vocab_size, ")")));
    }
    ids.push_back(static_cast<int32_t>(v));
  }
  if (c.tokenizer() == nullptr) {
    return SetError(res, InvalidField("tokens", "this model has no tokenizer"));
  }
  absl::StatusOr<std::string> text = c.tokenizer()->Decode(ids);
  if (!text.ok()) return SetError(res, InvalidFieldMessage("tokens", text.status().message()));
  SetJson(res, {{"prompt", ToValidUtf8(*text)}});
}

}  // namespace

HttpServer::HttpServer(Coordinator& c, const HttpServerOptions& options, ChatRenderer render_chat)
    : c_(c), options_(options), generation_(c, options.model_name, std::move(render_chat)) {}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(Coordinator& c,
                                                              const HttpServerOptions& options,
                                                              ChatRenderer render_chat) {
  const std::string& address = options.listen;
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("http_listen '", address, "': expected host:port"));
  }
  if (options.threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("http_threads: must be >= 0 (0: automatic), got ", options.threads));
  }
  std::unique_ptr<HttpServer> server(new HttpServer(c, options, std::move(render_chat)));
  if (!options.tls_cert.empty()) {
    auto https =
        std::make_unique<httplib::SSLServer>(options.tls_cert.c_str(), options.tls_key.c_str());
    if (!https->is_valid()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "http: --tls_cert '", options.tls_cert, "' and --tls_key '", options.tls_key,
          "': cannot load the certificate and its key (expected PEM files that match)"));
    }
    server->http_ = std::move(https);
  } else {
    server->http_ = std::make_unique<httplib::Server>();
  }
  const int threads = options.threads > 0 ? options.threads : RequestThreads(c.config());
  server->http_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  // Bodies beyond twice the largest legal request (JSON escapes included) get 413 unread.
  server->http_->set_payload_max_length(static_cast<size_t>(2 * MaxRequestBytes(c.limits())));
  server->Route();
  std::string host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  const int bound = BindHttpServer(*server->http_, host, port);
  if (bound <= 0) {
    return absl::UnavailableError(
        absl::StrCat("http_listen '", address, "': the address cannot be bound"));
  }
  server->port_ = bound;
  server->thread_ = std::thread([http = server->http_.get()] { http->listen_after_bind(); });
  // stop() only ends a server that is already listening: wait for it.
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!server->http_->is_running() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  return server;
}

HttpServer::~HttpServer() {
  if (http_) http_->stop();
  if (thread_.joinable()) thread_.join();
}

void HttpServer::Route() {
  httplib::Server& h = *http_;
  if (!options_.api_key.empty()) {
    // Before routing, so that no endpoint can forget the key. /health and /version stay open
    // for load balancers (as vLLM's do).
    h.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (req.path == "/health" || req.path == "/version") {
        return httplib::Server::HandlerResponse::Unhandled;
      }
      const CallerPolicy policy{.key = options_.api_key, .key_name = "api key"};
      absl::Status s = CheckBearer(req.get_header_value("Authorization"), policy);
      if (s.ok()) return httplib::Server::HandlerResponse::Unhandled;
      SetError(res, s);
      res.set_header("WWW-Authenticate", "Bearer");
      return httplib::Server::HandlerResponse::Handled;
    });
  }
  h.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    generation_.Handle(Endpoint::kCompletions, req, res);
  });
  h.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    generation_.Handle(Endpoint::kChat, req, res);
  });
  h.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    SetJson(res, {{"object", "list"},
                  {"data", json::array({{{"id", options_.model_name},
                                         {"object", "model"},
                                         {"created", absl::ToUnixSeconds(absl::Now())},
                                         {"owned_by", "tandem"},
                                         {"max_model_len", c_.limits().context_length},
                                         {"vocab_size", c_.limits().vocab_size}}})}});
  });
  h.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    Tokenize(c_, req, res);
  });
  h.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    Detokenize(c_, req, res);
  });
  h.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    // Readiness: a load balancer sends requests only where a pipeline serves.
    if (c_.GetTopology().pipelines_size() > 0) {
      res.status = 200;
    } else {
      SetError(res, absl::UnavailableError("no pipeline is serving: no (or too few) workers"));
    }
  });
  h.Get("/version", [](const httplib::Request&, httplib::Response& res) {
    SetJson(res, {{"version", TANDEM_VERSION}});
  });
  h.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    // Only when no handler wrote a body: unknown paths and methods.
    if (!res.body.empty() || res.status != 404) return;
    SetError(res, absl::NotFoundError(absl::StrCat("no endpoint ", req.method, " ", req.path)));
  });
}

}  // namespace tandem::openai
