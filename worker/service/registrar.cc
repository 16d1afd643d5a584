// The worker's registration with the coordinator and its heartbeats (Registrar, worker_service.h).
#include <algorithm>
#include <string>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/thread_name.h"
#include "proto/tandem.grpc.pb.h"
#include "spdlog/spdlog.h"
#include "worker/service/worker_service.h"

namespace tandem {

Registrar::Registrar(std::string coordinator, std::string advertise_address, std::string backend,
                     ClientAuth auth, int tensor_parallel)
    : coordinator_(std::move(coordinator)),
      address_(std::move(advertise_address)),
      backend_(std::move(backend)),
      auth_(std::move(auth)),
      tensor_parallel_(tensor_parallel) {
  thread_ = std::thread([this] {
    SetThreadName("registrar");
    Loop();
  });
}

Registrar::~Registrar() {
  stop_.store(true);
  thread_.join();
}

void Registrar::Loop() {
  // A restarted coordinator is found within a second, not after gRPC's reconnect backoff of up
  // to two minutes.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  auto stub = v1::Registry::NewStub(MakeChannel(coordinator_, auth_, args));
  int64_t id = -1;
  absl::Duration interval = absl::Milliseconds(200);
  bool warned = false;
  while (!stop_.load()) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    if (id < 0) {
      v1::RegisterRequest req;
      req.set_address(address_);
      req.set_backend(backend_);
      req.set_tensor_parallel(tensor_parallel_);
      v1::RegisterResponse resp;
      grpc::Status s = stub->Register(&ctx, req, &resp);
      if (s.ok()) {
        id = resp.worker_id();
        interval = absl::Milliseconds(std::max<uint32_t>(resp.heartbeat_interval_ms(), 10));
        spdlog::info("registered with {} as worker {} ({})", coordinator_, id, address_);
        warned = false;
      } else {
        if (!warned) spdlog::warn("cannot register with {}: {}", coordinator_, s.error_message());
        warned = true;
        interval = absl::Milliseconds(200);
      }
    } else {
      v1::HeartbeatRequest req;
      req.set_worker_id(id);
      v1::HeartbeatResponse resp;
      grpc::Status s = stub->Heartbeat(&ctx, req, &resp);
      if (s.ok() && !resp.known()) {
        spdlog::warn("the coordinator forgot worker {}; registering again", id);
        id = -1;
        continue;
      }
      if (!s.ok() && !warned) {
        spdlog::warn("heartbeat to {} failed: {}", coordinator_, s.error_message());
        warned = true;
      } else if (s.ok()) {
        warned = false;
      }
    }
    const absl::Time until = absl::Now() + interval;
    while (!stop_.load() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
  }
}

}  // namespace tandem
