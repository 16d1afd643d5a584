// Routes, the checks made before a body is read, and the small endpoints (models, tokenize,
// health, version).
#include "coordinator/openai/http_server.h"

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/security/credentials.h"
#include "common/utf8.h"
#include "coordinator/openai/api_error.h"
#include "coordinator/openai/request_parsing.h"
#include "coordinator/openai/response_format.h"
#include "coordinator/openai/responses_api.h"
#include "coordinator/request_stream.h"
#include "coordinator/request_validation.h"

#ifndef TANDEM_VERSION
#define TANDEM_VERSION "unknown"
#endif

namespace tandem::openai {
namespace {

using nlohmann::json;

void SetJson(HttpResponse& res, const json& body) {
  res.status = 200;
  res.content_type = "application/json";
  res.body = JsonText(body);
}

absl::StatusOr<nlohmann::ordered_json> JsonObject(const std::string& body) {
  return ParseJsonBody(body);
}

// vLLM's POST /tokenize: {"prompt": text, "add_special_tokens": true} or {"messages": [...],
// "add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs",
// "add_special_tokens": false} -> {"count", "max_model_len", "tokens"}. Messages are rendered by
// the chat template exactly as a chat request's are; the special tokens the template writes (its
// BOS, its turn markers) are read as those tokens, and add_special_tokens adds the tokenizer's
// own around the text.
void Tokenize(const Coordinator& c, const std::string& model_name, const ChatRenderer& render_chat,
              const HttpRequest& req, HttpResponse& res) {
  absl::StatusOr<TokenizeRequest> r = ParseTokenizeRequest(req.body);
  if (!r.ok()) return SetError(res, r.status());
  if (const std::string& model = r->conversation.model; !model.empty() && model != model_name) {
    return SetError(res, absl::NotFoundError(absl::StrCat(
                             "model: '", model, "' is not served here; this server serves '",
                             model_name, "'")));
  }
  const std::string param = r->chat ? "messages" : "prompt";
  if (c.tokenizer() == nullptr) {
    return SetError(res, InvalidField(param, "this model has no tokenizer"));
  }
  std::string text = std::move(r->prompt);
  if (r->chat) {
    if (!render_chat) return SetError(res, InvalidField("messages", "this model cannot chat"));
    absl::StatusOr<std::string> rendered = render_chat(r->conversation);
    if (!rendered.ok()) return SetError(res, rendered.status());
    text = *std::move(rendered);
  }
  // Bounded as a generation's prompt is, before it is tokenized.
  if (absl::Status s = CheckPromptText(param, text, c.limits()); !s.ok()) {
    return SetError(res, InvalidFieldMessage(param, s.message()));
  }
  absl::StatusOr<std::vector<int32_t>> ids = c.tokenizer()->Encode(text, r->add_special_tokens);
  if (!ids.ok()) return SetError(res, InvalidField(param, ids.status().message()));
  SetJson(res, {{"count", ids->size()},
                {"max_model_len", c.limits().context_length},
                {"tokens", *ids}});
}

// vLLM's POST /detokenize: {"tokens": [ids]} -> {"prompt": text}.
void Detokenize(const Coordinator& c, const HttpRequest& req, HttpResponse& res) {
  absl::StatusOr<nlohmann::ordered_json> body = JsonObject(req.body);
  if (!body.ok()) return SetError(res, body.status());
  auto tokens = body->find("tokens");
  if (tokens == body->end()) return SetError(res, InvalidField("tokens", "is required"));
  if (!tokens->is_array()) return SetError(res, InvalidField("tokens", "must be a list of ids"));
  std::vector<int32_t> ids;
  for (size_t i = 0; i < tokens->size(); ++i) {
    const nlohmann::ordered_json& id = (*tokens)[i];
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

// Whether `content_type` is JSON: "application/json", parameters (charset) allowed.
bool IsJsonContentType(absl::string_view content_type) {
  const absl::string_view type = content_type.substr(0, content_type.find(';'));
  return absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(type), "application/json");
}

absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view flag) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  if (in) text << in.rdbuf();
  if (!in || text.str().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("http: ", flag, " '", path, "': cannot read it (expected a PEM file)"));
  }
  return text.str();
}

// The endpoints: method, path (a prefix when it ends with '/'), whether the body is JSON.
struct EndpointRule {
  std::string_view method;
  std::string_view path;
  bool json;
  bool Matches(std::string_view request_path) const {
    return path.back() == '/' ? request_path.starts_with(path) && request_path != path
                              : request_path == path;
  }
};
constexpr EndpointRule kEndpoints[] = {
    {"POST", "/v1/completions", true}, {"POST", "/v1/chat/completions", true},
    {"POST", "/v1/responses", true},
    {"GET", "/v1/models", false},      {"GET", "/v1/models/", false},
    {"POST", "/tokenize", true},
    {"POST", "/detokenize", true},     {"GET", "/health", false},
    {"GET", "/version", false},
};

HttpResponse Refusal(int status, std::string_view message) {
  HttpResponse r;
  r.status = status;
  r.body = JsonText({{"error",
                      {{"message", std::string(message)},
                       {"type", ErrorTypeOf(status)},
                       {"param", nullptr},
                       {"code", status}}}});
  return r;
}

}  // namespace

HttpServer::HttpServer(Coordinator& c, const HttpServerOptions& options, ChatRenderer render_chat)
    : c_(c),
      options_(options),
      render_chat_(render_chat),
      generation_(c, options.model_name, std::move(render_chat), options.tool_format) {}

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
  HttpDaemonOptions daemon{
      .host = address.substr(0, colon),
      .port = port,
      .threads = options.threads,
      .max_connections = options.max_connections,
      .header_timeout = absl::Seconds(options.header_timeout_s),
      .body_timeout = absl::Seconds(options.body_timeout_s),
      // Bodies beyond twice the largest legal request (JSON escapes included) get 413.
      .max_body_bytes = 2 * MaxRequestBytes(c.limits()),
      .tls_cert_pem = "",
      .tls_key_pem = "",
  };
  if (!options.tls_cert.empty()) {
    absl::StatusOr<std::string> cert = ReadPem(options.tls_cert, "--tls_cert");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPem(options.tls_key, "--tls_key");
    if (!key.ok()) return key.status();
    daemon.tls_cert_pem = *std::move(cert);
    daemon.tls_key_pem = *std::move(key);
  }
  std::unique_ptr<HttpServer> server(new HttpServer(c, options, std::move(render_chat)));
  HttpServer* s = server.get();
  absl::StatusOr<std::unique_ptr<HttpDaemon>> http = HttpDaemon::Start(
      daemon, [s](const HttpRequest& head) { return s->Check(head); },
      [s](const HttpRequest& req, std::shared_ptr<HttpExchange> exchange) {
        s->Route(req, std::move(exchange));
      },
      &Refusal);
  if (!http.ok()) {
    if (http.status().code() == absl::StatusCode::kUnavailable) {
      return absl::UnavailableError(absl::StrCat("http_listen '", address,
                                                 "': the address cannot be bound (",
                                                 http.status().message(), ")"));
    }
    if (!options.tls_cert.empty() && http.status().code() == absl::StatusCode::kInvalidArgument) {
      return absl::InvalidArgumentError(absl::StrCat(
          "http: --tls_cert '", options.tls_cert, "' and --tls_key '", options.tls_key,
          "': cannot load the certificate and its key (expected PEM files that match)"));
    }
    return http.status();
  }
  server->http_ = *std::move(http);
  server->port_ = server->http_->port();
  return server;
}

HttpServer::~HttpServer() {
  // Followers see their clients gone, cancel their requests and answer; then the daemon stops.
  if (http_) http_->AbandonAll();
  generation_.WaitForFollowers();
  http_.reset();
}

std::optional<HttpResponse> HttpServer::Check(const HttpRequest& head) const {
  // The key before routing, so that no endpoint can forget it. /health and /version stay open
  // for load balancers (as vLLM's do).
  if (!options_.api_key.empty() && head.path != "/health" && head.path != "/version") {
    const CallerPolicy policy{.key = options_.api_key, .key_name = "api key"};
    absl::Status s = CheckBearer(head.Header("authorization"), policy);
    if (!s.ok()) {
      HttpResponse res;
      SetError(res, s);
      res.headers.emplace_back("WWW-Authenticate", "Bearer");
      return res;
    }
  }
  // HEAD is answered as GET without its body.
  const std::string_view method =
      head.method == "HEAD" ? std::string_view("GET") : std::string_view(head.method);
  for (const EndpointRule& e : kEndpoints) {
    if (!e.Matches(head.path) || e.method != method) continue;
    if (e.json && !IsJsonContentType(head.Header("content-type"))) {
      return Refusal(415,
                     absl::StrCat("Content-Type '", head.Header("content-type"), "': ", head.path,
                                  " takes a JSON body (Content-Type: application/json)"));
    }
    return std::nullopt;
  }
  HttpResponse res;
  SetError(res, absl::NotFoundError(absl::StrCat("no endpoint ", head.method, " ", head.path)));
  return res;
}

void HttpServer::Route(const HttpRequest& req, std::shared_ptr<HttpExchange> exchange) {
  const std::string& path = req.path;
  if (path == "/v1/completions") return generation_.Handle(Endpoint::kCompletions, req, exchange);
  if (path == "/v1/chat/completions") return generation_.Handle(Endpoint::kChat, req, exchange);
  if (path == "/v1/responses") {
    return HandleResponses(generation_, options_.model_name, req, std::move(exchange));
  }
  HttpResponse res;
  const json model = {{"id", options_.model_name},
                      {"object", "model"},
                      {"created", absl::ToUnixSeconds(absl::Now())},
                      {"owned_by", "tandem"},
                      {"max_model_len", c_.limits().context_length},
                      {"vocab_size", c_.limits().vocab_size}};
  if (path == "/v1/models") {
    SetJson(res, {{"object", "list"}, {"data", json::array({model})}});
  } else if (absl::StartsWith(path, "/v1/models/")) {
    // The id may hold slashes ("org/name"); libmicrohttpd has decoded %2F already.
    const std::string id = path.substr(std::strlen("/v1/models/"));
    if (id == options_.model_name) {
      SetJson(res, model);
    } else {
      SetError(res, absl::NotFoundError(absl::StrCat("model: '", id,
                                                     "' is not served here; this server serves '",
                                                     options_.model_name, "'")));
    }
  } else if (path == "/tokenize") {
    Tokenize(c_, options_.model_name, render_chat_, req, res);
  } else if (path == "/detokenize") {
    Detokenize(c_, req, res);
  } else if (path == "/health") {
    // Readiness: a load balancer sends requests only where a pipeline serves.
    if (c_.GetTopology().pipelines_size() > 0) {
      res.status = 200;
      res.content_type.clear();
    } else {
      SetError(res, absl::UnavailableError("no pipeline is serving: no (or too few) workers"));
    }
  } else if (path == "/version") {
    SetJson(res, {{"version", TANDEM_VERSION}});
  }
  exchange->Respond(std::move(res));
}

}  // namespace tandem::openai
