// The sweep's client of tandem's gRPC API: GetModelInfo, Admin.SetTopology, GenerateStream.
#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "grpc/grpc.h"
#include "grpcpp/grpcpp.h"
#include "loadgen/load_client.h"
#include "proto/tandem.grpc.pb.h"

namespace tandem::loadgen {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

class GrpcClient final : public LoadClient {
 public:
  GrpcClient(const std::string& address, double timeout_s, const ClientAuth& inference,
             const ClientAuth& admin)
      : timeout_s_(timeout_s), address_(address), inference_auth_(inference) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    // One channel per key: each carries its own bearer token.
    inference_ = v1::Inference::NewStub(MakeChannel(address, inference, args));
    admin_ = v1::Admin::NewStub(MakeChannel(address, admin, args));
  }

  // The Inference stub of connection number `n`: 0 is inference_; each other a channel of its
  // own, which does not share the process's connections (a local subchannel pool).
  v1::Inference::Stub* Connection(int n) {
    if (n <= 0) return inference_.get();
    absl::MutexLock lock(&mu_);
    std::unique_ptr<v1::Inference::Stub>& stub = connections_[n];
    if (stub == nullptr) {
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(64 << 20);
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      stub = v1::Inference::NewStub(MakeChannel(address_, inference_auth_, args));
    }
    return stub.get();
  }

  absl::StatusOr<ServedModel> Info() override {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    ctx.set_wait_for_ready(true);
    v1::ModelInfo info;
    grpc::Status s = inference_->GetModelInfo(&ctx, {}, &info);
    if (!s.ok()) return absl::UnavailableError(absl::StrCat("GetModelInfo: ", s.error_message()));
    ServedModel out{.vocab_size = info.vocab_size(),
                    .context_length = info.context_length(),
                    .name = std::filesystem::path(info.model_dir()).filename().string(),
                    .model_dir = info.model_dir(),
                    .architecture = info.architecture(),
                    .dtype = info.dtype(),
                    .num_layers = info.num_layers(),
                    .max_slots = info.max_slots(),
                    .max_batch = info.max_batch()};
    // The topology is the admin's to read: without its key the report goes without it.
    grpc::ClientContext tctx;
    tctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::Topology topology;
    if (admin_->GetTopology(&tctx, {}, &topology).ok()) {
      out.stages = topology.stages();
      out.replicas = topology.replicas();
    }
    return out;
  }

  absl::Status SetTopology(int stages, int replicas, int prefill) override {
    const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(300);
    std::string last;
    while (std::chrono::system_clock::now() < deadline) {
      grpc::ClientContext ctx;
      ctx.set_deadline(deadline);
      v1::SetTopologyRequest req;
      req.set_stages(stages);
      req.set_replicas(replicas);
      req.set_prefill_replicas(prefill);
      v1::Topology t;
      grpc::Status s = admin_->SetTopology(&ctx, req, &t);
      if (s.ok()) {
        bool ok = t.pipelines_size() == replicas;
        int prefilling = 0;
        for (const auto& p : t.pipelines()) {
          ok &= p.stages_size() == stages;
          prefilling += p.role() == "prefill";
        }
        ok &= prefilling == prefill;
        if (ok) return absl::OkStatus();
      }
      last = s.error_message();
      // Workers may still be registering: FAILED_PRECONDITION until enough are up.
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return absl::UnavailableError(absl::StrFormat(
        "SetTopology %d stages x %d replicas (%d prefill): %s", stages, replicas, prefill, last));
  }

  RequestRecord Generate(const std::vector<int32_t>& prompt, int output_len,
                         int connection) override {
    RequestRecord rec;
    v1::GenerateRequest req;
    req.mutable_token_ids()->Assign(prompt.begin(), prompt.end());
    req.set_max_new_tokens(output_len);
    req.set_ignore_eos(true);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(
                                        static_cast<int64_t>(timeout_s_ * 1000)));
    const auto t0 = Clock::now();
    auto last = t0;
    auto reader = Connection(connection)->GenerateStream(&ctx, req);
    v1::GenerateStreamResponse msg;
    std::vector<int32_t> tokens;
    while (reader->Read(&msg)) {
      const auto now = Clock::now();
      const int n = msg.token_ids_size();
      if (n == 0) continue;
      if (tokens.empty()) {
        rec.ttft = Since(t0, now);
      } else {
        for (int k = 0; k < n; ++k) rec.gaps.push_back(Since(last, now) / n);
      }
      last = now;
      tokens.insert(tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
    }
    grpc::Status s = reader->Finish();
    rec.e2e = Since(t0, Clock::now());
    rec.ok = s.ok();
    if (!s.ok()) rec.error = s.error_message();
    rec.num_tokens = static_cast<int>(tokens.size());
    rec.output = absl::StrJoin(tokens, ",");
    return rec;
  }

 private:
  const double timeout_s_;
  const std::string address_;
  const ClientAuth inference_auth_;
  std::unique_ptr<v1::Inference::Stub> inference_;
  std::unique_ptr<v1::Admin::Stub> admin_;
  absl::Mutex mu_;
  std::map<int, std::unique_ptr<v1::Inference::Stub>> connections_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<LoadClient> NewGrpcClient(const std::string& address, double timeout_s,
                                          const ClientAuth& inference, const ClientAuth& admin) {
  return std::make_unique<GrpcClient>(address, timeout_s, inference, admin);
}

}  // namespace tandem::loadgen
