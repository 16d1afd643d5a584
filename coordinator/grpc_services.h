// The coordinator's gRPC services: Inference and Admin (public) and Registry (for workers). They
// translate between protos and the Coordinator; absl::Status becomes grpc::Status only here.
#pragma once

#include <memory>

#include "coordinator/coordinator.h"
#include "grpcpp/grpcpp.h"
#include "proto/tandem.grpc.pb.h"

namespace tandem {

grpc::Status ToGrpcStatus(const absl::Status& s);

class InferenceService final : public v1::Inference::Service {
 public:
  explicit InferenceService(Coordinator& c) : c_(c) {}
  grpc::Status Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                        v1::GenerateResponse* resp) override;
  grpc::Status GenerateStream(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                              grpc::ServerWriter<v1::GenerateStreamResponse>* writer) override;
  grpc::Status GetModelInfo(grpc::ServerContext* ctx, const v1::GetModelInfoRequest* req,
                            v1::ModelInfo* resp) override;

 private:
  Coordinator& c_;
};

class AdminService final : public v1::Admin::Service {
 public:
  explicit AdminService(Coordinator& c) : c_(c) {}
  grpc::Status GetTopology(grpc::ServerContext*, const v1::GetTopologyRequest*,
                           v1::Topology* resp) override;
  grpc::Status SetTopology(grpc::ServerContext*, const v1::SetTopologyRequest* req,
                           v1::Topology* resp) override;
  grpc::Status ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                           v1::ListWorkersResponse* resp) override;
  grpc::Status Drain(grpc::ServerContext*, const v1::DrainRequest* req,
                     v1::Topology* resp) override;

 private:
  Coordinator& c_;
};

class RegistryService final : public v1::Registry::Service {
 public:
  explicit RegistryService(Coordinator& c) : c_(c) {}
  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest* req,
                        v1::RegisterResponse* resp) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override;

 private:
  Coordinator& c_;
};

}  // namespace tandem
