// The one-shot all-reduce over peer memory (worker/cuda/peer_all_reduce.h) on two GPUs (skipped
// with fewer or without peer access): each rank's result equals the host's fp32 sum of the ranks'
// values in rank order rounded once, bit for bit, on every rank; for sizes of one element to the
// largest, fp16 and bf16; 1,000 calls in a row; a call captured in a CUDA graph and replayed with
// new inputs. And the latency of 64 calls in a graph (as a decode step makes them) against NCCL's
// all-reduce, printed.
#include "worker/cuda/peer_all_reduce.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::cuda {
namespace {

constexpr int kRanks = 2;
constexpr size_t kMax = 256 * 4096;

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

bool PeerAccess() {
  int a = 0, b = 0;
  cudaDeviceCanAccessPeer(&a, 0, 1);
  cudaDeviceCanAccessPeer(&b, 1, 0);
  return a != 0 && b != 0;
}

#define SKIP_WITHOUT_TWO_PEER_GPUS()                                                           \
  do {                                                                                         \
    if (DeviceCount() < 2) {                                                                   \
      GTEST_SKIP() << "the peer all-reduce needs 2 CUDA devices; this host has "               \
                   << DeviceCount();                                                           \
    }                                                                                          \
    if (!PeerAccess()) GTEST_SKIP() << "devices 0 and 1 have no peer access";                  \
  } while (0)

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

uint16_t Bits(float v, DType t) {
  if (t == DType::kF16) return static_cast<__half_raw>(__float2half_rn(v)).x;
  return static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(v)).x;
}

float Value(uint16_t u, DType t) {
  if (t == DType::kF16) {
    __half_raw r;
    r.x = u;
    return __half2float(__half(r));
  }
  __nv_bfloat16_raw r;
  r.x = u;
  return __bfloat162float(__nv_bfloat16(r));
}

// Per rank: a device buffer of kMax elements and a stream, on the rank's device.
struct Rank {
  void* x = nullptr;
  cudaStream_t stream = nullptr;
};

class PeerAllReduceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (DeviceCount() < 2 || !PeerAccess()) return;
    auto p = PeerAllReduce::Create(0, kRanks, kMax);
    ASSERT_TRUE(p.ok()) << p.status();
    ar_ = *std::move(p);
    for (int r = 0; r < kRanks; ++r) {
      cudaSetDevice(r);
      ASSERT_EQ(cudaMalloc(&ranks_[r].x, kMax * 2), cudaSuccess);
      ASSERT_EQ(cudaStreamCreateWithFlags(&ranks_[r].stream, cudaStreamNonBlocking), cudaSuccess);
    }
  }
  void TearDown() override {
    for (int r = 0; r < kRanks; ++r) {
      if (ranks_[r].x == nullptr) continue;
      cudaSetDevice(r);
      cudaStreamSynchronize(ranks_[r].stream);
      cudaFree(ranks_[r].x);
      cudaStreamDestroy(ranks_[r].stream);
    }
    ar_.reset();
  }

  // Random inputs per rank, copied in; the expected sums.
  std::vector<uint16_t> Fill(size_t n, DType t, uint32_t seed) {
    std::mt19937 g(seed);
    std::normal_distribution<float> d(0.0f, 4.0f);
    std::vector<float> sum(n, 0.0f);
    for (int r = 0; r < kRanks; ++r) {
      std::vector<uint16_t> in(n);
      for (size_t i = 0; i < n; ++i) {
        in[i] = Bits(d(g), t);
        sum[i] += Value(in[i], t);
      }
      cudaSetDevice(r);
      EXPECT_EQ(cudaMemcpy(ranks_[r].x, in.data(), n * 2, cudaMemcpyHostToDevice), cudaSuccess);
    }
    std::vector<uint16_t> want(n);
    for (size_t i = 0; i < n; ++i) want[i] = Bits(sum[i], t);
    return want;
  }

  void Launch(size_t n, DType t) {
    for (int r = 0; r < kRanks; ++r) {
      cudaSetDevice(r);
      ASSERT_TRUE(ar_->Run(r, ranks_[r].x, n, t, ranks_[r].stream).ok());
    }
  }

  // Every rank's result against `want`, bit for bit; names the first element that differs.
  void Expect(const std::vector<uint16_t>& want, const std::string& what) {
    for (int r = 0; r < kRanks; ++r) {
      cudaSetDevice(r);
      ASSERT_EQ(cudaStreamSynchronize(ranks_[r].stream), cudaSuccess) << what;
      std::vector<uint16_t> got(want.size());
      ASSERT_EQ(cudaMemcpy(got.data(), ranks_[r].x, want.size() * 2, cudaMemcpyDeviceToHost),
                cudaSuccess);
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(got[i], want[i]) << what << ": rank " << r << ", element " << i << " of "
                                   << want.size();
      }
    }
  }

  std::unique_ptr<PeerAllReduce> ar_;
  Rank ranks_[kRanks];
};

TEST_F(PeerAllReduceTest, EveryRankGetsTheRoundedFp32SumForEverySize) {
  SKIP_WITHOUT_TWO_PEER_GPUS();
  for (DType t : {DType::kF16, DType::kBF16}) {
    for (size_t n : {size_t{1}, size_t{7}, size_t{8}, size_t{4096}, size_t{4099}, size_t{8192},
                     size_t{64 * 4096}, kMax - 3, kMax}) {
      const std::vector<uint16_t> want = Fill(n, t, static_cast<uint32_t>(n));
      Launch(n, t);
      Expect(want, (t == DType::kF16 ? "f16 n=" : "bf16 n=") + std::to_string(n));
    }
  }
}

TEST_F(PeerAllReduceTest, AThousandCallsInARowEachSumItsOwnInputs) {
  SKIP_WITHOUT_TWO_PEER_GPUS();
  for (int call = 0; call < 1000; ++call) {
    const size_t n = 4096 * (1 + call % 4);
    const std::vector<uint16_t> want = Fill(n, DType::kF16, 1000 + call);
    Launch(n, DType::kF16);
    if (call % 97 == 0 || call == 999) Expect(want, "call " + std::to_string(call));
  }
}

TEST_F(PeerAllReduceTest, AGraphOfTheCallReplaysWithNewInputs) {
  SKIP_WITHOUT_TWO_PEER_GPUS();
  constexpr size_t n = 8192;
  cudaGraphExec_t exec[kRanks];
  for (int r = 0; r < kRanks; ++r) {
    cudaSetDevice(r);
    cudaGraph_t g;
    CUDA_OK(cudaStreamBeginCapture(ranks_[r].stream, cudaStreamCaptureModeThreadLocal));
    ASSERT_TRUE(ar_->Run(r, ranks_[r].x, n, DType::kF16, ranks_[r].stream).ok());
    CUDA_OK(cudaStreamEndCapture(ranks_[r].stream, &g));
    CUDA_OK(cudaGraphInstantiate(&exec[r], g, 0));
    cudaGraphDestroy(g);
  }
  for (int replay = 0; replay < 100; ++replay) {
    const std::vector<uint16_t> want = Fill(n, DType::kF16, 5000 + replay);
    for (int r = 0; r < kRanks; ++r) {
      cudaSetDevice(r);
      CUDA_OK(cudaGraphLaunch(exec[r], ranks_[r].stream));
    }
    Expect(want, "replay " + std::to_string(replay));
  }
  // Calls outside the graph keep working after its replays (the epochs are the device's).
  const std::vector<uint16_t> want = Fill(100, DType::kF16, 77);
  Launch(100, DType::kF16);
  Expect(want, "a call after the replays");
  for (int r = 0; r < kRanks; ++r) {
    cudaSetDevice(r);
    cudaGraphExecDestroy(exec[r]);
  }
}

TEST_F(PeerAllReduceTest, RefusesWhatItCannotDo) {
  SKIP_WITHOUT_TWO_PEER_GPUS();
  cudaSetDevice(0);
  EXPECT_FALSE(ar_->Run(0, ranks_[0].x, kMax + 8, DType::kF16, ranks_[0].stream).ok());
  EXPECT_FALSE(ar_->Run(0, ranks_[0].x, 8, DType::kF32, ranks_[0].stream).ok());
  EXPECT_FALSE(ar_->Run(2, ranks_[0].x, 8, DType::kF16, ranks_[0].stream).ok());
  EXPECT_FALSE(ar_->Run(0, static_cast<char*>(ranks_[0].x) + 2, 8, DType::kF16,
                        ranks_[0].stream).ok());
  EXPECT_FALSE(PeerAllReduce::Create(0, 1, 8).ok());
}

// Microseconds per all-reduce of `bytes` in a graph of 64 calls (a decode step's count for a
// 32-layer model), peer against NCCL. Printed, not asserted.
TEST_F(PeerAllReduceTest, PrintsLatencyAgainstNccl) {
  SKIP_WITHOUT_TWO_PEER_GPUS();
  // Connections made at init (not at the first collective, which one thread driving both ranks
  // would wait on), then one all-reduce over both ranks as a group.
  setenv("NCCL_RUNTIME_CONNECT", "0", 0);
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  ncclComm_t comms[kRanks];
  int devices[kRanks] = {0, 1};
  ASSERT_EQ(ncclCommInitAll(comms, kRanks, devices), ncclSuccess);
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(ncclAllReduce(ranks_[r].x, ranks_[r].x, 8, ncclFloat16, ncclSum, comms[r],
                            ranks_[r].stream),
              ncclSuccess);
  }
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
  for (int r = 0; r < kRanks; ++r) {
    cudaSetDevice(r);
    CUDA_OK(cudaStreamSynchronize(ranks_[r].stream));
  }
  std::printf("| message | peer us/call | NCCL us/call |\n|---|---|---|\n");
  for (size_t bytes : {size_t{2048}, size_t{16384}, size_t{65536}, size_t{262144}, size_t{524288}}) {
    const size_t n = bytes / 2;
    double us[2];
    for (int which = 0; which < 2; ++which) {
      cudaGraphExec_t exec[kRanks];
      for (int r = 0; r < kRanks; ++r) {
        cudaSetDevice(r);
        cudaGraph_t g;
        CUDA_OK(cudaStreamBeginCapture(ranks_[r].stream, cudaStreamCaptureModeThreadLocal));
        for (int c = 0; c < 64; ++c) {
          if (which == 0) {
            ASSERT_TRUE(ar_->Run(r, ranks_[r].x, n, DType::kF16, ranks_[r].stream).ok());
          } else {
            ASSERT_EQ(ncclAllReduce(ranks_[r].x, ranks_[r].x, n, ncclFloat16, ncclSum, comms[r],
                                    ranks_[r].stream),
                      ncclSuccess);
          }
        }
        CUDA_OK(cudaStreamEndCapture(ranks_[r].stream, &g));
        CUDA_OK(cudaGraphInstantiate(&exec[r], g, 0));
        cudaGraphDestroy(g);
      }
      Fill(n, DType::kF16, 1);  // small values: repeated sums stay finite enough
      cudaEvent_t start, stop;
      cudaSetDevice(0);
      cudaEventCreate(&start);
      cudaEventCreate(&stop);
      constexpr int kReps = 20;
      for (int rep = -2; rep < kReps; ++rep) {
        if (rep == 0) {
          cudaSetDevice(0);
          cudaEventRecord(start, ranks_[0].stream);
        }
        for (int r = 0; r < kRanks; ++r) {
          cudaSetDevice(r);
          CUDA_OK(cudaGraphLaunch(exec[r], ranks_[r].stream));
        }
      }
      cudaSetDevice(0);
      cudaEventRecord(stop, ranks_[0].stream);
      for (int r = 0; r < kRanks; ++r) {
        cudaSetDevice(r);
        CUDA_OK(cudaStreamSynchronize(ranks_[r].stream));
      }
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      us[which] = 1000.0 * ms / (kReps * 64);
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
      for (int r = 0; r < kRanks; ++r) {
        cudaSetDevice(r);
        cudaGraphExecDestroy(exec[r]);
      }
    }
    std::printf("| %zu KB | %.2f | %.2f |\n", bytes / 1024, us[0], us[1]);
  }
  for (ncclComm_t c : comms) ncclCommDestroy(c);
}

}  // namespace
}  // namespace tandem::cuda
