// BindHttpServer: the port it reports is the one bound, a taken port is refused, and the socket
// queues many connections at once (Debian's httplib listens with a backlog of 5 on its own).
#include "common/httplib.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <unistd.h>

#include <vector>

#include "gtest/gtest.h"

namespace tandem {
namespace {

// Opens `count` non-blocking connections to 127.0.0.1:port and returns how many completed their
// handshake. Nothing accepts them: each completed one waits in the listening socket's queue, and
// a connection past the queue's length gets no answer to its SYN.
int ConnectionsQueued(int port, int count) {
  std::vector<int> fds;
  for (int i = 0; i < count; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    fds.push_back(fd);
  }
  int connected = 0;
  for (int fd : fds) {
    pollfd p{.fd = fd, .events = POLLOUT, .revents = 0};
    int err = 0;
    socklen_t len = sizeof(err);
    if (poll(&p, 1, 20) == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 &&
        err == 0) {
      ++connected;
    }
  }
  for (int fd : fds) close(fd);
  return connected;
}

TEST(BindHttpServerTest, QueuesManyConnectionsBeforeAccepting) {
  httplib::Server server;
  const int port = BindHttpServer(server, "127.0.0.1", 0);
  ASSERT_GT(port, 0);
  // The server never accepts (listen_after_bind is not called): all 200 must fit the queue.
  EXPECT_EQ(ConnectionsQueued(port, 200), 200);
}

TEST(BindHttpServerTest, ReportsThePortAndRefusesATakenOne) {
  httplib::Server first, second;
  const int port = BindHttpServer(first, "127.0.0.1", 0);
  ASSERT_GT(port, 0);
  EXPECT_EQ(BindHttpServer(second, "127.0.0.1", port), -1);
}

}  // namespace
}  // namespace tandem
