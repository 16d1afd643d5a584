// A raw HTTP/1.1 client for tests: bytes written as given (malformed on purpose where a test
// wants), responses read back one at a time, with generous timeouts only to avoid hangs.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tandem::testing {

struct RawResponse {
  int status = 0;
  std::string headers;  // lower-cased, as received
  std::string body;
};

class RawClient {
 public:
  explicit RawClient(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    int yes = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof(yes));
  }
  ~RawClient() { Close(); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool connected() const { return connected_; }
  int fd() const { return fd_; }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  // False when the server closed or reset the connection.
  bool Send(std::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      bytes.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }

  // The next response, or nullopt when the connection ends (or `timeout` passes) first.
  std::optional<RawResponse> Read(absl::Duration timeout = absl::Seconds(30)) {
    const absl::Time give_up = absl::Now() + timeout;
    size_t head_end;
    while ((head_end = buffer_.find("\r\n\r\n")) == std::string::npos) {
      if (!Fill(give_up)) return std::nullopt;
    }
    RawResponse r;
    const std::string head = buffer_.substr(0, head_end);
    buffer_.erase(0, head_end + 4);
    if (head.size() < 12 || !absl::SimpleAtoi(head.substr(9, 3), &r.status)) return std::nullopt;
    r.headers = absl::AsciiStrToLower(head);
    if (r.status == 100) return Read(timeout);
    size_t length = 0;
    if (const size_t at = r.headers.find("\ncontent-length:"); at != std::string::npos) {
      const size_t start = at + 16, end = r.headers.find('\r', start);
      absl::string_view text(r.headers.data() + start,
                             end == std::string::npos ? r.headers.size() - start : end - start);
      if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &length)) return std::nullopt;
      while (buffer_.size() < length) {
        if (!Fill(give_up)) return std::nullopt;
      }
      r.body = buffer_.substr(0, length);
      buffer_.erase(0, length);
      return r;
    }
    if (r.headers.find("transfer-encoding: chunked") != std::string::npos) {
      while (true) {
        size_t line_end;
        while ((line_end = buffer_.find("\r\n")) == std::string::npos) {
          if (!Fill(give_up)) return std::nullopt;
        }
        const size_t size = std::strtoul(buffer_.substr(0, line_end).c_str(), nullptr, 16);
        while (buffer_.size() < line_end + 2 + size + 2) {
          if (!Fill(give_up)) return std::nullopt;
        }
        r.body += buffer_.substr(line_end + 2, size);
        buffer_.erase(0, line_end + 2 + size + 2);
        if (size == 0) return r;
      }
    }
    return r;  // no body (HEAD, 1xx, 204, 304) or until close: tests do not use the latter
  }

  // Whether the server closes the connection (reads end) within `timeout`; what arrives before
  // is discarded.
  bool ClosedWithin(absl::Duration timeout) {
    const absl::Time give_up = absl::Now() + timeout;
    while (absl::Now() < give_up) {
      if (!Fill(give_up)) return !timed_out_;
      buffer_.clear();
    }
    return false;
  }

 private:
  // Reads more into buffer_; false on end, error or timeout (timed_out_ says which).
  bool Fill(absl::Time give_up) {
    timed_out_ = false;
    const int64_t ms = absl::ToInt64Milliseconds(give_up - absl::Now());
    if (ms <= 0) {
      timed_out_ = true;
      return false;
    }
    pollfd p{.fd = fd_, .events = POLLIN, .revents = 0};
    if (::poll(&p, 1, static_cast<int>(ms)) <= 0) {
      timed_out_ = true;
      return false;
    }
    char chunk[65536];
    const ssize_t n = ::recv(fd_, chunk, sizeof(chunk), 0);
    if (n <= 0) return false;
    buffer_.append(chunk, static_cast<size_t>(n));
    return true;
  }

  int fd_ = -1;
  bool connected_ = false;
  bool timed_out_ = false;
  std::string buffer_;
};

}  // namespace tandem::testing
