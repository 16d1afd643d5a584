// The coordinator's gRPC services: Inference and Admin (public) and Registry (for workers). They
// translate between protos and the Coordinator; absl::Status becomes grpc::Status only here.
// Each checks its caller first (common/security/credentials.h): Inference the API key, Admin the
// admin key, Registry the cluster secret or certificate and that a worker registers its own
// address.
#pragma once

#include <memory>

#include "common/security/credentials.h"
#include "coordinator/coordinator.h"
#include "grpcpp/grpcpp.h"
#include "proto/grpc_status.h"
#include "proto/tandem.grpc.pb.h"

namespace tandem {

class InferenceService final : public v1::Inference::Service {
 public:
  // `access`: the API key (default: open to every caller).
  explicit InferenceService(Coordinator& c, CallerPolicy access = {})
      : c_(c), access_(std::move(access)) {}
  grpc::Status Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                        v1::GenerateResponse* resp) override;
  grpc::Status GenerateStream(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                              grpc::ServerWriter<v1::GenerateStreamResponse>* writer) override;
  grpc::Status GetModelInfo(grpc::ServerContext* ctx, const v1::GetModelInfoRequest* req,
                            v1::ModelInfo* resp) override;

 private:
  Coordinator& c_;
  const CallerPolicy access_;
};

class AdminService final : public v1::Admin::Service {
 public:
  // `access`: the admin key (default: open to every caller).
  explicit AdminService(Coordinator& c, CallerPolicy access = {})
      : c_(c), access_(std::move(access)) {}
  grpc::Status GetTopology(grpc::ServerContext*, const v1::GetTopologyRequest*,
                           v1::Topology* resp) override;
  grpc::Status SetTopology(grpc::ServerContext*, const v1::SetTopologyRequest* req,
                           v1::Topology* resp) override;
  grpc::Status ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                           v1::ListWorkersResponse* resp) override;
  grpc::Status Drain(grpc::ServerContext*, const v1::DrainRequest* req,
                     v1::Topology* resp) override;
  grpc::Status Undrain(grpc::ServerContext*, const v1::UndrainRequest* req,
                       v1::Topology* resp) override;

 private:
  Coordinator& c_;
  const CallerPolicy access_;
};

class RegistryService final : public v1::Registry::Service {
 public:
  // `access`: the cluster secret and/or certificate (default: open to every caller).
  // `trust_addresses`: accept a registered address that is not the caller's own (NAT, proxies).
  explicit RegistryService(Coordinator& c, CallerPolicy access = {}, bool trust_addresses = false)
      : c_(c), access_(std::move(access)), trust_addresses_(trust_addresses) {}
  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest* req,
                        v1::RegisterResponse* resp) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override;

 private:
  Coordinator& c_;
  const CallerPolicy access_;
  const bool trust_addresses_;
};

}  // namespace tandem
