// A worker's KV-cache moves (worker/service/kv_moves.h).
#include "worker/service/kv_moves.h"
#include "worker/service/kv_moves_internal.h"

#include <algorithm>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "proto/grpc_status.h"
#include "spdlog/spdlog.h"
#include "worker/transport/grpc_transport.h"
#include "worker/transport/kv_wire.h"

namespace tandem {
namespace {

using namespace kv_moves_internal;

// K and V bytes of one stash chunk at most: some MB, so that a fetch streams rather than
// building one message per sequence.
constexpr int64_t kKvChunkBytes = int64_t{16} << 20;
// Streams (and connections) one import fetches a worker's sequences over.
constexpr size_t kFetchStreams = 4;
// Where the KV-cache of `s` is in a stage: its slot, and on a paged stage its pages.
KvPlace PlaceOf(const v1::KvSequence& s) {
  return KvPlace(s.slot(), {s.block_table().begin(), s.block_table().end()});
}

// The sources of an import, by first layer, when they cover the stage's layers
// [first_layer, last_layer) once each, so that no slot is left half filled; INVALID_ARGUMENT
// naming the gap or overlap otherwise.
absl::StatusOr<std::vector<const v1::KvSource*>> SourcesInOrder(const v1::ImportKvRequest& req,
                                                                int first_layer, int last_layer) {
  std::vector<const v1::KvSource*> sources;
  for (const v1::KvSource& src : req.sources()) sources.push_back(&src);
  std::sort(sources.begin(), sources.end(), [](const v1::KvSource* x, const v1::KvSource* y) {
    return x->first_layer() < y->first_layer();
  });
  int next = first_layer;
  for (const v1::KvSource* src : sources) {
    if (src->first_layer() != next || src->num_layers() < 1 ||
        src->num_layers() > last_layer - next) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sources: layers [%d, %d) do not continue this stage's [%d, %d) at %d",
                          src->first_layer(),
                          static_cast<int64_t>(src->first_layer()) + src->num_layers(),
                          first_layer, last_layer, next));
    }
    next += src->num_layers();
  }
  if (next != last_layer) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sources: layers [%d, %d) of this stage's [%d, %d) have no source", next,
                        last_layer, first_layer, last_layer));
  }
  return sources;
}

}  // namespace

namespace kv_moves_internal {

// Moves of a layout change are logged; the many small prefill hand-offs only at debug level.
spdlog::level::level_enum KvLogLevel(int64_t bytes, absl::Duration took) {
  return bytes >= (int64_t{64} << 20) || took >= absl::Milliseconds(100) ? spdlog::level::info
                                                                          : spdlog::level::debug;
}

// `s` with "sequence <key>: " before its message.
absl::Status OfSequence(uint64_t key, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat("sequence ", key, ": ", s.message()));
}

absl::Status WentAway() { return absl::CancelledError("the fetching worker went away"); }

// A FetchKv request of the layers [first_layer, first_layer + num_layers) of `keys`.
v1::FetchKvRequest FetchRequest(const std::vector<uint64_t>& keys, int first_layer,
                                int num_layers, WriteOutRef stream) {
  v1::FetchKvRequest req;
  req.mutable_keys()->Assign(keys.begin(), keys.end());
  req.set_first_layer(first_layer);
  req.set_num_layers(num_layers);
  req.set_stream_step(stream.step);
  req.set_stream_assignment(stream.assignment);
  return req;
}

// The earlier of the fetch's deadline and kWrittenOutWait from now.
absl::Time WrittenOutDeadline(const KvChunkSink& sink) {
  return std::min(sink.deadline, absl::Now() + kWrittenOutWait);
}

}  // namespace kv_moves_internal

KvMoves::KvMoves(KvMoveOptions options) : options_(std::move(options)) {}

// ---------------------------------------------------------------------------------------------
// The stash and the write-outs

void KvMoves::BeginAssignment(uint64_t id) {
  std::map<uint64_t, WrittenOutKv> before;  // of an assignment before: freed after the lock
  absl::MutexLock lock(&stash_mu_);
  std::swap(before, written_out_);
  newest_step_ = 0;
  out_assignment_ = id;
}

void KvMoves::EndSteps() {
  absl::MutexLock lock(&stash_mu_);
  ++steps_epoch_;  // the steps not run will not open their write-outs
}

int KvMoves::SpillToHost() {
  if (options_.backend == nullptr) return 0;
  absl::MutexLock lock(&stash_mu_);
  int moved = 0;
  for (auto& [key, block] : stash_) {
    if (!block->on_device()) continue;
    absl::StatusOr<KvBlock> host = options_.backend->KvToHost(*block);
    if (!host.ok()) {
      spdlog::warn("sequence {}: KV stash kept in device memory: {}", key,
                   host.status().ToString());
      continue;
    }
    block = std::make_shared<const KvBlock>(*std::move(host));
    ++moved;
  }
  spdlog::info("moved {} stashed sequence(s) from device to host memory for a new stage", moved);
  return moved;
}

absl::StatusOr<std::shared_ptr<const KvBlock>> KvMoves::Stashed(uint64_t key) {
  absl::MutexLock lock(&stash_mu_);
  auto it = stash_.find(key);
  if (it == stash_.end()) {
    return absl::NotFoundError(absl::StrCat("sequence ", key, ": not in this worker's KV stash"));
  }
  return it->second;
}

void KvMoves::Stash(std::map<uint64_t, std::shared_ptr<const KvBlock>> blocks) {
  // What the stash replaces is freed after the lock (`blocks` and `replaced` outlive it).
  std::vector<std::shared_ptr<const void>> replaced;
  absl::MutexLock lock(&stash_mu_);
  for (auto& [key, block] : blocks) {
    if (auto it = written_out_.find(key); it != written_out_.end()) {
      replaced.push_back(std::move(it->second.out));
      written_out_.erase(it);
    }
    std::swap(stash_[key], block);
  }
}

void KvMoves::OpenKvOuts(Assignment& a, const StepDescriptor& d) {
  std::vector<std::pair<const SequenceStep*, std::shared_ptr<KvOut>>> opened;
  for (const SequenceStep& s : d.seqs) {
    if (s.kv_out_key == 0) continue;
    absl::StatusOr<std::shared_ptr<KvOut>> out =
        a.engine->OpenKvOut(KvPlace(s.slot, s.block_table), s.position + s.num_tokens);
    if (!out.ok()) {
      spdlog::debug("assignment {} step {}: sequence {} not written out: {}", a.id, d.id,
                    s.kv_out_key, out.status().ToString());
      auto failed = std::make_shared<KvOut>(KvBlock{}, s.slot);
      failed->Fail(OfSequence(s.kv_out_key, out.status()));
      out = std::move(failed);
    }
    opened.emplace_back(&s, *std::move(out));
  }
  // What the write-outs replace is freed after the lock (freeing device memory waits for the
  // GPU's queue).
  std::vector<std::shared_ptr<const void>> replaced;
  absl::MutexLock lock(&stash_mu_);
  for (auto& [row, out] : opened) {
    for (auto it = written_out_.begin(); it != written_out_.end();) {
      const bool same = it->first == row->kv_out_key || it->second.out->slot() == row->slot;
      if (same) replaced.push_back(std::move(it->second.out));
      it = same ? written_out_.erase(it) : std::next(it);
    }
    if (auto it = stash_.find(row->kv_out_key); it != stash_.end()) {
      replaced.push_back(std::move(it->second));
      stash_.erase(it);
    }
    written_out_[row->kv_out_key] = {.by = {a.id, d.id}, .out = std::move(out)};
  }
  // After its write-outs are there: a fetch of one that is not gives up once this is past it.
  if (a.id == out_assignment_) newest_step_ = std::max(newest_step_, d.id);
}

absl::StatusOr<std::shared_ptr<KvOut>> KvMoves::WrittenOut(uint64_t key, WriteOutRef ref,
                                                           absl::Time deadline) {
  absl::MutexLock lock(&stash_mu_);
  const uint64_t epoch = steps_epoch_;
  auto opened = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(stash_mu_) {
    auto it = written_out_.find(key);
    return it != written_out_.end() && it->second.by.assignment == ref.assignment &&
           it->second.by.step == ref.step;
  };
  // Opened by the step, or the step cannot come any more.
  auto settled = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(stash_mu_) {
    return opened() || out_assignment_ != ref.assignment || newest_step_ >= ref.step ||
           steps_epoch_ != epoch;
  };
  if (!stash_mu_.AwaitWithDeadline(absl::Condition(&settled), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("sequence ", key, ": step ", ref.step,
                                                    " did not begin to write it out in time"));
  }
  if (!opened()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", key, ": not written out by step ", ref.step, " of assignment ",
        ref.assignment,
        out_assignment_ != ref.assignment ? " (this worker holds another assignment)"
        : steps_epoch_ != epoch          ? " (the steps' stream ended)"
                                         : ""));
  }
  return written_out_.at(key).out;
}

absl::StatusOr<KvBlock> KvMoves::OwnBlock(uint64_t key, int first_layer, int num_layers,
                                          WriteOutRef stream) {
  std::shared_ptr<const KvBlock> held;
  if (stream.step != 0) {
    absl::StatusOr<std::shared_ptr<KvOut>> out =
        WrittenOut(key, stream, absl::Now() + kWrittenOutWait);
    if (!out.ok()) return out.status();
    if (absl::Status st = (*out)->AwaitAll(absl::Now() + kWrittenOutWait); !st.ok()) {
      return OfSequence(key, st);
    }
    held = std::shared_ptr<const KvBlock>(*out, &(*out)->block());
  } else {
    absl::StatusOr<std::shared_ptr<const KvBlock>> stashed = Stashed(key);
    if (!stashed.ok()) return stashed.status();
    held = *std::move(stashed);
  }
  absl::StatusOr<KvBlock> b = SliceKvLayers(*held, first_layer, num_layers);
  if (!b.ok()) return OfSequence(key, b.status());
  return b;
}

absl::StatusOr<std::shared_ptr<const KvBlock>> KvMoves::OnHost(
    uint64_t key, std::shared_ptr<const KvBlock> block) {
  if (!block->on_device()) return block;
  absl::StatusOr<KvBlock> host =
      options_.backend != nullptr
          ? options_.backend->KvToHost(*block)
          : absl::InternalError("no copy from device memory in this worker");
  if (!host.ok()) return OfSequence(key, host.status());
  return std::make_shared<const KvBlock>(*std::move(host));
}

void KvMoves::Drop(std::span<const uint64_t> keys) {
  // Freed after the lock: freeing device memory waits for the GPU's queue, and the executor takes
  // the lock before each step that writes sequences out.
  std::map<uint64_t, std::shared_ptr<const KvBlock>> stashed;
  std::map<uint64_t, WrittenOutKv> written;
  absl::MutexLock lock(&stash_mu_);
  if (keys.empty()) {
    std::swap(stashed, stash_);
    std::swap(written, written_out_);
  } else {
    for (uint64_t key : keys) {
      if (auto node = stash_.extract(key)) stashed.insert(std::move(node));
      if (auto node = written_out_.extract(key)) written.insert(std::move(node));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Export and import

absl::Status KvMoves::Export(Assignment& a, const v1::ExportKvRequest& req,
                             v1::ExportKvResponse& resp) {
  std::map<uint64_t, std::shared_ptr<const KvBlock>> blocks;
  int64_t bytes = 0;
  const absl::Time t0 = absl::Now();
  // One sequence at a time between steps, so that a stage that keeps running steps (a prefill
  // worker handing off) waits for one sequence's copies at most.
  const int layers = a.last_layer - a.first_layer;
  // On the GPU only where it can leave over NCCL.
  const bool on_device = req.device() && has_nccl();
  for (const v1::KvSequence& s : req.seqs()) {
    const KvPlace place = PlaceOf(s);
    a.LockForKv();
    absl::StatusOr<KvBlock> b =
        on_device ? a.engine->ExportKvToDevice(place, s.positions(), a.first_layer, layers)
                  : a.engine->ExportKv(place, s.positions(), a.first_layer, layers);
    // No device after all, or no room there: host memory.
    if (on_device && (absl::IsUnimplemented(b.status()) || absl::IsResourceExhausted(b.status()))) {
      b = a.engine->ExportKv(place, s.positions(), a.first_layer, layers);
    }
    a.run_mu.Unlock();
    if (!b.ok()) return OfSequence(s.key(), b.status());
    bytes += static_cast<int64_t>(b->bytes());
    blocks[s.key()] = std::make_shared<const KvBlock>(*std::move(b));
  }
  Stash(std::move(blocks));
  resp.set_bytes(bytes);
  const absl::Duration took = absl::Now() - t0;
  spdlog::log(KvLogLevel(bytes, took),
              "assignment {}: stashed the KV-cache of {} sequence(s), {} bytes, in {} memory, "
              "in {:.3f} s",
              req.assignment_id(), req.seqs_size(), bytes, on_device ? "device" : "host",
              absl::ToDoubleSeconds(took));
  return absl::OkStatus();
}

absl::Status KvMoves::MakeLinks(const v1::ImportKvRequest& req) {
  for (const v1::KvSource& src : req.sources()) {
    if (src.address().empty() || !has_nccl()) continue;
    absl::StatusOr<std::optional<std::vector<KvBlock>>> made =
        FetchOverNccl(nullptr, src.address(), {}, 0, 0);
    if (!made.ok()) return made.status();
  }
  return absl::OkStatus();
}

absl::Status KvMoves::Import(Assignment& a, const v1::ImportKvRequest& req,
                             v1::ImportKvResponse& resp) {
  absl::StatusOr<std::vector<const v1::KvSource*>> sources =
      SourcesInOrder(req, a.first_layer, a.last_layer);
  if (!sources.ok()) return sources.status();
  std::vector<uint64_t> keys;
  std::set<int> slots;
  for (const v1::KvSequence& s : req.seqs()) {
    keys.push_back(s.key());
    if (!slots.insert(s.slot()).second) {
      return absl::InvalidArgumentError(absl::StrCat("seqs: slot ", s.slot(), " is given twice"));
    }
  }
  // Every block first (fetches take long and need no lock; the remote ones all at once), then
  // the writes between steps.
  const absl::Time t0 = absl::Now();
  const size_t n = sources->size();
  std::vector<absl::StatusOr<std::vector<KvBlock>>> blocks(n);
  std::vector<std::thread> fetches;
  for (size_t i = 0; i < n; ++i) {
    const v1::KvSource* src = (*sources)[i];
    if (src->address().empty()) continue;
    fetches.emplace_back([&, i, src] {
      blocks[i] = FetchBlocks(a, src->address(), keys, src->first_layer(), src->num_layers(),
                              WriteOutRef{src->assignment_id(), req.stream_step()});
    });
  }
  // This worker's own stash meanwhile.
  auto own = [&](const v1::KvSource& src) -> absl::StatusOr<std::vector<KvBlock>> {
    std::vector<KvBlock> part;
    for (uint64_t key : keys) {
      absl::StatusOr<KvBlock> b = OwnBlock(key, src.first_layer(), src.num_layers(),
                                           WriteOutRef{src.assignment_id(), req.stream_step()});
      if (!b.ok()) return b.status();
      part.push_back(*std::move(b));
    }
    return part;
  };
  for (size_t i = 0; i < n; ++i) {
    if ((*sources)[i]->address().empty()) blocks[i] = own(*(*sources)[i]);
  }
  for (std::thread& t : fetches) t.join();
  int64_t fetched = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!blocks[i].ok()) return blocks[i].status();
    if ((*sources)[i]->address().empty()) continue;
    for (const KvBlock& b : *blocks[i]) fetched += static_cast<int64_t>(b.bytes());
  }
  resp.set_fetch_seconds(absl::ToDoubleSeconds(absl::Now() - t0));
  // One sequence at a time between steps (all its layers at once), so that the stage's running
  // sequences wait for one sequence's copies at most.
  int64_t bytes = 0;
  for (int i = 0; i < req.seqs_size(); ++i) {
    const v1::KvSequence& s = req.seqs(i);
    const KvPlace place = PlaceOf(s);
    a.LockForKv();
    absl::Status st;
    for (const absl::StatusOr<std::vector<KvBlock>>& part : blocks) {
      const KvBlock& b = (*part)[i];
      if (st = a.engine->ImportKv(place, b); !st.ok()) break;
      bytes += static_cast<int64_t>(b.bytes());
    }
    a.run_mu.Unlock();
    if (!st.ok()) return OfSequence(s.key(), st);
  }
  resp.set_bytes(bytes);
  resp.set_fetched_bytes(fetched);
  const absl::Duration took = absl::Now() - t0;
  spdlog::log(KvLogLevel(bytes, took),
              "assignment {}: imported the KV-cache of {} sequence(s), {} bytes ({} fetched in "
              "{:.3f} s), in {:.3f} s",
              req.assignment_id(), req.seqs_size(), bytes, fetched, resp.fetch_seconds(),
              absl::ToDoubleSeconds(took));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Fetches over gRPC

std::unique_ptr<v1::Worker::Stub> KvMoves::KvStub(const std::string& address,
                                                  int connection) const {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(kMaxStageMessageBytes));
  // A connection of its own per number (channels with other arguments share no subchannel).
  args.SetInt("tandem.kv_fetch_connection", connection);
  return v1::Worker::NewStub(MakeChannel(address, options_.peer_auth, args));
}

absl::StatusOr<std::vector<KvBlock>> KvMoves::FetchBlocks(const Assignment& a,
                                                          const std::string& address,
                                                          const std::vector<uint64_t>& keys,
                                                          int first_layer, int num_layers,
                                                          WriteOutRef stream) {
  if (has_nccl()) {
    absl::StatusOr<std::optional<std::vector<KvBlock>>> over =
        FetchOverNccl(&a, address, keys, first_layer, num_layers, stream);
    if (!over.ok()) return over.status();
    if (over->has_value()) return **std::move(over);
  }
  // The sequences in up to kFetchStreams groups, each over a connection of its own, at once: one
  // gRPC stream moves a few hundred MB/s, bound by its copies on one core.
  const size_t groups = std::min(keys.size(), kFetchStreams);
  std::vector<absl::StatusOr<std::vector<KvBlock>>> parts(groups);
  std::vector<std::thread> threads;
  for (size_t g = 0; g < groups; ++g) {
    threads.emplace_back([&, g] {
      const std::vector<uint64_t> group(keys.begin() + keys.size() * g / groups,
                                        keys.begin() + keys.size() * (g + 1) / groups);
      parts[g] = FetchGroup(a, address, group, first_layer, num_layers, static_cast<int>(g),
                            stream);
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<KvBlock> blocks;
  for (absl::StatusOr<std::vector<KvBlock>>& part : parts) {
    if (!part.ok()) return part.status();
    for (KvBlock& b : *part) blocks.push_back(std::move(b));
  }
  return blocks;
}

absl::StatusOr<std::vector<KvBlock>> KvMoves::FetchGroup(const Assignment& a,
                                                         const std::string& address,
                                                         const std::vector<uint64_t>& keys,
                                                         int first_layer, int num_layers,
                                                         int connection, WriteOutRef stream) {
  auto stub = KvStub(address, connection);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(5)));
  const v1::FetchKvRequest req = FetchRequest(keys, first_layer, num_layers, stream);
  const ModelConfig& c = a.engine->config();
  KvAssembler assembler({.first_layer = first_layer,
                         .num_layers = num_layers,
                         .num_kv_heads = c.num_kv_heads,
                         .head_dim = c.head_dim,
                         .max_positions = a.max_seq_len});
  std::unique_ptr<grpc::ClientReader<v1::KvChunk>> reader = stub->FetchKv(&ctx, req);
  v1::KvChunk chunk;
  absl::Status bad;
  while (reader->Read(&chunk)) {
    bad = assembler.Add(chunk);
    if (!bad.ok()) {
      ctx.TryCancel();
      break;
    }
  }
  const grpc::Status done = reader->Finish();
  auto from = [&address](absl::Status s) {
    return absl::Status(s.code(), absl::StrCat("KV from ", address, ": ", s.message()));
  };
  if (!bad.ok()) return from(bad);
  if (!done.ok()) return from(FromGrpcStatus(done));
  std::vector<KvBlock> blocks;
  for (uint64_t key : keys) {
    absl::StatusOr<KvBlock> b = assembler.Take(key);
    if (!b.ok()) return from(b.status());
    blocks.push_back(*std::move(b));
  }
  return blocks;
}

// ---------------------------------------------------------------------------------------------
// Sends over gRPC

absl::Status KvMoves::Send(const v1::FetchKvRequest& req, const KvChunkSink& sink) {
  if (!req.nccl_id().empty()) return SendOverNccl(req, sink);
  if (req.stream_step() != 0) return SendWrittenOut(req, sink);
  for (uint64_t key : req.keys()) {
    absl::StatusOr<std::shared_ptr<const KvBlock>> held = Stashed(key);
    if (!held.ok()) return held.status();
    // Kept on the GPU for NCCL; the host copy for this fetch only.
    absl::StatusOr<std::shared_ptr<const KvBlock>> block = OnHost(key, *std::move(held));
    if (!block.ok()) return block.status();
    absl::StatusOr<bool> sent =
        ForEachKvChunk(key, **block, kKvChunkBytes, sink.write, req.first_layer(),
                       req.num_layers());
    if (!sent.ok()) return OfSequence(key, sent.status());
    if (!*sent) return WentAway();
  }
  return absl::OkStatus();
}

absl::Status KvMoves::SendWrittenOut(const v1::FetchKvRequest& req, const KvChunkSink& sink) {
  const absl::Time deadline = WrittenOutDeadline(sink);
  for (uint64_t key : req.keys()) {
    absl::StatusOr<std::shared_ptr<KvOut>> out =
        WrittenOut(key, {req.stream_assignment(), req.stream_step()}, deadline);
    if (!out.ok()) return out.status();
    std::shared_ptr<const KvBlock> block(*out, &(*out)->block());
    if (block->on_device()) {
      // Over gRPC from device memory (no NCCL between the two): all layers, then one host copy.
      if (absl::Status st = (*out)->AwaitAll(deadline); !st.ok()) return OfSequence(key, st);
      absl::StatusOr<std::shared_ptr<const KvBlock>> host = OnHost(key, block);
      if (!host.ok()) return host.status();
      block = *std::move(host);
    }
    const int last = req.first_layer() + std::max(req.num_layers(), 0);
    for (int layer = req.first_layer(); layer < last; ++layer) {
      const int l = layer - block->first_layer;
      if (l >= 0 && l < block->num_layers) {
        if (absl::Status st = (*out)->Await(l, deadline); !st.ok()) return OfSequence(key, st);
      }
      absl::StatusOr<bool> sent = ForEachKvChunk(key, *block, kKvChunkBytes, sink.write, layer, 1);
      if (!sent.ok()) return OfSequence(key, sent.status());
      if (!*sent) return WentAway();
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem
