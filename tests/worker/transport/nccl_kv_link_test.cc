// NcclKvLink: two ranks on two GPUs in one process move KV-cache bytes byte for byte, large
// transfers at NVLink speed (printed, and recorded as a test property); a peer that never joins,
// a cancelled join and a receive that no send meets end in errors at the timeout instead of
// hanging, after which the link refuses further use. Skipped (reported SKIPPED) without 2 GPUs.
#include "worker/transport/nccl_kv_link.h"

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "worker/transport/nccl_transport.h"

namespace tandem {
namespace {

int GpuCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

#define REQUIRE_GPUS(n)                                                         \
  do {                                                                          \
    if (GpuCount() < (n))                                                       \
      GTEST_SKIP() << "needs " << (n) << " CUDA devices, found " << GpuCount(); \
  } while (0)

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

TEST(NcclKvLinkTest, BytesArriveExactlyAndLargeTransfersAreTimed) {
  REQUIRE_GPUS(2);
  Links links = JoinPair(absl::Seconds(30));
  ASSERT_NE(links.first, nullptr);
  for (const size_t bytes : {size_t{1} << 10, size_t{64} << 20, size_t{256} << 20}) {
    // A pattern that differs at every 4-byte word, made on the host.
    std::vector<uint32_t> want(bytes / 4);
    for (size_t i = 0; i < want.size(); ++i)
      want[i] = static_cast<uint32_t>(i * 2654435761u + bytes);
    absl::StatusOr<std::shared_ptr<uint8_t>> src = links.first->Allocate(bytes);
    absl::StatusOr<std::shared_ptr<uint8_t>> dst = links.second->Allocate(bytes);
    ASSERT_TRUE(src.ok() && dst.ok());
    ASSERT_EQ(cudaMemcpy(src->get(), want.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(dst->get(), 0, bytes), cudaSuccess);
    // Once to connect, then timed.
    const int rounds = bytes >= (size_t{64} << 20) ? 5 : 1;
    double seconds = 0;
    for (int r = 0; r <= rounds; ++r) {
      absl::Status sent;
      const auto t0 = std::chrono::steady_clock::now();
      std::thread t([&] { sent = links.first->Send(src->get(), bytes); });
      const absl::Status got = links.second->Recv(dst->get(), bytes);
      t.join();
      if (r > 0)
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ASSERT_TRUE(sent.ok()) << sent;
      ASSERT_TRUE(got.ok()) << got;
    }
    std::vector<uint32_t> back(want.size());
    ASSERT_EQ(cudaMemcpy(back.data(), dst->get(), bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(back, want) << bytes << " bytes";
    if (rounds > 1) {
      const double gb_s = static_cast<double>(bytes) * rounds / seconds / 1e9;
      std::printf("KV link: %zu MiB in %.3f ms, %.1f GB/s\n", bytes >> 20, seconds / rounds * 1e3,
                  gb_s);
      RecordProperty(bytes == (size_t{64} << 20) ? "gb_s_64mib" : "gb_s_256mib",
                     std::to_string(gb_s));
    }
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
  const absl::Status got = links.second->Recv(dst->get(), 1 << 20);
  EXPECT_EQ(got.code(), absl::StatusCode::kDeadlineExceeded) << got;
  EXPECT_TRUE(links.second->broken());
  const absl::Status again = links.second->Recv(dst->get(), 1 << 20);
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
