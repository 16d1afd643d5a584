// The HTTP server's rules (coordinator/openai/http_daemon.cc) over raw sockets on loopback:
// framing, size bounds, deadlines, the connection bound, pipelining, suspended answers given
// from other threads, streams, and a client's departure seen while its answer is awaited.
#include "coordinator/openai/http_daemon.h"

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/coordinator/openai/raw_http.h"

namespace tandem::openai {
namespace {

using ::tandem::testing::RawClient;
using ::tandem::testing::RawResponse;

HttpResponse Text(int status, std::string body) {
  HttpResponse r;
  r.status = status;
  r.content_type = "text/plain";
  r.body = std::move(body);
  return r;
}

// A daemon with test routes:
//   /echo        the method and body, answered at once
//   /later       answered 50 ms later from another thread
//   /stream      three chunks written from another thread
//   /wait-gone   never answered until its client leaves (counted in `gone`)
//   /refused     refused before its body is read (403)
class Server {
 public:
  explicit Server(HttpDaemonOptions options = {}) {
    options.host = "127.0.0.1";
    options.port = 0;
    absl::StatusOr<std::unique_ptr<HttpDaemon>> d = HttpDaemon::Start(
        options,
        [](const HttpRequest& head) -> std::optional<HttpResponse> {
          if (head.path == "/refused") return Text(403, "refused");
          return std::nullopt;
        },
        [this](const HttpRequest& req, std::shared_ptr<HttpExchange> ex) { Handle(req, ex); },
        [](int status, std::string_view message) { return Text(status, std::string(message)); });
    EXPECT_TRUE(d.ok()) << d.status();
    if (d.ok()) daemon_ = *std::move(d);
  }
  ~Server() {
    if (daemon_) daemon_->AbandonAll();
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(mu_);
      threads.swap(threads_);
    }
    for (std::thread& t : threads) t.join();
  }
  int port() const { return daemon_->port(); }
  std::atomic<int> gone{0};

 private:
  void Spawn(std::function<void()> work) {
    std::lock_guard<std::mutex> lock(mu_);
    threads_.emplace_back(std::move(work));
  }

  void Handle(const HttpRequest& req, std::shared_ptr<HttpExchange> ex) {
    if (req.path == "/echo") {
      return ex->Respond(Text(200, absl::StrCat(req.method, " ", req.body)));
    }
    if (req.path == "/later") {
      Spawn([ex, body = req.body] {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        ex->Respond(Text(200, "later " + body));
      });
      return;
    }
    if (req.path == "/stream") {
      Spawn([ex] {
        ex->StartStream(Text(200, ""));
        for (const char* piece : {"one ", "two ", "three"}) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          ex->Write(piece);
        }
        ex->End();
      });
      return;
    }
    if (req.path == "/wait-gone") {
      Spawn([this, ex] {
        const absl::Time give_up = absl::Now() + absl::Seconds(30);
        while (!ex->ClientGone() && absl::Now() < give_up) {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        if (ex->ClientGone()) ++gone;
        ex->Respond(Text(499, "gone"));
      });
      return;
    }
    ex->Respond(Text(404, "no such path"));
  }

  std::unique_ptr<HttpDaemon> daemon_;
  std::mutex mu_;
  std::vector<std::thread> threads_;
};

std::string Post(absl::string_view path, absl::string_view body) {
  return absl::StrCat("POST ", path, " HTTP/1.1\r\nHost: x\r\nContent-Length: ", body.size(),
                      "\r\n\r\n", body);
}

TEST(HttpDaemon, AnswersEachPipelinedRequestInOrder) {
  Server server;
  RawClient c(server.port());
  ASSERT_TRUE(c.Send(Post("/later", "first") + Post("/echo", "second") +
                     "GET /echo HTTP/1.1\r\nHost: x\r\n\r\n" + Post("/later", "fourth")));
  std::vector<std::string> bodies;
  for (int i = 0; i < 4; ++i) {
    std::optional<RawResponse> r = c.Read();
    ASSERT_TRUE(r.has_value()) << "response " << i;
    bodies.push_back(r->body);
  }
  EXPECT_EQ(bodies,
            (std::vector<std::string>{"later first", "POST second", "GET ", "later fourth"}));
}

TEST(HttpDaemon, KeepsTheConnectionForTheNextRequest) {
  Server server;
  RawClient c(server.port());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(c.Send(Post("/echo", std::to_string(i))));
    std::optional<RawResponse> r = c.Read();
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->body, absl::StrCat("POST ", i));
  }
}

TEST(HttpDaemon, RefusesTransferEncodingWithContentLengthAndCloses) {
  Server server;
  RawClient c(server.port());
  ASSERT_TRUE(
      c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
             "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"));
  std::optional<RawResponse> r = c.Read();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, 400);
  EXPECT_TRUE(c.ClosedWithin(absl::Seconds(30)));
}

TEST(HttpDaemon, RefusesAnUnknownTransferCoding) {
  Server server;
  RawClient c(server.port());
  ASSERT_TRUE(
      c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
             "5\r\nhello\r\n0\r\n\r\n"));
  std::optional<RawResponse> r = c.Read();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, 501);
  EXPECT_TRUE(c.ClosedWithin(absl::Seconds(30)));
}

TEST(HttpDaemon, ReadsAChunkedBodyWithinTheBound) {
  Server server;
  RawClient c(server.port());
  ASSERT_TRUE(
      c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
             "5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"));
  std::optional<RawResponse> r = c.Read();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->body, "POST hello world");
}

TEST(HttpDaemon, RefusesAContentLengthAboveTheBoundWithoutReadingTheBody) {
  Server server({.max_body_bytes = 1000});
  RawClient c(server.port());
  ASSERT_TRUE(c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 400000000\r\n\r\n"));
  std::optional<RawResponse> r = c.Read();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, 413);
}

TEST(HttpDaemon, AnswersAClientThatWritesItsWholeRefusedBodyBeforeReading) {
  Server server({.max_body_bytes = 4 << 20});
  RawClient c(server.port());
  timeval limit{.tv_sec = 30, .tv_usec = 0};
  setsockopt(c.fd(), SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
  // 30 MB (under 8 times the bound), more than the sockets' buffers hold: a server that neither
  // reads it nor closes blocks the client, and one that closes unread resets it.
  const std::string body(30 << 20, 'a');
  ASSERT_TRUE(c.Send(Post("/echo", body)));
  std::optional<RawResponse> r = c.Read();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, 413);
  EXPECT_TRUE(c.ClosedWithin(absl::Seconds(30)));
}

TEST(HttpDaemon, RefusesAChunkedBodyAsSoonAsItPassesTheBound) {
  Server server({.max_body_bytes = 1000});
  RawClient c(server.port());
  ASSERT_TRUE(c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"));
  // 1,200 bytes in chunks of 100, and no end: a server that reads the whole body before
  // counting it never answers.
  const std::string chunk = "64\r\n" + std::string(100, 'a') + "\r\n";
  for (int i = 0; i < 12; ++i) c.Send(chunk);
  std::optional<RawResponse> r = c.Read();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, 413);
  EXPECT_TRUE(c.ClosedWithin(absl::Seconds(30)));
}

TEST(HttpDaemon, RefusesHeadersAboveTheBound) {
  Server server({.max_header_bytes = 4096});
  RawClient c(server.port());
  ASSERT_TRUE(
      c.Send("GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(64 << 10, 'b') + "\r\n\r\n"));
  std::optional<RawResponse> r = c.Read();
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->status == 431 || r->status == 400) << r->status;
}

TEST(HttpDaemon, ClosesAConnectionWhoseHeadersTakeTooLongInTotal) {
  Server server({.header_timeout = absl::Seconds(1), .body_timeout = absl::Seconds(60)});
  RawClient c(server.port());
  ASSERT_TRUE(c.Send("GET /echo HTTP/1.1\r\n"));
  // A byte every 100 ms: never idle, so only a total deadline ends it.
  bool closed = false;
  for (int i = 0; i < 300 && !closed; ++i) {
    closed = !c.Send("X") || c.ClosedWithin(absl::Milliseconds(100));
  }
  EXPECT_TRUE(closed);
}

TEST(HttpDaemon, ClosesAConnectionWhoseBodyTakesTooLongInTotal) {
  Server server({.header_timeout = absl::Seconds(60), .body_timeout = absl::Seconds(1)});
  RawClient c(server.port());
  ASSERT_TRUE(c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"));
  bool closed = false;
  for (int i = 0; i < 300 && !closed; ++i) {
    closed = !c.Send("X") || c.ClosedWithin(absl::Milliseconds(100));
  }
  EXPECT_TRUE(closed);
}

TEST(HttpDaemon, ClosesConnectionsBeyondTheBoundAtOnce) {
  Server server({.max_connections = 4});
  std::vector<std::unique_ptr<RawClient>> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(std::make_unique<RawClient>(server.port()));
    ASSERT_TRUE(held.back()->Send("GET /echo HTTP/1.1\r\nHost: x\r\n\r\n"));
    ASSERT_TRUE(held.back()->Read().has_value());
  }
  RawClient extra(server.port());
  extra.Send("GET /echo HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_FALSE(extra.Read(absl::Seconds(30)).has_value());
  held.pop_back();
  // Once one leaves, a new one is served (the close may take a moment to be seen).
  std::optional<RawResponse> r;
  for (int i = 0; i < 100 && !r.has_value(); ++i) {
    RawClient next(server.port());
    next.Send("GET /echo HTTP/1.1\r\nHost: x\r\n\r\n");
    r = next.Read(absl::Seconds(5));
    if (!r.has_value()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, 200);
}

TEST(HttpDaemon, RefusesBeforeTheBodyAndKeepsABodilessConnection) {
  Server server;
  RawClient c(server.port());
  ASSERT_TRUE(
      c.Send("GET /refused HTTP/1.1\r\nHost: x\r\n\r\nGET /echo HTTP/1.1\r\nHost: x\r\n\r\n"));
  std::optional<RawResponse> first = c.Read();
  std::optional<RawResponse> second = c.Read();
  ASSERT_TRUE(first.has_value() && second.has_value());
  EXPECT_EQ(first->status, 403);
  EXPECT_EQ(second->body, "GET ");
}

TEST(HttpDaemon, StreamsChunksWrittenFromAnotherThread) {
  Server server;
  RawClient c(server.port());
  ASSERT_TRUE(c.Send("GET /stream HTTP/1.1\r\nHost: x\r\n\r\n" +
                     std::string("GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")));
  std::optional<RawResponse> r = c.Read();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->body, "one two three");
  std::optional<RawResponse> next = c.Read();
  ASSERT_TRUE(next.has_value());
  EXPECT_EQ(next->body, "GET ");
}

TEST(HttpDaemon, SeesAClientLeaveWhileItsAnswerIsAwaited) {
  Server server;
  {
    RawClient c(server.port());
    ASSERT_TRUE(c.Send("GET /wait-gone HTTP/1.1\r\nHost: x\r\n\r\n"));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (server.gone.load() == 0 && absl::Now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(server.gone.load(), 1);
}

TEST(HttpDaemon, SecondServerOnTheSamePortIsUnavailable) {
  Server server;
  absl::StatusOr<std::unique_ptr<HttpDaemon>> second = HttpDaemon::Start(
      {.host = "127.0.0.1", .port = server.port()},
      [](const HttpRequest&) { return std::optional<HttpResponse>(); },
      [](const HttpRequest&, std::shared_ptr<HttpExchange>) {},
      [](int status, std::string_view) { return Text(status, ""); });
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace tandem::openai
