// A worker's KV-cache moves over NCCL (worker/service/kv_moves.h): sends of a stage's blocks to a
// fetching worker and fetches from one, layer by layer, with gRPC carrying only the handshake.
#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "proto/grpc_status.h"
#include "spdlog/spdlog.h"
#include "worker/service/kv_moves.h"
#include "worker/service/kv_moves_internal.h"
#include "worker/transport/grpc_transport.h"
#include "worker/transport/kv_wire.h"

namespace tandem {
namespace {

using namespace kv_moves_internal;

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
