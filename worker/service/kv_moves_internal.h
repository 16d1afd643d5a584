// What the two halves of a worker's KV-cache moves share (kv_moves.cc: the stash, export, import
// and gRPC; kv_moves_nccl.cc: sends and fetches over NCCL). Not for use outside them.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/tandem.pb.h"
#include "spdlog/spdlog.h"
#include "worker/service/kv_moves.h"

namespace tandem::kv_moves_internal {

// How long a fetch of a step's write-out waits for the step to open it, and then for each of its
// layers (the step may be queued behind others, each up to a long prompt).
inline constexpr absl::Duration kWrittenOutWait = absl::Seconds(60);

// Moves of a layout change are logged; the many small prefill hand-offs only at debug level.
spdlog::level::level_enum KvLogLevel(int64_t bytes, absl::Duration took);

// `s` with "sequence <key>: " before its message.
absl::Status OfSequence(uint64_t key, const absl::Status& s);

absl::Status WentAway();

// A FetchKv request of the layers [first_layer, first_layer + num_layers) of `keys`.
v1::FetchKvRequest FetchRequest(const std::vector<uint64_t>& keys, int first_layer,
                                int num_layers, WriteOutRef stream);

// The earlier of the fetch's deadline and kWrittenOutWait from now.
absl::Time WrittenOutDeadline(const KvChunkSink& sink);

}  // namespace tandem::kv_moves_internal
