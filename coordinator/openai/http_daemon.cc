// libmicrohttpd under the rules of http_daemon.h: framing checks when a request's headers are
// in, the body counted as it arrives, suspend/resume for answers made elsewhere, and a thread
// that closes connections past their header or body deadline.
#include "coordinator/openai/http_daemon.h"

#include <malloc.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstring>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace tandem::openai {

// Pending connections the kernel queues for accept() (Linux caps it at net.core.somaxconn).
constexpr int kListenBacklog = 1024;
// A body this large, once freed, is followed by malloc_trim: its pages go back to the system.
constexpr size_t kTrimAfterBytes = 1 << 20;
// A refused request's body is read and discarded up to this many times the body bound.
constexpr int64_t kDiscardFactor = 8;
// A stream whose client reads nothing while this much waits counts as gone.
constexpr size_t kMaxPendingStreamBytes = 64 << 20;

std::string HttpRequest::Header(std::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (k == name) return v;
  }
  return "";
}

bool HttpRequest::HasHeader(std::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (k == name) return true;
  }
  return false;
}

// What the deadline thread knows of a connection (its socket context).
struct Connection {
  enum Phase { kHeaders, kBody, kBusy, kClosing };
  int fd = -1;
  absl::Time since;  // the start of the phase
  Phase phase = kHeaders;
};

class Exchange;

struct HttpDaemon::State {
  HttpDaemonOptions options;
  HeadCheck check;
  HttpHandler handler;
  RefusalBody refusal;
  MHD_Daemon* daemon = nullptr;

  absl::Mutex mu;
  absl::flat_hash_set<Connection*> connections ABSL_GUARDED_BY(mu);
  absl::flat_hash_set<Exchange*> exchanges ABSL_GUARDED_BY(mu);  // dispatched, not completed
  bool abandoned ABSL_GUARDED_BY(mu) = false;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  std::thread deadlines;

  void SetPhase(MHD_Connection* connection, Connection::Phase phase) {
    const MHD_ConnectionInfo* info =
        MHD_get_connection_info(connection, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    if (info == nullptr || info->socket_context == nullptr) return;
    auto* c = static_cast<Connection*>(info->socket_context);
    absl::MutexLock lock(&mu);
    if (c->phase == Connection::kClosing) return;
    c->phase = phase;
    c->since = absl::Now();
  }

  // Closes (shutdown: the event thread sees the end and frees it) every connection past its
  // deadline, until the daemon stops.
  void EnforceDeadlines() {
    pthread_setname_np(pthread_self(), "http-deadlines");
    absl::MutexLock lock(&mu);
    while (!mu.AwaitWithTimeout(absl::Condition(&stopping), absl::Milliseconds(100))) {
      const absl::Time now = absl::Now();
      for (Connection* c : connections) {
        const bool late =
            (c->phase == Connection::kHeaders && now - c->since > options.header_timeout) ||
            (c->phase == Connection::kBody && now - c->since > options.body_timeout);
        if (!late) continue;
        ::shutdown(c->fd, SHUT_RDWR);
        c->phase = Connection::kClosing;
      }
    }
  }
};

namespace {

MHD_Response* MakeResponse(const HttpResponse& r) {
  MHD_Response* response = MHD_create_response_from_buffer(
      r.body.size(), const_cast<char*>(r.body.data()), MHD_RESPMEM_MUST_COPY);
  return response;
}

void AddHeaders(MHD_Response* response, const HttpResponse& r) {
  if (!r.content_type.empty()) {
    MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, r.content_type.c_str());
  }
  for (const auto& [k, v] : r.headers) MHD_add_response_header(response, k.c_str(), v.c_str());
  if (r.close) MHD_add_response_header(response, MHD_HTTP_HEADER_CONNECTION, "close");
}

}  // namespace

// One request's answer. The event thread holds it while it reads and dispatches the request; the
// handler's threads hold it until they answer; a stream's reader holds it while it sends.
class Exchange : public HttpExchange, public std::enable_shared_from_this<Exchange> {
 public:
  Exchange(HttpDaemon::State& daemon, MHD_Connection* connection, int fd)
      : daemon_(daemon), connection_(connection), fd_(fd) {}

  void Respond(HttpResponse response) override {
    absl::MutexLock lock(&mu_);
    if (response_.has_value()) return;
    response_ = std::move(response);
    ResumeLocked();
  }

  void StartStream(HttpResponse head) override {
    absl::MutexLock lock(&mu_);
    if (response_.has_value()) return;
    response_ = std::move(head);
    streaming_ = true;
    ResumeLocked();
  }

  bool Write(std::string_view data) override {
    absl::MutexLock lock(&mu_);
    if (closed_ || abandoned_ || ended_) return false;
    pending_.append(data);
    ResumeLocked();
    return true;
  }

  void End() override {
    absl::MutexLock lock(&mu_);
    ended_ = true;
    ResumeLocked();
  }

  bool ClientGone() override {
    absl::MutexLock lock(&mu_);
    if (closed_ || abandoned_) return true;
    if (pending_.size() > kMaxPendingStreamBytes) return true;
    // While suspended the event thread does not watch the socket: ask the kernel. The socket
    // stays open while the connection is suspended.
    if (suspended_ && fd_ >= 0) {
      pollfd p{.fd = fd_, .events = POLLRDHUP, .revents = 0};
      if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
        return true;
      }
    }
    return false;
  }

  // On the event thread once the request is read and dispatched (and after each resume): queues
  // the answer if there is one, else suspends the connection until there is.
  MHD_Result QueueOrSuspend() {
    absl::MutexLock lock(&mu_);
    if (!response_.has_value()) {
      Suspend();
      return MHD_YES;
    }
    if (queued_) return MHD_YES;
    queued_ = true;
    MHD_Response* response;
    if (streaming_) {
      auto* self = new std::shared_ptr<Exchange>(shared_from_this());
      response = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 << 10, &Exchange::Read,
                                                   self, &Exchange::FreeReader);
    } else {
      response = MakeResponse(*response_);
    }
    if (response == nullptr) return MHD_NO;
    AddHeaders(response, *response_);
    const MHD_Result queued =
        MHD_queue_response(connection_, static_cast<unsigned>(response_->status), response);
    MHD_destroy_response(response);
    if (!streaming_) response_->body = std::string();
    return queued;
  }

  // MHD_OPTION_NOTIFY_COMPLETED: the request ended (answered, or the connection closed).
  void Completed() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    pending_ = std::string();
  }

  void Abandon() {
    absl::MutexLock lock(&mu_);
    abandoned_ = true;
  }

  // At shutdown, after the handlers' threads are done: a request still without an answer gets
  // 503 so that no connection stays suspended.
  void Finish(const HttpResponse& unavailable) {
    absl::MutexLock lock(&mu_);
    if (!response_.has_value()) response_ = unavailable;
    ended_ = true;
    ResumeLocked();
  }

 private:
  void Suspend() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    suspended_ = true;
    MHD_suspend_connection(connection_);
  }

  void ResumeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!suspended_) return;
    suspended_ = false;
    MHD_resume_connection(connection_);
  }

  // MHD's content reader for a stream: what has been written, else suspend until more is.
  static ssize_t Read(void* cls, uint64_t, char* buf, size_t max) {
    Exchange& e = **static_cast<std::shared_ptr<Exchange>*>(cls);
    absl::MutexLock lock(&e.mu_);
    if (!e.pending_.empty()) {
      const size_t n = std::min(max, e.pending_.size());
      std::memcpy(buf, e.pending_.data(), n);
      e.pending_.erase(0, n);
      return static_cast<ssize_t>(n);
    }
    if (e.ended_) return MHD_CONTENT_READER_END_OF_STREAM;
    if (e.abandoned_) return MHD_CONTENT_READER_END_WITH_ERROR;
    e.Suspend();
    return 0;
  }

  static void FreeReader(void* cls) { delete static_cast<std::shared_ptr<Exchange>*>(cls); }

  HttpDaemon::State& daemon_;
  MHD_Connection* const connection_;
  const int fd_;
  absl::Mutex mu_;
  std::optional<HttpResponse> response_ ABSL_GUARDED_BY(mu_);
  bool streaming_ ABSL_GUARDED_BY(mu_) = false;
  bool queued_ ABSL_GUARDED_BY(mu_) = false;
  bool suspended_ ABSL_GUARDED_BY(mu_) = false;
  std::string pending_ ABSL_GUARDED_BY(mu_);  // stream bytes not yet sent
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool abandoned_ ABSL_GUARDED_BY(mu_) = false;
};

// A request being read: MHD's per-request context.
struct RequestContext {
  HttpRequest request;
  std::shared_ptr<Exchange> exchange;
  bool dispatched = false;
  bool refused = false;    // answered before its body was read: the body is discarded
  uint64_t discarded = 0;  // body bytes discarded
  size_t largest_body = 0;
};

namespace {

MHD_Result CollectHeader(void* cls, MHD_ValueKind, const char* key, size_t key_size,
                         const char* value, size_t value_size) {
  auto* headers = static_cast<std::vector<std::pair<std::string, std::string>>*>(cls);
  headers->emplace_back(absl::AsciiStrToLower(absl::string_view(key, key_size)),
                        value == nullptr ? std::string() : std::string(value, value_size));
  return MHD_YES;
}

int ConnectionFd(MHD_Connection* connection) {
  const MHD_ConnectionInfo* info =
      MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
  return info == nullptr ? -1 : info->connect_fd;
}

// Queues `response` now; MHD discards what is left of the body and closes the connection.
MHD_Result QueueNow(MHD_Connection* connection, HttpResponse response) {
  MHD_Response* r = MakeResponse(response);
  if (r == nullptr) return MHD_NO;
  AddHeaders(r, response);
  const MHD_Result queued =
      MHD_queue_response(connection, static_cast<unsigned>(response.status), r);
  MHD_destroy_response(r);
  return queued;
}

// The framing rules checked once the headers are in: a refusal, or nullopt.
std::optional<HttpResponse> CheckFraming(const HttpRequest& head, int64_t max_body,
                                         const RefusalBody& refusal) {
  const bool has_length = head.HasHeader("content-length");
  int lengths = 0, codings = 0;
  for (const auto& [k, v] : head.headers) {
    lengths += k == "content-length";
    codings += k == "transfer-encoding";
  }
  auto refuse = [&](int status, std::string_view message) {
    HttpResponse r = refusal(status, message);
    r.close = true;
    return r;
  };
  if (codings > 0 && has_length) {
    return refuse(400,
                  "a request must not carry both Transfer-Encoding and Content-Length; send one");
  }
  if (codings > 1) return refuse(400, "Transfer-Encoding: give it once (chunked)");
  if (codings == 1) {
    const std::string coding =
        absl::AsciiStrToLower(absl::StripAsciiWhitespace(head.Header("transfer-encoding")));
    if (coding != "chunked") {
      return refuse(501, absl::StrCat("Transfer-Encoding '", head.Header("transfer-encoding"),
                                      "' is not supported; send the body as is or chunked"));
    }
  }
  if (lengths > 1) return refuse(400, "Content-Length: give it once");
  if (has_length) {
    const std::string text(absl::StripAsciiWhitespace(head.Header("content-length")));
    uint64_t length = 0;
    if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos ||
        !absl::SimpleAtoi(text, &length)) {
      return refuse(400, absl::StrCat("Content-Length '", text, "' is not a number of bytes"));
    }
    if (length > static_cast<uint64_t>(max_body)) {
      return refuse(413, absl::StrCat("the request body (", length, " bytes) is larger than the ",
                                      max_body, " bytes this server accepts"));
    }
  }
  return std::nullopt;
}

bool HasBody(const HttpRequest& head) {
  if (head.HasHeader("transfer-encoding")) return true;
  const std::string length = head.Header("content-length");
  return !length.empty() && length != "0";
}

MHD_Result OnAccess(void* cls, MHD_Connection* connection, const char* url, const char* method,
                    const char*, const char* upload_data, size_t* upload_data_size,
                    void** request_context) {
  auto& d = *static_cast<HttpDaemon::State*>(cls);
  auto* ctx = static_cast<RequestContext*>(*request_context);
  if (ctx == nullptr) {
    // The headers are in.
    ctx = new RequestContext;
    *request_context = ctx;
    ctx->request.method = method;
    ctx->request.path = url;
    MHD_get_connection_values_n(connection, MHD_HEADER_KIND, &CollectHeader, &ctx->request.headers);
    ctx->exchange = std::make_shared<Exchange>(d, connection, ConnectionFd(connection));
    d.SetPhase(connection, Connection::kBody);
    std::optional<HttpResponse> refusal =
        CheckFraming(ctx->request, d.options.max_body_bytes, d.refusal);
    if (!refusal.has_value()) refusal = d.check(ctx->request);
    if (refusal.has_value()) {
      ctx->refused = true;
      if (HasBody(ctx->request)) {
        // Framing that cannot be trusted, a client waiting for "100 Continue" (it sends
        // nothing more) or a body far past the bound: answered now, the body unread and the
        // connection closed. Otherwise, as nginx's lingering close: the body is read and
        // discarded (bounded, and within the body deadline), then answered and closed, so that
        // a client that writes its whole body before it reads gets the answer.
        const bool framing = refusal->status == 400 || refusal->status == 501;
        const bool expects_continue =
            absl::EqualsIgnoreCase(ctx->request.Header("expect"), "100-continue");
        uint64_t length = 0;
        const bool far = absl::SimpleAtoi(ctx->request.Header("content-length"), &length) &&
                         length > static_cast<uint64_t>(kDiscardFactor * d.options.max_body_bytes);
        refusal->close = true;
        if (framing || expects_continue || far) return QueueNow(connection, *refusal);
      }
      ctx->exchange->Respond(*std::move(refusal));
    }
    return MHD_YES;
  }
  if (*upload_data_size > 0) {
    std::string& body = ctx->request.body;
    if (ctx->refused) {
      // Discarded; a body far past the bound ends the connection.
      ctx->discarded += *upload_data_size;
      *upload_data_size = 0;
      return ctx->discarded > static_cast<uint64_t>(kDiscardFactor * d.options.max_body_bytes)
                 ? MHD_NO
                 : MHD_YES;
    }
    if (body.size() + *upload_data_size > static_cast<size_t>(d.options.max_body_bytes)) {
      // A chunked body past the bound: refused now, the rest unread. libmicrohttpd cannot queue
      // an answer while it hands over a body, and nothing has been sent for this request yet
      // (earlier ones on the connection are answered in full before it is read), so the 413
      // is written to the socket as is and the connection closed (over TLS: only closed).
      ctx->refused = true;
      ctx->largest_body = std::max(ctx->largest_body, body.capacity());
      body = std::string();
      if (d.options.tls_cert_pem.empty()) {
        const HttpResponse r =
            d.refusal(413, absl::StrCat("the request body is larger than the ",
                                        d.options.max_body_bytes, " bytes this server accepts"));
        const std::string bytes = absl::StrCat(
            "HTTP/1.1 413 Content Too Large\r\nConnection: close\r\nContent-Type: ", r.content_type,
            "\r\nContent-Length: ", r.body.size(), "\r\n\r\n", r.body);
        ::send(ConnectionFd(connection), bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      }
      return MHD_NO;
    }
    body.append(upload_data, *upload_data_size);
    *upload_data_size = 0;
    return MHD_YES;
  }
  if (!ctx->dispatched) {
    // The whole request is in.
    ctx->dispatched = true;
    d.SetPhase(connection, Connection::kBusy);
    ctx->largest_body = std::max(ctx->largest_body, ctx->request.body.capacity());
    bool abandoned;
    {
      absl::MutexLock lock(&d.mu);
      d.exchanges.insert(ctx->exchange.get());
      abandoned = d.abandoned;
    }
    if (abandoned) ctx->exchange->Abandon();
    if (!ctx->refused) d.handler(ctx->request, ctx->exchange);
    ctx->request.body = std::string();
  }
  return ctx->exchange->QueueOrSuspend();
}

void OnCompleted(void* cls, MHD_Connection* connection, void** request_context,
                 MHD_RequestTerminationCode) {
  auto& d = *static_cast<HttpDaemon::State*>(cls);
  auto* ctx = static_cast<RequestContext*>(*request_context);
  *request_context = nullptr;
  d.SetPhase(connection, Connection::kHeaders);  // the next request's headers, if any
  if (ctx == nullptr) return;
  ctx->exchange->Completed();
  {
    absl::MutexLock lock(&d.mu);
    d.exchanges.erase(ctx->exchange.get());
  }
  const size_t largest = std::max(ctx->largest_body, ctx->request.body.capacity());
  delete ctx;
  if (largest >= kTrimAfterBytes) malloc_trim(0);
}

void OnConnection(void* cls, MHD_Connection* connection, void** socket_context,
                  MHD_ConnectionNotificationCode event) {
  auto& d = *static_cast<HttpDaemon::State*>(cls);
  if (event == MHD_CONNECTION_NOTIFY_STARTED) {
    auto* c = new Connection{.fd = ConnectionFd(connection), .since = absl::Now()};
    // Answers go out at once, not held back for the client's delayed ACK (Nagle).
    int yes = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof(yes));
    *socket_context = c;
    absl::MutexLock lock(&d.mu);
    if (static_cast<int>(d.connections.size()) >= d.options.max_connections) {
      // Past the bound: closed at once (libmicrohttpd's own bound is split between its threads).
      ::shutdown(c->fd, SHUT_RDWR);
      c->phase = Connection::kClosing;
    }
    d.connections.insert(c);
    return;
  }
  auto* c = static_cast<Connection*>(*socket_context);
  if (c == nullptr) return;
  *socket_context = nullptr;
  {
    absl::MutexLock lock(&d.mu);
    d.connections.erase(c);
  }
  delete c;
}

void LogMhd(void*, const char* format, va_list ap) {
  char text[512];
  std::vsnprintf(text, sizeof(text), format, ap);
  std::string_view line(text);
  while (!line.empty() && line.back() == '\n') line.remove_suffix(1);
  spdlog::debug("http: {}", line);
}

// A listening socket without SO_REUSEPORT (a second server on the port fails to bind).
absl::StatusOr<int> Listen(std::string host, int port) {
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc =
          getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
      rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  std::string why = "no address";
  int fd = -1;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof(yes));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, kListenBacklog) == 0) break;
    why = std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  freeaddrinfo(found);
  if (fd < 0) return absl::UnavailableError(why);
  return fd;
}

// Open connections need descriptors: the soft limit is raised toward the hard one.
void RaiseDescriptorLimit(int connections) {
  rlimit l{};
  if (getrlimit(RLIMIT_NOFILE, &l) != 0) return;
  const rlim_t want = static_cast<rlim_t>(connections) + 1024;
  if (l.rlim_cur >= want) return;
  l.rlim_cur = l.rlim_max == RLIM_INFINITY ? want : std::min(want, l.rlim_max);
  setrlimit(RLIMIT_NOFILE, &l);
  if (l.rlim_cur < want) {
    spdlog::warn("http: {} open files allowed (ulimit -n); {} connections need about {}",
                 l.rlim_cur, connections, want);
  }
}

}  // namespace

HttpDaemon::HttpDaemon(std::unique_ptr<State> state) : state_(std::move(state)) {}

absl::StatusOr<std::unique_ptr<HttpDaemon>> HttpDaemon::Start(const HttpDaemonOptions& options,
                                                              HeadCheck check, HttpHandler handler,
                                                              RefusalBody refusal) {
  if (options.threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("http_threads: must be >= 1, got ", options.threads));
  }
  if (options.max_connections < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("http_max_connections: must be >= 1, got ", options.max_connections));
  }
  if (options.header_timeout < absl::Seconds(1) || options.body_timeout < absl::Seconds(1)) {
    return absl::InvalidArgumentError(
        "http_header_timeout_s and http_body_timeout_s: must be >= 1");
  }
  const bool tls = !options.tls_cert_pem.empty();
  if (tls && MHD_is_feature_supported(MHD_FEATURE_TLS) != MHD_YES) {
    return absl::InvalidArgumentError("this libmicrohttpd was built without TLS");
  }
  auto state = std::make_unique<State>();
  state->options = options;
  state->check = std::move(check);
  state->handler = std::move(handler);
  state->refusal = std::move(refusal);
  absl::StatusOr<int> fd = Listen(options.host, options.port);
  if (!fd.ok()) return fd.status();
  sockaddr_storage bound{};
  socklen_t bound_size = sizeof(bound);
  getsockname(*fd, reinterpret_cast<sockaddr*>(&bound), &bound_size);
  const int port = bound.ss_family == AF_INET6
                       ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                       : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  RaiseDescriptorLimit(options.max_connections);
  // A large request's buffers (its body, its parsed JSON, its token ids) are mapped and unmapped
  // on their own: glibc's threshold would otherwise rise after the first such free, and later
  // ones would stay in the event threads' arenas after they are freed.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);

  const auto seconds = [](absl::Duration d) {
    return static_cast<intptr_t>(absl::ToInt64Seconds(d));
  };
  std::vector<MHD_OptionItem> items = {
      {MHD_OPTION_LISTEN_SOCKET, *fd, nullptr},
      // Each event thread may hold them all; OnConnection enforces the bound over all threads.
      {MHD_OPTION_CONNECTION_LIMIT, options.max_connections * options.threads, nullptr},
      // Inactivity: a client that stops reading a response (the deadlines cover requests).
      {MHD_OPTION_CONNECTION_TIMEOUT, seconds(options.body_timeout), nullptr},
      {MHD_OPTION_CONNECTION_MEMORY_LIMIT, static_cast<intptr_t>(4 * options.max_header_bytes),
       nullptr},
      {MHD_OPTION_NOTIFY_COMPLETED, reinterpret_cast<intptr_t>(&OnCompleted), state.get()},
      {MHD_OPTION_NOTIFY_CONNECTION, reinterpret_cast<intptr_t>(&OnConnection), state.get()},
      {MHD_OPTION_EXTERNAL_LOGGER, reinterpret_cast<intptr_t>(&LogMhd), nullptr},
  };
  if (options.threads > 1) {
    items.push_back({MHD_OPTION_THREAD_POOL_SIZE, options.threads, nullptr});
  }
  if (tls) {
    items.push_back(
        {MHD_OPTION_HTTPS_MEM_CERT, 0, const_cast<char*>(options.tls_cert_pem.c_str())});
    items.push_back({MHD_OPTION_HTTPS_MEM_KEY, 0, const_cast<char*>(options.tls_key_pem.c_str())});
  }
  items.push_back({MHD_OPTION_END, 0, nullptr});
  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME |
                   MHD_USE_ERROR_LOG;
  if (tls) flags |= MHD_USE_TLS;
  state->daemon = MHD_start_daemon(flags, 0, nullptr, nullptr, &OnAccess, state.get(),
                                   MHD_OPTION_ARRAY, items.data(), MHD_OPTION_END);
  if (state->daemon == nullptr) {
    ::close(*fd);
    if (tls) {
      return absl::InvalidArgumentError(
          "the TLS certificate and key cannot be used (expected PEM files that match)");
    }
    return absl::InternalError("libmicrohttpd did not start (see the log)");
  }
  state->deadlines = std::thread([s = state.get()] { s->EnforceDeadlines(); });
  std::unique_ptr<HttpDaemon> daemon(new HttpDaemon(std::move(state)));
  daemon->port_ = port;
  return daemon;
}

void HttpDaemon::AbandonAll() {
  absl::MutexLock lock(&state_->mu);
  state_->abandoned = true;
  for (Exchange* e : state_->exchanges) e->Abandon();
}

HttpDaemon::~HttpDaemon() {
  AbandonAll();
  {
    // No connection may stay suspended when the daemon stops.
    const HttpResponse unavailable = state_->refusal(503, "the server is stopping");
    absl::MutexLock lock(&state_->mu);
    for (Exchange* e : state_->exchanges) e->Finish(unavailable);
  }
  {
    absl::MutexLock lock(&state_->mu);
    state_->stopping = true;
  }
  if (state_->deadlines.joinable()) state_->deadlines.join();
  MHD_stop_daemon(state_->daemon);
}

absl::Status HttpDaemon::AddConnection(int fd) {
  sockaddr_in peer{};
  peer.sin_family = AF_INET;
  peer.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (MHD_add_connection(state_->daemon, fd, reinterpret_cast<sockaddr*>(&peer), sizeof(peer)) !=
      MHD_YES) {
    return absl::UnavailableError("the connection was not taken (too many open?)");
  }
  return absl::OkStatus();
}

}  // namespace tandem::openai
