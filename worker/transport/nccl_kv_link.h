// KvLink over NCCL: a two-rank blocking communicator between the GPUs of two workers (rank 0
// sends, rank 1 receives). Joining runs on a thread of its own, given up on at the timeout or a
// cancellation; it also connects the two ranks, so that a transfer only queues its work, which is
// waited for against the timeout and ends in ncclCommAbort when the peer is gone or silent. The
// fetching worker makes the ncclUniqueId (MakeNcclUniqueId, worker/transport/nccl_transport.h) and
// hands it to the sending worker in FetchKvRequest.nccl_id; the link is kept for later moves
// between the two.
#pragma once

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "worker/transport/kv_link.h"

namespace tandem {

class NcclKvLink : public KvLink {
 public:
  // Joins the communicator of `unique_id` (kNcclUniqueIdBytes bytes) on CUDA device `device` as
  // `rank` (0 or 1); the peer joins with the same id within `timeout`, else DEADLINE_EXCEEDED.
  // CANCELLED as soon as `cancelled` (polled; may be empty) says so.
  static absl::StatusOr<std::unique_ptr<NcclKvLink>> Join(int device, int rank,
                                                          absl::string_view unique_id,
                                                          absl::Duration timeout,
                                                          std::function<bool()> cancelled = {});
  ~NcclKvLink() override;
  NcclKvLink(const NcclKvLink&) = delete;
  NcclKvLink& operator=(const NcclKvLink&) = delete;

  absl::Status Send(std::span<const std::pair<const void*, size_t>> buffers) override;
  absl::Status Recv(std::span<const std::pair<void*, size_t>> buffers) override;
  absl::StatusOr<std::shared_ptr<uint8_t>> Allocate(size_t bytes) override;
  bool broken() const override;

  struct State;  // the communicator, a stream and an event (nccl_kv_link.cc)

 private:
  explicit NcclKvLink(std::unique_ptr<State> state);
  std::unique_ptr<State> s_;
};

}  // namespace tandem
