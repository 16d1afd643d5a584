// The sweep's gRPC client against a real gRPC server on loopback: each connection number is a
// connection of its own (the server sees another peer address), the same number the same one.
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "grpcpp/grpcpp.h"
#include "loadgen/load_client.h"
#include "proto/tandem.grpc.pb.h"

namespace tandem::loadgen {
namespace {

// Answers every stream with one token and remembers the peer (ip:port) of each call.
class PeerRecorder final : public v1::Inference::Service {
 public:
  grpc::Status GenerateStream(grpc::ServerContext* ctx, const v1::GenerateRequest*,
                              grpc::ServerWriter<v1::GenerateStreamResponse>* writer) override {
    {
      absl::MutexLock lock(&mu_);
      peers_.push_back(ctx->peer());
    }
    v1::GenerateStreamResponse msg;
    msg.add_token_ids(7);
    writer->Write(msg);
    return grpc::Status::OK;
  }
  std::vector<std::string> peers() {
    absl::MutexLock lock(&mu_);
    return peers_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> peers_;
};

TEST(GrpcClientTest, EachConnectionNumberIsAConnectionOfItsOwn) {
  PeerRecorder service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);
  std::unique_ptr<LoadClient> client = NewGrpcClient("127.0.0.1:" + std::to_string(port), 10);
  for (int connection : {0, 1, 2, 1, 0, 2}) {
    const RequestRecord r = client->Generate({1, 2, 3}, 1, connection);
    ASSERT_TRUE(r.ok) << r.error;
    EXPECT_EQ(r.num_tokens, 1);
  }
  const std::vector<std::string> peers = service.peers();
  ASSERT_EQ(peers.size(), 6u);
  EXPECT_EQ(peers[0], peers[4]);
  EXPECT_EQ(peers[1], peers[3]);
  EXPECT_EQ(peers[2], peers[5]);
  EXPECT_EQ(std::set<std::string>(peers.begin(), peers.end()).size(), 3u);
  server->Shutdown();
}

}  // namespace
}  // namespace tandem::loadgen
