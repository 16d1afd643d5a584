// The sweep's client of tandem's gRPC API: GetModelInfo, Admin.GetTopology and SetTopology,
// GenerateStream.
#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
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

// How long a layout change waits for workers that are still registering (FAILED_PRECONDITION:
// fewer registered than it needs) before it gives up.
constexpr auto kRegistrationWait = std::chrono::seconds(60);

// The most likely token's logprob minus the second's; NaN with fewer than two.
double Top2Gap(const v1::TokenLogprob& l) {
  if (l.top_logprobs_size() < 2) return std::nan("");
  return static_cast<double>(l.top_logprobs(0).logprob()) - l.top_logprobs(1).logprob();
}

// `t` serves exactly stages x replicas, `prefill` of them running prompts only.
bool Serves(const v1::Topology& t, const Layout& l) {
  if (t.pipelines_size() != l.replicas) return false;
  int prefilling = 0;
  for (const auto& p : t.pipelines()) {
    if (p.stages_size() != l.stages) return false;
    if (l.tensor_parallel && p.tensor_parallel() != *l.tensor_parallel) return false;
    prefilling += p.role() == "prefill";
  }
  return prefilling == l.prefill;
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
                    .kv_cache_dtype = info.kv_cache_dtype(),
                    .num_layers = info.num_layers(),
                    .max_slots = info.max_slots(),
                    .max_batch = info.max_batch()};
    // The topology is the admin's to read: without its key the report goes without it.
    if (absl::StatusOr<v1::Topology> topology = Topology(); topology.ok()) {
      out.stages = topology->stages();
      out.replicas = topology->replicas();
    }
    return out;
  }

  absl::StatusOr<Layout> GetLayout() override {
    absl::StatusOr<v1::Topology> t = Topology();
    if (!t.ok()) return t.status();
    return Layout{.stages = t->stages(),
                  .replicas = t->replicas(),
                  .prefill = t->prefill_replicas(),
                  .tensor_parallel = t->tensor_parallel()};
  }

  absl::Status SetTopology(const Layout& l) override {
    const std::string asked =
        absl::StrFormat("%d stage(s) x %d replica(s)%s%s", l.stages, l.replicas,
                        l.prefill > 0 ? absl::StrFormat(" (%d prefill)", l.prefill) : "",
                        l.tensor_parallel.value_or(0) > 0
                            ? absl::StrFormat(" of %d rank(s) each", *l.tensor_parallel)
                            : "");
    const auto give_up = std::chrono::system_clock::now() + kRegistrationWait;
    while (true) {
      grpc::ClientContext ctx;
      // The coordinator answers once the new layout serves: its workers load their layers.
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
      v1::SetTopologyRequest req;
      req.set_stages(l.stages);
      req.set_replicas(l.replicas);
      req.set_prefill_replicas(l.prefill);
      if (l.tensor_parallel) req.set_tensor_parallel(*l.tensor_parallel);
      v1::Topology t;
      const grpc::Status s = admin_->SetTopology(&ctx, req, &t);
      std::string why;
      if (s.ok()) {
        if (Serves(t, l)) return absl::OkStatus();
        if (!t.plan_error().empty()) return Refused(asked, t.plan_error());
        why = absl::StrFormat("%d pipeline(s) serve", t.pipelines_size());
      } else if (s.error_code() != grpc::StatusCode::FAILED_PRECONDITION) {
        // A worker refused its stage, the model cannot take the layout, or the coordinator is
        // not there: asking again would fail the same way.
        return Refused(asked, s.error_message(), static_cast<absl::StatusCode>(s.error_code()));
      } else {
        why = s.error_message();  // too few workers registered yet
      }
      if (std::chrono::system_clock::now() >= give_up) {
        return Refused(asked, absl::StrCat(why, " (after waiting ",
                                           std::chrono::seconds(kRegistrationWait).count(),
                                           " s for workers to register)"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }

  RequestRecord Generate(const std::vector<int32_t>& prompt, int output_len, int connection,
                         int top_logprobs) override {
    RequestRecord rec;
    v1::GenerateRequest req;
    req.mutable_token_ids()->Assign(prompt.begin(), prompt.end());
    req.set_max_new_tokens(output_len);
    req.set_ignore_eos(true);
    if (top_logprobs > 0) {
      req.mutable_sampling()->set_logprobs(true);
      req.mutable_sampling()->set_top_logprobs(top_logprobs);
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(
                                        static_cast<int64_t>(timeout_s_ * 1000)));
    const auto t0 = Clock::now();
    auto last = t0;
    auto reader = Connection(connection)->GenerateStream(&ctx, req);
    v1::GenerateStreamResponse msg;
    while (reader->Read(&msg)) {
      const auto now = Clock::now();
      const int n = msg.token_ids_size();
      if (n == 0) continue;
      if (rec.tokens.empty()) {
        rec.ttft = Since(t0, now);
      } else {
        for (int k = 0; k < n; ++k) rec.gaps.push_back(Since(last, now) / n);
      }
      last = now;
      for (int k = 0; k < n; ++k) {
        rec.tokens.push_back(absl::StrCat(msg.token_ids(k)));
        if (top_logprobs > 0) {
          rec.top2_gaps.push_back(k < msg.logprobs_size() ? Top2Gap(msg.logprobs(k))
                                                          : std::nan(""));
        }
      }
    }
    grpc::Status s = reader->Finish();
    rec.e2e = Since(t0, Clock::now());
    rec.ok = s.ok();
    if (!s.ok()) rec.error = s.error_message();
    rec.num_tokens = static_cast<int>(rec.tokens.size());
    return rec;
  }

 private:
  absl::StatusOr<v1::Topology> Topology() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::Topology t;
    const grpc::Status s = admin_->GetTopology(&ctx, {}, &t);
    if (!s.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                          absl::StrCat("Admin.GetTopology: ", s.error_message()));
    }
    return t;
  }

  // The service cannot serve the layout `asked`: `why`, with the coordinator's last planning
  // error where it says more.
  absl::Status Refused(const std::string& asked, const std::string& why,
                       absl::StatusCode code = absl::StatusCode::kUnavailable) {
    std::string message = absl::StrCat("the service cannot serve ", asked, ": ", why);
    if (absl::StatusOr<v1::Topology> t = Topology(); t.ok() && !t->plan_error().empty() &&
                                                     !absl::StrContains(t->plan_error(), why) &&
                                                     !absl::StrContains(why, t->plan_error())) {
      absl::StrAppend(&message, "; the coordinator's last planning error: ", t->plan_error());
    }
    return absl::Status(code, message);
  }

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
