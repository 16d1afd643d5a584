// The sweep's gRPC client against a real gRPC server on loopback: each connection number is a
// connection of its own (the server sees another peer address), the same number the same one; the
// top-2 logprobs it asks for become each token's gap; a layout the coordinator cannot serve fails
// at once with its reason.
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
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
    const RequestRecord r = client->Generate({1, 2, 3}, 1, connection, 0);
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

// Streams two tokens with top-2 logprobs where the request asks for them (the second token with
// only one alternative, as a server that gives fewer).
class LogprobStreamer final : public v1::Inference::Service {
 public:
  grpc::Status GenerateStream(grpc::ServerContext*, const v1::GenerateRequest* req,
                              grpc::ServerWriter<v1::GenerateStreamResponse>* writer) override {
    const bool asked = req->sampling().logprobs() && req->sampling().top_logprobs() == 2;
    v1::GenerateStreamResponse msg;
    msg.add_token_ids(7);
    msg.add_token_ids(8);
    if (asked) {
      v1::TokenLogprob* a = msg.add_logprobs();
      a->set_token_id(7);
      for (auto [id, lp] : {std::pair{7, -0.25f}, std::pair{9, -1.0f}}) {
        v1::TopLogprob* t = a->add_top_logprobs();
        t->set_token_id(id);
        t->set_logprob(lp);
      }
      v1::TokenLogprob* b = msg.add_logprobs();
      b->set_token_id(8);
      b->add_top_logprobs()->set_token_id(8);
    }
    writer->Write(msg);
    return grpc::Status::OK;
  }
};

// A coordinator whose workers refuse the plan: SetTopology answers `set`, GetTopology reports the
// planning error; counts the SetTopology calls.
class RefusingAdmin final : public v1::Admin::Service {
 public:
  explicit RefusingAdmin(grpc::Status set) : set_(std::move(set)) {}
  grpc::Status SetTopology(grpc::ServerContext*, const v1::SetTopologyRequest* req,
                           v1::Topology* resp) override {
    absl::MutexLock lock(&mu_);
    ++calls_;
    resp->set_stages(req->stages());
    resp->set_replicas(req->replicas());
    resp->set_plan_error(kPlanError);
    return set_;
  }
  grpc::Status GetTopology(grpc::ServerContext*, const v1::GetTopologyRequest*,
                           v1::Topology* resp) override {
    resp->set_stages(1);
    resp->set_replicas(1);
    resp->set_plan_error(kPlanError);
    return grpc::Status::OK;
  }
  int calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  static constexpr char kPlanError[] =
      "RESOURCE_EXHAUSTED: worker 127.0.0.1:7001: the KV-cache of 64 slots needs 80 GiB; the GPU "
      "has 70 GiB free";

 private:
  const grpc::Status set_;
  absl::Mutex mu_;
  int calls_ = 0;
};

// A server on a free loopback port with `services`; its address.
std::string Serve(std::vector<grpc::Service*> services, std::unique_ptr<grpc::Server>& server) {
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  for (grpc::Service* s : services) builder.RegisterService(s);
  server = builder.BuildAndStart();
  return "127.0.0.1:" + std::to_string(port);
}

TEST(GrpcClientTest, TopLogprobsAskedForBecomeEachTokensTop2Gap) {
  LogprobStreamer service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<LoadClient> client = NewGrpcClient(Serve({&service}, server), 10);
  ASSERT_NE(server, nullptr);
  RequestRecord r = client->Generate({1, 2, 3}, 2, 0, 2);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.tokens, (std::vector<std::string>{"7", "8"}));
  ASSERT_EQ(r.top2_gaps.size(), 2u);
  EXPECT_DOUBLE_EQ(r.top2_gaps[0], 0.75);
  EXPECT_TRUE(std::isnan(r.top2_gaps[1]));  // one alternative only
  // Not asked: no logprobs, no gaps.
  r = client->Generate({1, 2, 3}, 2, 0, 0);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.tokens.size(), 2u);
  EXPECT_TRUE(r.top2_gaps.empty());
  server->Shutdown();
}

TEST(GrpcClientTest, ALayoutTheWorkersRefuseFailsAtOnceWithThePlanningError) {
  RefusingAdmin admin(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                   "only 0 of 1 pipelines could be built (workers failed while "
                                   "loading)"));
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<LoadClient> client = NewGrpcClient(Serve({&admin}, server), 10);
  ASSERT_NE(server, nullptr);
  const absl::Status s = client->SetTopology(Layout{.stages = 2, .replicas = 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), ::testing::HasSubstr("cannot serve 2 stage(s) x 1 replica(s)"));
  EXPECT_THAT(s.message(), ::testing::HasSubstr("only 0 of 1 pipelines"));
  EXPECT_THAT(s.message(), ::testing::HasSubstr("the GPU has 70 GiB free"));
  EXPECT_EQ(admin.calls(), 1);
  server->Shutdown();
}

TEST(GrpcClientTest, ALayoutAnsweredWithoutItsPipelinesFailsAtOnceWithThePlanningError) {
  RefusingAdmin admin(grpc::Status::OK);  // answers, but no pipeline serves
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<LoadClient> client = NewGrpcClient(Serve({&admin}, server), 10);
  ASSERT_NE(server, nullptr);
  const absl::Status s = client->SetTopology(Layout{.stages = 1, .replicas = 1});
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), ::testing::HasSubstr("the GPU has 70 GiB free"));
  EXPECT_EQ(admin.calls(), 1);
  server->Shutdown();
}

TEST(GrpcClientTest, GetLayoutIsTheLayoutAskedFor) {
  RefusingAdmin admin(grpc::Status::OK);
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<LoadClient> client = NewGrpcClient(Serve({&admin}, server), 10);
  absl::StatusOr<Layout> l = client->GetLayout();
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(*l, (Layout{.stages = 1, .replicas = 1, .prefill = 0, .tensor_parallel = 0}));
  server->Shutdown();
}

// A coordinator whose stages are split over 2 ranks unless a SetTopology asks otherwise: it
// serves what it is asked at once and keeps whether the last request named the ranks.
class RanksAdmin final : public v1::Admin::Service {
 public:
  grpc::Status SetTopology(grpc::ServerContext*, const v1::SetTopologyRequest* req,
                           v1::Topology* resp) override {
    absl::MutexLock lock(&mu_);
    if (req->has_tensor_parallel()) ranks_ = req->tensor_parallel();
    asked_ranks_ = req->has_tensor_parallel();
    resp->set_stages(req->stages());
    resp->set_replicas(req->replicas());
    resp->set_tensor_parallel(ranks_);
    for (int r = 0; r < req->replicas(); ++r) {
      v1::PipelineInfo* p = resp->add_pipelines();
      p->set_tensor_parallel(ranks_);
      for (int s = 0; s < req->stages(); ++s) p->add_stages()->set_stage(s);
    }
    return grpc::Status::OK;
  }
  bool asked_ranks() {
    absl::MutexLock lock(&mu_);
    return asked_ranks_;
  }

 private:
  absl::Mutex mu_;
  int ranks_ = 2;
  bool asked_ranks_ = false;
};

// A layout that leaves the ranks unset does not name them (the service keeps its own size, here 2)
// and is served at any size; one that names them is served at that size only.
TEST(GrpcClientTest, RanksPerStageAreAskedOnlyWhereTheLayoutSetsThem) {
  RanksAdmin admin;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<LoadClient> client = NewGrpcClient(Serve({&admin}, server), 10);
  ASSERT_NE(server, nullptr);
  absl::Status s = client->SetTopology(Layout{.stages = 2, .replicas = 1});
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_FALSE(admin.asked_ranks()) << "a layout without ranks must leave the service's size";
  s = client->SetTopology(Layout{.stages = 1, .replicas = 2, .tensor_parallel = 1});
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(admin.asked_ranks());
  s = client->SetTopology(Layout{.stages = 1, .replicas = 1, .tensor_parallel = 0});
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(admin.asked_ranks()) << "0 (each worker's own) is asked for, not left out";
  server->Shutdown();
}

}  // namespace
}  // namespace tandem::loadgen
