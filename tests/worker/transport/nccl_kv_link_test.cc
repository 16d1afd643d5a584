// NcclKvLink: two ranks on two GPUs in one process move KV-cache bytes byte for byte, large
// transfers at NVLink speed (printed, and recorded as a test property); a peer that never joins,
// a cancelled join and a receive that no send meets end in errors at the timeout instead of
// hanging, after which the link refuses further use. Skipped (reported SKIPPED) without 2 GPUs.
#include "worker/transport/nccl_kv_link.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/worker/transport/gpu_count.h"
#include "worker/transport/nccl_transport.h"

namespace tandem {
namespace {

using Links = std::pair<std::unique_ptr<NcclKvLink>, std::unique_ptr<NcclKvLink>>;

// Rank 0 on device 0 and rank 1 on device 1, joined from two threads.
Links JoinPair(absl::Duration timeout) {
  absl::StatusOr<std::string> id = MakeNcclUniqueId();
  EXPECT_TRUE(id.ok()) << id.status();
  if (!id.ok()) return {};
  absl::StatusOr<std::unique_ptr<NcclKvLink>> a = absl::UnknownError("");
  std::thread t([&] { a = NcclKvLink::Join(0, 0, *id, timeout); });
  absl::StatusOr<std::unique_ptr<NcclKvLink>> b = NcclKvLink::Join(1, 1, *id, timeout);
  t.join();
  EXPECT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(b.ok()) << b.status();
  if (!a.ok() || !b.ok()) return {};
  return {*std::move(a), *std::move(b)};
}

// Seconds per round of `rounds` sends of `sizes` from a to b (after one round to connect), and
// whether every byte arrived.
struct Timed {
  double seconds = 0;
  bool exact = false;
};
Timed SendAndCheck(Links& links, const std::vector<size_t>& sizes, int rounds) {
  Timed out;
  std::vector<std::shared_ptr<uint8_t>> src, dst;
  std::vector<std::pair<const void*, size_t>> send;
  std::vector<std::pair<void*, size_t>> recv;
  std::vector<std::vector<uint32_t>> want;
  for (size_t n = 0; n < sizes.size(); ++n) {
    const size_t bytes = sizes[n];
    // A pattern that differs at every 4-byte word and between buffers, made on the host.
    want.emplace_back(bytes / 4);
    for (size_t i = 0; i < want.back().size(); ++i) {
      want.back()[i] = static_cast<uint32_t>(i * 2654435761u + n * 7919u + bytes);
    }
    absl::StatusOr<std::shared_ptr<uint8_t>> a = links.first->Allocate(bytes);
    absl::StatusOr<std::shared_ptr<uint8_t>> b = links.second->Allocate(bytes);
    EXPECT_TRUE(a.ok() && b.ok());
    if (!a.ok() || !b.ok()) return out;
    EXPECT_EQ(cudaMemcpy(a->get(), want.back().data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemset(b->get(), 0, bytes), cudaSuccess);
    src.push_back(*a);
    dst.push_back(*b);
    send.emplace_back(a->get(), bytes);
    recv.emplace_back(b->get(), bytes);
  }
  // One round to connect, then `rounds` timed, each transfer waited for on both sides (as a fetch
  // does), the sender on a thread of its own for all of them.
  absl::Status sent;
  absl::Status got;
  std::thread sender([&] {
    for (int r = 0; r <= rounds && sent.ok(); ++r) sent = links.first->Send(send);
  });
  got = links.second->Recv(recv);
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < rounds && got.ok(); ++r) got = links.second->Recv(recv);
  out.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / rounds;
  sender.join();
  EXPECT_TRUE(sent.ok()) << sent;
  EXPECT_TRUE(got.ok()) << got;
  if (!sent.ok() || !got.ok()) return out;
  out.exact = true;
  for (size_t n = 0; n < sizes.size(); ++n) {
    std::vector<uint32_t> back(want[n].size());
    EXPECT_EQ(cudaMemcpy(back.data(), dst[n].get(), sizes[n], cudaMemcpyDeviceToHost), cudaSuccess);
    out.exact = out.exact && back == want[n];
  }
  return out;
}

// The floor: ncclSend/ncclRecv of one buffer on a blocking communicator of the same two GPUs,
// timed with CUDA events around the operations only (GB/s).
double PlainNcclGbPerSecond(size_t bytes, int rounds) {
  absl::StatusOr<std::string> id_bytes = MakeNcclUniqueId();
  if (!id_bytes.ok()) return 0;
  ncclUniqueId id;
  std::memcpy(&id, id_bytes->data(), sizeof(id));
  double ms = 0;
  auto rank = [&](int r) {
    cudaSetDevice(r);
    ncclComm_t comm = nullptr;
    if (ncclCommInitRank(&comm, 2, id, r) != ncclSuccess) return;
    void* buf = nullptr;
    cudaStream_t stream;
    cudaEvent_t start, stop;
    cudaMalloc(&buf, bytes);
    cudaStreamCreate(&stream);
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    for (int i = 0; i <= rounds; ++i) {
      if (i == 1) cudaEventRecord(start, stream);
      if (r == 0) ncclSend(buf, bytes, ncclUint8, 1, comm, stream);
      if (r == 1) ncclRecv(buf, bytes, ncclUint8, 0, comm, stream);
    }
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float elapsed = 0;
    cudaEventElapsedTime(&elapsed, start, stop);
    if (r == 1) ms = elapsed / rounds;
    ncclCommDestroy(comm);
    cudaFree(buf);
    cudaStreamDestroy(stream);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  };
  std::thread t(rank, 0);
  rank(1);
  t.join();
  return ms > 0 ? static_cast<double>(bytes) / (ms * 1e-3) / 1e9 : 0;
}

TEST(NcclKvLinkTest, BytesArriveExactlyAndLargeTransfersAreTimed) {
  REQUIRE_GPUS(2);
  Links links = JoinPair(absl::Seconds(30));
  ASSERT_NE(links.first, nullptr);
  EXPECT_TRUE(SendAndCheck(links, {size_t{1} << 10}, 1).exact);
  // One buffer of 64 and of 256 MiB; 32 of 10.6 MB (the K and V of 16 sequences of the
  // openllama-3b shape, 64 positions each: a prefill hand-off) as one transfer.
  const std::vector<std::pair<const char*, std::vector<size_t>>> cases = {
      {"64mib", {size_t{64} << 20}},
      {"256mib", {size_t{256} << 20}},
      {"32x10.6mb", std::vector<size_t>(32, size_t{26} * 64 * 3200 * 2)}};
  for (const auto& [name, sizes] : cases) {
    const Timed t = SendAndCheck(links, sizes, 5);
    EXPECT_TRUE(t.exact) << name;
    size_t bytes = 0;
    for (size_t b : sizes) bytes += b;
    const double gb_s = static_cast<double>(bytes) / t.seconds / 1e9;
    const double floor = PlainNcclGbPerSecond(bytes, 5);
    std::printf(
        "KV link: %s (%.1f MB) in %.3f ms, %.1f GB/s; plain ncclSend/ncclRecv of %.1f MB: "
        "%.1f GB/s (%.0f%%)\n",
        name, bytes / 1e6, t.seconds * 1e3, gb_s, bytes / 1e6, floor,
        floor > 0 ? 100 * gb_s / floor : 0.0);
    RecordProperty(std::string("gb_s_") + name, std::to_string(gb_s));
    RecordProperty(std::string("floor_gb_s_") + name, std::to_string(floor));
  }
}

TEST(NcclKvLinkTest, APeerThatNeverJoinsEndsAtTheTimeout) {
  REQUIRE_GPUS(1);
  absl::StatusOr<std::string> id = MakeNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<NcclKvLink>> l = NcclKvLink::Join(0, 1, *id, absl::Seconds(2));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(l.status().code(), absl::StatusCode::kDeadlineExceeded) << l.status();
  EXPECT_LT(took, 30.0);
}

TEST(NcclKvLinkTest, ACancelledJoinEndsAtOnce) {
  REQUIRE_GPUS(1);
  absl::StatusOr<std::string> id = MakeNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  std::atomic<bool> cancel{false};
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    cancel = true;
  });
  absl::StatusOr<std::unique_ptr<NcclKvLink>> l =
      NcclKvLink::Join(0, 0, *id, absl::Seconds(120), [&] { return cancel.load(); });
  t.join();
  EXPECT_EQ(l.status().code(), absl::StatusCode::kCancelled) << l.status();
}

TEST(NcclKvLinkTest, AReceiveNoSendMeetsBreaksTheLinkAtTheTimeout) {
  REQUIRE_GPUS(2);
  Links links = JoinPair(absl::Seconds(2));
  ASSERT_NE(links.first, nullptr);
  absl::StatusOr<std::shared_ptr<uint8_t>> dst = links.second->Allocate(1 << 20);
  ASSERT_TRUE(dst.ok());
  const std::pair<void*, size_t> one[] = {{dst->get(), size_t{1} << 20}};
  const absl::Status got = links.second->Recv(one);
  EXPECT_EQ(got.code(), absl::StatusCode::kDeadlineExceeded) << got;
  EXPECT_TRUE(links.second->broken());
  const absl::Status again = links.second->Recv(one);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  EXPECT_FALSE(links.first->broken());
}

TEST(NcclKvLinkTest, BadArgumentsAreRefusedBeforeJoining) {
  EXPECT_EQ(NcclKvLink::Join(0, 0, "short", absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclKvLink::Join(0, 2, std::string(kNcclUniqueIdBytes, 'x'), absl::Seconds(1))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem
