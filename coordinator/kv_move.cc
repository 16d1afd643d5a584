// The Worker RPCs of a move, made on every stage at once (kv_move.h).
#include "coordinator/kv_move.h"

#include <algorithm>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "proto/grpc_status.h"
#include "proto/tandem.grpc.pb.h"
#include "spdlog/spdlog.h"

namespace tandem {
namespace {

// Runs `call(i)` for every stage at once; the first failure (in stage order).
absl::Status ForEachStage(size_t n, const std::function<absl::Status(size_t)>& call) {
  std::vector<absl::Status> results(n);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) threads.emplace_back([&, i] { results[i] = call(i); });
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status FromGrpc(const grpc::Status& s, const char* rpc, const KvStage& stage) {
  const absl::Status a = FromGrpcStatus(s);
  if (a.ok()) return a;
  return absl::Status(a.code(), absl::StrCat(rpc, " on worker ", stage.worker, " (",
                                             stage.address, "): ", a.message()));
}

}  // namespace

std::vector<v1::KvSource> KvSourcesFor(const KvStage& taker, std::span<const KvStage> holders) {
  std::vector<v1::KvSource> out;
  for (const KvStage& h : holders) {
    const int first = std::max(taker.layers.first, h.layers.first);
    const int last = std::min(taker.layers.last, h.layers.last);
    if (first >= last) continue;
    v1::KvSource s;
    if (h.worker != taker.worker) s.set_address(h.address);
    s.set_assignment_id(h.assignment);
    s.set_first_layer(first);
    s.set_num_layers(last - first);
    out.push_back(std::move(s));
  }
  std::sort(out.begin(), out.end(), [](const v1::KvSource& a, const v1::KvSource& b) {
    return a.first_layer() < b.first_layer();
  });
  return out;
}

absl::Status ExportKvAll(std::span<const KvStage> holders, std::span<const KvSeq> seqs,
                         absl::Duration timeout) {
  return ForEachStage(holders.size(), [&](size_t i) {
    const KvStage& h = holders[i];
    v1::ExportKvRequest req;
    req.set_assignment_id(h.assignment);
    req.set_device(true);  // kept on the GPU where the worker can send it over NCCL
    for (const KvSeq& s : seqs) {
      v1::KvSequence* m = req.add_seqs();
      m->set_key(s.key);
      m->set_slot(s.slot);
      m->set_positions(s.positions);
      m->mutable_block_table()->Add(s.block_table.begin(), s.block_table.end());
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    v1::ExportKvResponse resp;
    return FromGrpc(v1::Worker::NewStub(h.channel)->ExportKv(&ctx, req, &resp), "ExportKv", h);
  });
}

absl::StatusOr<int64_t> ImportKvAll(std::span<const KvStage> takers,
                                    std::span<const KvStage> holders, std::span<const KvSeq> seqs,
                                    absl::Duration timeout, uint64_t stream_step) {
  absl::Mutex mu;
  int64_t bytes = 0;
  absl::Status s = ForEachStage(takers.size(), [&](size_t i) {
    const KvStage& t = takers[i];
    v1::ImportKvRequest req;
    req.set_assignment_id(t.assignment);
    req.set_stream_step(stream_step);
    for (const KvSeq& q : seqs) {
      v1::KvSequence* m = req.add_seqs();
      m->set_key(q.key);
      m->set_slot(q.slot);
      m->mutable_block_table()->Add(q.block_table.begin(), q.block_table.end());
    }
    for (v1::KvSource& src : KvSourcesFor(t, holders)) *req.add_sources() = std::move(src);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    v1::ImportKvResponse resp;
    absl::Status st =
        FromGrpc(v1::Worker::NewStub(t.channel)->ImportKv(&ctx, req, &resp), "ImportKv", t);
    if (st.ok()) {
      absl::MutexLock lock(&mu);
      bytes += resp.bytes();
    }
    return st;
  });
  if (!s.ok()) return s;
  return bytes;
}

void DropKvAll(std::span<const KvStage> holders, std::span<const KvSeq> seqs) {
  v1::DropKvRequest req;
  for (const KvSeq& s : seqs) req.add_keys(s.key);
  (void)ForEachStage(holders.size(), [&](size_t i) {
    const KvStage& h = holders[i];
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::DropKvResponse resp;
    absl::Status s =
        FromGrpc(v1::Worker::NewStub(h.channel)->DropKv(&ctx, req, &resp), "DropKv", h);
    if (!s.ok()) spdlog::warn("{}", s.ToString());
    return absl::OkStatus();
  });
}

}  // namespace tandem
