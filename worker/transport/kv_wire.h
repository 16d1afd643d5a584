// KV-cache blocks (worker/stage.h KvBlock) on the wire: a block of one sequence is sent as
// KvChunks (proto/tandem.proto), each one layer's positions [first, first + n), and put together
// again on arrival, where every chunk is checked against the stage that will take the block
// before any memory is sized from it. A block of an FP8 KV-cache (F8_E4M3) travels with its
// layers' scales: each chunk carries its layer's (k_scale, v_scale), an NCCL header every layer's.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "proto/tandem.pb.h"
#include "worker/stage.h"

namespace tandem {

// Layers [first_layer, first_layer + num_layers) of `block` (which must hold them) as a block of
// their own, with their scales. INVALID_ARGUMENT naming the layers when it does not, or when an
// F8_E4M3 block has not one pair of scales per layer (or another block has any).
absl::StatusOr<KvBlock> SliceKvLayers(const KvBlock& block, int first_layer, int num_layers);

// Calls `emit` with the chunks of `block`'s layers [first_layer, first_layer + num_layers) (all of
// them by default) under `key`, layer by layer, positions in order, each with at most
// `max_chunk_bytes` of K and V together (at least one position per chunk). Stops early and
// returns false when `emit` does. INVALID_ARGUMENT naming the layers when the block does not hold
// them, or when its scales are not one pair per layer of F8_E4M3 (none for another dtype).
absl::StatusOr<bool> ForEachKvChunk(uint64_t key, const KvBlock& block, int64_t max_chunk_bytes,
                                    const std::function<bool(const v1::KvChunk&)>& emit,
                                    int first_layer = -1, int num_layers = -1);

// What the receiving stage holds: chunks that do not fit it are refused. (The dtype and the
// scales are the first chunk's of each layer; the stage checks them against its own when it
// imports the block, and refuses another dtype or other scales rather than convert.)
struct KvShape {
  int first_layer = 0;  // the layers expected, [first_layer, first_layer + num_layers)
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int max_positions = 0;  // per sequence
};

// The message that announces a sequence's block sent over NCCL (FetchKvRequest.nccl_id): its
// fields under `key`, every layer and position of `block` (and every layer's scales), no bytes.
v1::KvChunk NcclKvHeader(uint64_t key, const KvBlock& block);

// The block `header` announces, checked like a chunk against `shape` and to hold every layer of it
// and all its positions (and, F8_E4M3, a pair of scales > 0 per layer), with no bytes in the
// message: its fields and scales only, for the receiver to fill device_k and device_v.
// INVALID_ARGUMENT naming the field that does not fit.
absl::StatusOr<KvBlock> KvBlockOfNcclHeader(const v1::KvChunk& header, const KvShape& shape);

// Puts blocks together from their chunks. Chunks of a sequence's layer must come in position
// order; the layers of a sequence in any order.
class KvAssembler {
 public:
  explicit KvAssembler(KvShape shape) : shape_(shape) {}

  // INVALID_ARGUMENT naming the field of `chunk` that does not fit the shape, the sequence's
  // earlier chunks or the position where its layer stands.
  absl::Status Add(const v1::KvChunk& chunk);
  // The block of sequence `key`, every layer with every position; INVALID_ARGUMENT naming what is
  // missing. The sequence is forgotten.
  absl::StatusOr<KvBlock> Take(uint64_t key);

 private:
  struct Partial {
    KvBlock block;
    std::vector<int> filled;  // per layer: positions received
  };
  const KvShape shape_;
  std::map<uint64_t, Partial> partial_;
};

}  // namespace tandem
