// A worker's KV-cache moves (worker/service/kv_moves.h).
#include "worker/service/kv_moves.h"

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

// K and V bytes of one stash chunk at most: some MB, so that a fetch streams rather than
// building one message per sequence.
constexpr int64_t kKvChunkBytes = int64_t{16} << 20;
// Streams (and connections) one import fetches a worker's sequences over.
constexpr size_t kFetchStreams = 4;
// How long a fetch of a step's write-out waits for the step to open it, and then for each of its
// layers (the step may be queued behind others, each up to a long prompt).
constexpr absl::Duration kWrittenOutWait = absl::Seconds(60);

// Moves of a layout change are logged; the many small prefill hand-offs only at debug level.
spdlog::level::level_enum KvLogLevel(int64_t bytes, absl::Duration took) {
  return bytes >= (int64_t{64} << 20) || took >= absl::Milliseconds(100) ? spdlog::level::info
                                                                          : spdlog::level::debug;
}

// `s` with "sequence <key>: " before its message.
absl::Status OfSequence(uint64_t key, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat("sequence ", key, ": ", s.message()));
}

// Where the KV-cache of `s` is in a stage: its slot, and on a paged stage its pages.
KvPlace PlaceOf(const v1::KvSequence& s) {
  return KvPlace(s.slot(), {s.block_table().begin(), s.block_table().end()});
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

// The K and V of layer `l` of each of `blocks` (in device memory), as one transfer's buffers.
template <typename Pointer>
void LayerBuffers(const std::vector<KvBlock>& blocks, int l,
                  std::vector<std::pair<Pointer, size_t>>& out) {
  out.clear();
  for (const KvBlock& b : blocks) {
    const size_t layer_bytes = b.expected_bytes() / b.num_layers;
    out.emplace_back(b.device_k.get() + l * layer_bytes, layer_bytes);
    out.emplace_back(b.device_v.get() + l * layer_bytes, layer_bytes);
  }
}

// A chunk that says the sender is ready: to join a link (no layer), or to send `layer`.
v1::KvChunk NcclReady(int layer = 0, int num_layers = 0) {
  v1::KvChunk ready;
  ready.set_version(KvBlock::kVersion);
  ready.set_nccl(true);
  ready.set_layer(layer);
  ready.set_num_layers(num_layers);
  return ready;
}

}  // namespace

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

// ---------------------------------------------------------------------------------------------
// Sends over NCCL

absl::StatusOr<std::vector<KvBlock>> KvMoves::DeviceBlocks(
    const v1::FetchKvRequest& req, absl::Time deadline,
    std::vector<std::shared_ptr<KvOut>>& outs) {
  std::vector<KvBlock> blocks;
  for (uint64_t key : req.keys()) {
    absl::StatusOr<std::shared_ptr<const KvBlock>> held;
    if (req.stream_step() != 0) {
      absl::StatusOr<std::shared_ptr<KvOut>> out =
          WrittenOut(key, {req.stream_assignment(), req.stream_step()}, deadline);
      if (!out.ok()) return out.status();
      if (absl::Status failed = (*out)->Await(0, absl::InfinitePast());
          !failed.ok() && !absl::IsDeadlineExceeded(failed)) {
        return OfSequence(key, failed);  // not written out at all
      }
      outs.push_back(*out);
      held = std::shared_ptr<const KvBlock>(*out, &(*out)->block());
    } else {
      held = Stashed(key);
    }
    if (!held.ok()) return held.status();
    if (!(*held)->on_device()) {
      return absl::FailedPreconditionError(
          absl::StrCat("KV over NCCL: sequence ", key, " is stashed in host memory"));
    }
    absl::StatusOr<KvBlock> b = SliceKvLayers(**held, req.first_layer(), req.num_layers());
    if (!b.ok()) return OfSequence(key, b.status());
    blocks.push_back(*std::move(b));
  }
  return blocks;
}

absl::StatusOr<std::shared_ptr<KvMoves::HeldKvLink>> KvMoves::SendLink(
    const v1::FetchKvRequest& req) {
  absl::MutexLock lock(&kv_links_mu_);
  auto it = send_links_.find(req.nccl_id());
  if (it == send_links_.end()) {
    if (!req.nccl_join()) {
      return absl::FailedPreconditionError("KV over NCCL: no link of that id here (joined anew)");
    }
    it = send_links_.emplace(req.nccl_id(), std::make_shared<HeldKvLink>()).first;
  }
  return it->second;
}

absl::Status KvMoves::JoinSendLink(HeldKvLink& held, const v1::FetchKvRequest& req,
                                   const KvChunkSink& sink) {
  // Ready to send: the other worker joins on reading this.
  if (!sink.write(NcclReady())) {
    DropSendLink(held, req.nccl_id());
    return WentAway();
  }
  absl::StatusOr<std::unique_ptr<KvLink>> joined =
      options_.backend->JoinKvLink(req.nccl_id(), /*rank=*/0, sink.cancelled);
  if (!joined.ok()) {
    DropSendLink(held, req.nccl_id());
    return joined.status();
  }
  held.link = *std::move(joined);
  return absl::OkStatus();
}

void KvMoves::DropSendLink(HeldKvLink& held, const std::string& unique_id) {
  held.link.reset();
  absl::MutexLock links(&kv_links_mu_);
  send_links_.erase(unique_id);
}

absl::Status KvMoves::SendOverNccl(const v1::FetchKvRequest& req, const KvChunkSink& sink) {
  if (!has_nccl()) {
    return absl::FailedPreconditionError("KV over NCCL: this worker has no NCCL");
  }
  // Every sequence first, on the GPU, so that a refusal comes before anything moves. A step's
  // write-outs (stream_step) once the step has opened them: their layers are sent as it writes
  // them.
  std::vector<std::shared_ptr<KvOut>> outs;
  absl::StatusOr<std::vector<KvBlock>> blocks = DeviceBlocks(req, WrittenOutDeadline(sink), outs);
  if (!blocks.ok()) return blocks.status();
  absl::StatusOr<std::shared_ptr<HeldKvLink>> held = SendLink(req);
  if (!held.ok()) return held.status();
  HeldKvLink& link = **held;
  absl::MutexLock lock(&link.mu);
  if (link.link == nullptr) {
    if (absl::Status st = JoinSendLink(link, req, sink); !st.ok()) return st;
  }
  if (req.stream_step() != 0) return SendLayers(req, sink, link, *blocks, outs);
  // Every header, then every sequence's K and V as one NCCL transfer.
  std::vector<std::pair<const void*, size_t>> buffers;
  for (size_t i = 0; i < blocks->size(); ++i) {
    const KvBlock& b = (*blocks)[i];
    if (!sink.write(NcclKvHeader(req.keys(i), b))) {
      DropSendLink(link, req.nccl_id());
      return WentAway();
    }
    buffers.emplace_back(b.device_k.get(), b.expected_bytes());
    buffers.emplace_back(b.device_v.get(), b.expected_bytes());
  }
  if (absl::Status st = link.link->Send(buffers); !st.ok()) {
    DropSendLink(link, req.nccl_id());
    return st;
  }
  return absl::OkStatus();
}

absl::Status KvMoves::SendLayers(const v1::FetchKvRequest& req, const KvChunkSink& sink,
                                 HeldKvLink& held, const std::vector<KvBlock>& blocks,
                                 const std::vector<std::shared_ptr<KvOut>>& outs) {
  // Every header, then layer by layer one transfer of every sequence's K and V of that layer,
  // once the step has written it for all of them. A layer that is not written (the step failed)
  // is sent all the same, so that the link stays in step with the other worker, which the error
  // then reaches.
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (!sink.write(NcclKvHeader(req.keys(i), blocks[i]))) {
      DropSendLink(held, req.nccl_id());
      return WentAway();
    }
  }
  const absl::Time deadline = WrittenOutDeadline(sink);
  absl::Status unwritten;
  const int layers = blocks.empty() ? 0 : blocks[0].num_layers;
  std::vector<std::pair<const void*, size_t>> layer;
  const absl::Time t0 = absl::Now();
  absl::Time first_sent;
  int64_t bytes = 0;
  for (int l = 0; l < layers; ++l) {
    for (size_t i = 0; i < blocks.size() && unwritten.ok(); ++i) {
      unwritten = outs[i]->Await(blocks[i].first_layer - outs[i]->block().first_layer + l,
                                 deadline);
      if (!unwritten.ok()) unwritten = OfSequence(req.keys(i), unwritten);
    }
    LayerBuffers(blocks, l, layer);
    // The layer is there: the other worker posts its receive on this message, so that no NCCL
    // kernel waits on its GPU while the step computes.
    if (!sink.write(NcclReady(blocks[0].first_layer + l, 1))) {
      DropSendLink(held, req.nccl_id());
      return WentAway();
    }
    if (absl::Status st = held.link->Send(layer); !st.ok()) {
      DropSendLink(held, req.nccl_id());
      return st;
    }
    if (l == 0) first_sent = absl::Now();
    for (const auto& [p, n] : layer) bytes += static_cast<int64_t>(n);
  }
  const absl::Duration took = absl::Now() - t0;
  spdlog::log(KvLogLevel(bytes, took),
              "step {}: sent the write-out of {} sequence(s), {} bytes, layer by layer over NCCL "
              "in {:.3f} s (the first layer after {:.3f} s)",
              req.stream_step(), blocks.size(), bytes, absl::ToDoubleSeconds(took),
              absl::ToDoubleSeconds(first_sent - t0));
  return unwritten;
}

// ---------------------------------------------------------------------------------------------
// Fetches over NCCL

absl::StatusOr<std::optional<std::vector<KvBlock>>> KvMoves::FetchOverNccl(
    const Assignment* a, const std::string& address, const std::vector<uint64_t>& keys,
    int first_layer, int num_layers, WriteOutRef stream) {
  std::shared_ptr<HeldKvLink> held;
  {
    absl::MutexLock lock(&kv_links_mu_);
    std::shared_ptr<HeldKvLink>& slot = fetch_links_[address];
    if (slot == nullptr) slot = std::make_shared<HeldKvLink>();
    held = slot;
  }
  absl::MutexLock lock(&held->mu);
  if (held->unreachable) return std::nullopt;
  auto from = [&address](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("KV over NCCL from ", address, ": ", s.message()));
  };
  using Fetched = std::optional<std::vector<KvBlock>>;
  const bool join = held->link == nullptr;
  // Nothing asked but the link, which is there.
  if (!join && keys.empty()) return Fetched(std::in_place);
  if (join) {
    absl::StatusOr<std::string> id = options_.backend->MakeNcclId();
    if (!id.ok()) return from(id.status());
    held->unique_id = *id;
  }
  auto stub = KvStub(address, /*connection=*/0);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(5)));
  v1::FetchKvRequest req = FetchRequest(keys, first_layer, num_layers, stream);
  req.set_nccl_id(held->unique_id);
  req.set_nccl_join(join);
  // A new link: the other worker first checks that it can send everything and says so (a message
  // with no sequence), then both join; a refusal ends the stream before any message.
  std::unique_ptr<grpc::ClientReader<v1::KvChunk>> reader = stub->FetchKv(&ctx, req);
  v1::KvChunk chunk;
  const bool first = reader->Read(&chunk);
  auto fail = [&](const absl::Status& s) {
    held->link.reset();
    ctx.TryCancel();
    while (reader->Read(&chunk)) {
    }
    reader->Finish();
    return from(s);
  };
  if (!first) {
    // Nothing moved: over gRPC instead (which also names a sequence that is not stashed). A
    // worker that has no NCCL is not asked again.
    const grpc::Status done = reader->Finish();
    held->link.reset();
    if (absl::StrContains(done.error_message(), "has no NCCL")) held->unreachable = true;
    spdlog::debug("KV from {}: over gRPC ({})", address, done.error_message());
    return std::nullopt;
  }
  if (join) {
    if (!chunk.nccl() || chunk.num_layers() != 0) {
      return fail(absl::DataLossError("a sequence came before the link was joined"));
    }
    absl::StatusOr<std::unique_ptr<KvLink>> joined =
        options_.backend->JoinKvLink(held->unique_id, /*rank=*/1, nullptr);
    if (!joined.ok()) {
      held->unreachable = true;  // NCCL does not connect the two: gRPC from now on
      spdlog::warn("KV from {}: NCCL link not joined, over gRPC from now on: {}", address,
                   joined.status().ToString());
      return fail(joined.status());
    }
    held->link = *std::move(joined);
    if (!reader->Read(&chunk)) {
      const grpc::Status done = reader->Finish();
      // No sequence asked: the link was all (made ahead of the moves that will use it).
      if (done.ok() && keys.empty()) return Fetched(std::in_place);
      held->link.reset();
      return from(done.ok() ? absl::DataLossError("the stream ended after the link was joined")
                            : FromGrpcStatus(done));
    }
  }
  if (keys.empty()) return Fetched(std::in_place);
  // A stream that ended before all came: its status, or DATA_LOSS saying where it ended.
  auto ended = [&](const std::string& where) {
    const grpc::Status done = reader->Finish();
    held->link.reset();
    return from(done.ok() ? absl::DataLossError(absl::StrCat("the stream ended ", where))
                          : FromGrpcStatus(done));
  };
  if (keys.empty()) return Fetched(std::in_place);
  const ModelConfig& c = a->engine->config();
  const KvShape shape{.first_layer = first_layer,
                      .num_layers = num_layers,
                      .num_kv_heads = c.num_kv_heads,
                      .head_dim = c.head_dim,
                      .max_positions = a->max_seq_len};
  std::vector<KvBlock> blocks;
  if (absl::Status st = ReceiveOverNccl(*held, *reader, chunk, shape, keys, stream.step != 0,
                                        blocks, fail, ended);
      !st.ok()) {
    return st;
  }
  if (reader->Read(&chunk)) {
    return fail(absl::InvalidArgumentError("more sequences came than were asked for"));
  }
  const grpc::Status done = reader->Finish();
  if (!done.ok()) {
    held->link.reset();
    return from(FromGrpcStatus(done));
  }
  return Fetched(std::move(blocks));
}

absl::Status KvMoves::ReceiveOverNccl(HeldKvLink& held, grpc::ClientReader<v1::KvChunk>& reader,
                                      v1::KvChunk& chunk, const KvShape& shape,
                                      const std::vector<uint64_t>& keys, bool streamed,
                                      std::vector<KvBlock>& blocks, const FailFn& fail,
                                      const EndedFn& ended) {
  // Every header, then every sequence's K and V as one NCCL transfer into memory of this GPU.
  std::vector<std::pair<void*, size_t>> buffers;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i > 0 && !reader.Read(&chunk)) {
      return ended(absl::StrCat("after ", i, " of ", keys.size(), " sequences"));
    }
    if (chunk.key() != keys[i]) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("sequence ", chunk.key(), " came where ", keys[i], " was expected")));
    }
    absl::StatusOr<KvBlock> b = KvBlockOfNcclHeader(chunk, shape);
    if (!b.ok()) return fail(b.status());
    const size_t bytes = b->expected_bytes();
    absl::StatusOr<std::shared_ptr<uint8_t>> mem = held.link->Allocate(2 * bytes);
    if (!mem.ok()) return fail(mem.status());
    b->device_k = *mem;
    b->device_v = std::shared_ptr<uint8_t>(*mem, mem->get() + bytes);
    buffers.emplace_back(b->device_k.get(), bytes);
    buffers.emplace_back(b->device_v.get(), bytes);
    blocks.push_back(*std::move(b));
  }
  if (!streamed) {
    if (absl::Status st = held.link->Recv(buffers); !st.ok()) return fail(st);
    return absl::OkStatus();
  }
  // Layer by layer, every sequence's K and V of the layer at once, as the other worker's step
  // writes them (SendLayers).
  std::vector<std::pair<void*, size_t>> layer;
  for (int l = 0; l < shape.num_layers; ++l) {
    const int expected = shape.first_layer + l;
    // Posted once the other worker says the layer is written.
    if (!reader.Read(&chunk)) return ended(absl::StrCat("before layer ", expected));
    if (!chunk.nccl() || chunk.layer() != expected || chunk.num_layers() != 1) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("layer ", chunk.layer(), " (", chunk.num_layers(),
                       ") announced where layer ", expected, " was expected")));
    }
    LayerBuffers(blocks, l, layer);
    if (absl::Status st = held.link->Recv(layer); !st.ok()) return fail(st);
  }
  return absl::OkStatus();
}

}  // namespace tandem
