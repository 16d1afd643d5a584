// Moving running sequences with their KV-cache from the stages of a retired pipeline (the
// holders) to those of a new one (the takers): the Worker RPCs ExportKv, ImportKv and DropKv
// (proto/tandem.proto), called on every stage at once. The takers fetch what they lack from the
// holders' stashes themselves, worker to worker.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/partition_planner.h"
#include "grpcpp/grpcpp.h"
#include "proto/tandem.pb.h"

namespace tandem {

// One stage of a pipeline in a move.
struct KvStage {
  int64_t worker = 0;
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  uint64_t assignment = 0;
  LayerRange layers;
};

// A sequence in a move: its key (unique within the move), its slot (in the holders' pipeline for
// an export, in the takers' for an import), the positions its KV-cache holds and, with pages,
// their pages on that pipeline.
struct KvSeq {
  uint64_t key = 0;
  int slot = -1;
  int positions = 0;
  // With pages: the pages that hold its positions there, in order (KvSequence.block_table).
  std::vector<int32_t> block_table;
};

// Where `taker`'s layers are among `holders`' stages, in layer order: the parts of each holder's
// layers that are the taker's, with an empty address for the taker's own worker (its stash).
std::vector<v1::KvSource> KvSourcesFor(const KvStage& taker, std::span<const KvStage> holders);

// Every holder stashes the sequences' KV-cache. OK, or the first failure naming the worker.
absl::Status ExportKvAll(std::span<const KvStage> holders, std::span<const KvSeq> seqs,
                         absl::Duration timeout);
// Every taker fills the sequences' slots from the holders. Bytes written into the takers' stages
// (every layer of every sequence once), or the first failure naming the worker. With
// `stream_step` nonzero, from what that step of the holders writes out as it runs
// (SequenceStep.kv_out_key), each layer fetched as soon as it is written, instead of their
// stashes.
absl::StatusOr<int64_t> ImportKvAll(std::span<const KvStage> takers,
                                    std::span<const KvStage> holders, std::span<const KvSeq> seqs,
                                    absl::Duration timeout, uint64_t stream_step = 0);
// The holders drop the sequences from their stashes (failures are logged).
void DropKvAll(std::span<const KvStage> holders, std::span<const KvSeq> seqs);

}  // namespace tandem
