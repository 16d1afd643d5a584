// A link for KV-cache bytes between the GPUs of two workers: device memory on both sides, each
// Send meeting the peer's Recv of the same size, in order. NcclKvLink
// (worker/transport/nccl_kv_link.h) implements it; the worker makes links through its backend
// (Backend::JoinKvLink, worker/backend.h) and falls back to gRPC without one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem {

class KvLink {
 public:
  virtual ~KvLink() = default;
  // Buffers of device memory of this worker's GPU to the peer, in order, as one transfer; returns
  // once they have left, or with the error that broke the link (a silent peer:
  // DEADLINE_EXCEEDED at the link's timeout). The peer receives the same sizes in the same order.
  virtual absl::Status Send(std::span<const std::pair<const void*, size_t>> buffers) = 0;
  // Buffers from the peer into device memory of this worker's GPU; returns once they are there.
  virtual absl::Status Recv(std::span<const std::pair<void*, size_t>> buffers) = 0;
  // Device memory of this worker's GPU for what Recv takes, freed when the last owner lets go.
  virtual absl::StatusOr<std::shared_ptr<uint8_t>> Allocate(size_t bytes) = 0;
  // After an error: every later call fails; the link is to be dropped and joined anew.
  virtual bool broken() const = 0;
};

}  // namespace tandem
