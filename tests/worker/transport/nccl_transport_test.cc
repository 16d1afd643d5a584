// NcclTransport: unique-id bytes and option checks (no GPU needed); a joining rank whose peer never
// comes gives up at its timeout (1 GPU); and, with two ranks on two GPUs in one process, frames
// arrive byte for byte, tokens come back, and a silent peer, a cancellation or a frame of another
// step abort the communicator instead of hanging. Skipped (reported SKIPPED) without the GPUs.
#include "worker/transport/nccl_transport.h"

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "common/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/transport/gpu_count.h"
#include "worker/cuda/cuda_stage.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

NcclTransportOptions Options(int rank, int world) {
  NcclTransportOptions o;
  o.device = rank;
  o.rank = rank;
  o.world = world;
  o.hidden_size = 64;
  o.dtype = DType::kF16;
  o.max_rows = 16;
  o.timeout = absl::Seconds(20);
  return o;
}

TEST(NcclUniqueIdTest, MadeIdsHaveTheNcclSizeAndDiffer) {
  absl::StatusOr<std::string> a = MakeNcclUniqueId();
  if (!a.ok()) GTEST_SKIP() << "NCCL cannot make a unique id here: " << a.status();
  absl::StatusOr<std::string> b = MakeNcclUniqueId();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->size(), kNcclUniqueIdBytes);
  EXPECT_TRUE(ValidateNcclUniqueId(*a).ok());
  EXPECT_NE(*a, *b);
}

TEST(NcclUniqueIdTest, WrongLengthsAreRejected) {
  for (size_t n : {size_t{0}, size_t{1}, kNcclUniqueIdBytes - 1, kNcclUniqueIdBytes + 1}) {
    const absl::Status st = ValidateNcclUniqueId(std::string(n, 'x'));
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << n;
    EXPECT_NE(st.message().find("128 bytes"), absl::string_view::npos) << st;
  }
  EXPECT_TRUE(ValidateNcclUniqueId(std::string(kNcclUniqueIdBytes, '\0')).ok());
}

TEST(NcclTransportOptionsTest, BadFieldsAreNamed) {
  struct Case {
    const char* field;
    void (*mutate)(NcclTransportOptions&);
  };
  const Case cases[] = {
      {"world", [](NcclTransportOptions& o) { o.world = 0; }},
      {"rank", [](NcclTransportOptions& o) { o.rank = -1; }},
      {"rank", [](NcclTransportOptions& o) { o.rank = 2; }},
      {"device", [](NcclTransportOptions& o) { o.device = -1; }},
      {"hidden_size", [](NcclTransportOptions& o) { o.hidden_size = 0; }},
      {"max_rows", [](NcclTransportOptions& o) { o.max_rows = 0; }},
      {"dtype", [](NcclTransportOptions& o) { o.dtype = static_cast<DType>(9); }},
      {"timeout", [](NcclTransportOptions& o) { o.timeout = absl::ZeroDuration(); }},
  };
  EXPECT_TRUE(ValidateNcclTransportOptions(Options(1, 2)).ok());
  for (const Case& c : cases) {
    NcclTransportOptions o = Options(1, 2);
    c.mutate(o);
    const absl::Status st = ValidateNcclTransportOptions(o);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(st.message().find(c.field), absl::string_view::npos) << st;
    // Create checks the same before it touches a device.
    EXPECT_EQ(NcclTransport::Create(o, std::string(kNcclUniqueIdBytes, '\0')).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(NcclTransportTest, CreateRejectsAnIdOfTheWrongLength) {
  const auto t = NcclTransport::Create(Options(0, 2), "short");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(NcclTransportTest, JoiningWithoutThePeerTimesOut) {
  REQUIRE_GPUS(1);
  absl::StatusOr<std::string> id = MakeNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  NcclTransportOptions o = Options(0, 2);
  o.timeout = absl::Seconds(2);
  const auto start = std::chrono::steady_clock::now();
  const auto t = NcclTransport::Create(o, *id);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kDeadlineExceeded) << t.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
}

// Both ranks of a 2-stage pipeline, joined from two threads of this process (GPUs 0 and 1), and
// closed from two threads (closing waits for the peer to close too).
struct Pair {
  std::unique_ptr<NcclTransport> first, last;
  Pair() = default;
  Pair(Pair&&) = default;
  ~Pair() {
    std::thread t([this] { first.reset(); });
    last.reset();
    t.join();
  }
};
Pair Join(absl::Duration timeout = absl::Seconds(20), int64_t max_rows = 16,
          cudaStream_t first_stream = nullptr, cudaStream_t last_stream = nullptr) {
  Pair p;
  absl::StatusOr<std::string> id = MakeNcclUniqueId();
  EXPECT_TRUE(id.ok()) << id.status();
  if (!id.ok()) return p;
  absl::StatusOr<std::unique_ptr<NcclTransport>> a, b;
  NcclTransportOptions oa = Options(0, 2), ob = Options(1, 2);
  oa.timeout = ob.timeout = timeout;
  oa.max_rows = ob.max_rows = max_rows;
  oa.stream = first_stream;
  ob.stream = last_stream;
  std::thread ta([&] { a = NcclTransport::Create(oa, *id); });
  std::thread tb([&] { b = NcclTransport::Create(ob, *id); });
  ta.join();
  tb.join();
  EXPECT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(b.ok()) << b.status();
  if (a.ok()) p.first = std::move(*a);
  if (b.ok()) p.last = std::move(*b);
  return p;
}

// [rows, 64] f16 activations in host memory whose values depend on the step and position.
Activations HostActivations(uint64_t step, int rows) {
  std::vector<float> f(static_cast<size_t>(rows) * 64);
  for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(step * 1000 + i % 997) / 64.0f;
  auto buf = std::shared_ptr<uint16_t[]>(new uint16_t[f.size() + 1]);
  FromFloat(DType::kF16, f.data(), f.size(), buf.get());
  Activations a;
  a.rows = rows;
  a.cols = 64;
  a.dtype = DType::kF16;
  a.where = Where::kHost;
  a.data = std::shared_ptr<void>(buf, buf.get());
  return a;
}

std::vector<uint16_t> ToHost(const Activations& a) {
  std::vector<uint16_t> h(static_cast<size_t>(a.rows * a.cols));
  if (!h.empty()) {
    EXPECT_EQ(cudaMemcpy(h.data(), a.data.get(), a.nbytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return h;
}

std::vector<uint16_t> Bytes(const Activations& a) {
  const auto* p = static_cast<const uint16_t*>(a.data.get());
  return std::vector<uint16_t>(p, p + a.rows * a.cols);
}

const auto kNever = [] { return false; };

// Rank 0 sends steps of `rows` rows (step s + 1, the third from device memory); rank 1 checks
// them byte for byte and returns rows[s] tokens, which rank 0 checks. With `posted`, rank 1 posts
// each receive (PostRecv) and reads the activations as a stage does: on a stream that waits for
// `ready`, then asks `arrival`.
void ExchangeAndCheck(Pair& p, const std::vector<int>& rows, bool posted = false) {
  std::thread sender([&] {
    cudaSetDevice(0);
    for (size_t s = 0; s < rows.size(); ++s) {
      Activations a = HostActivations(s + 1, rows[s]);
      if (s == 2) {  // one from device memory, as a CUDA stage returns it
        void* d = nullptr;
        ASSERT_EQ(cudaMalloc(&d, a.nbytes()), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(d, a.data.get(), a.nbytes(), cudaMemcpyHostToDevice), cudaSuccess);
        a.data = std::shared_ptr<void>(d, [](void* q) { cudaFree(q); });
        a.where = Where::kDevice;
      }
      ASSERT_TRUE(p.first->Send(s + 1, a).ok());
      auto tokens = p.first->RecvTokens(s + 1, kNever);
      ASSERT_TRUE(tokens.ok()) << tokens.status();
      EXPECT_EQ(*tokens, std::vector<int32_t>(rows[s], static_cast<int32_t>(s + 100)));
    }
  });
  cudaSetDevice(1);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (size_t s = 0; s < rows.size(); ++s) {
    auto a = posted ? p.last->PostRecv(s + 1, rows[s], kNever) : p.last->Recv(s + 1, kNever);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->rows, rows[s]);
    EXPECT_EQ(a->cols, 64);
    EXPECT_EQ(a->dtype, DType::kF16);
    EXPECT_EQ(a->where, Where::kDevice);
    if (posted) {
      ASSERT_NE(a->ready, nullptr);
      ASSERT_TRUE(a->arrival);
      std::vector<uint16_t> h(static_cast<size_t>(a->rows * a->cols));
      ASSERT_EQ(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(a->ready), 0), cudaSuccess);
      if (!h.empty()) {
        ASSERT_EQ(
            cudaMemcpyAsync(h.data(), a->data.get(), a->nbytes(), cudaMemcpyDeviceToHost, stream),
            cudaSuccess);
      }
      const absl::StatusOr<absl::Time> arrived = a->arrival();
      ASSERT_TRUE(arrived.ok()) << arrived.status();
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      EXPECT_EQ(h, Bytes(HostActivations(s + 1, rows[s]))) << "step " << s + 1;
    } else {
      EXPECT_EQ(ToHost(*a), Bytes(HostActivations(s + 1, rows[s]))) << "step " << s + 1;
    }
    ASSERT_TRUE(
        p.last->SendTokens(s + 1, std::vector<int32_t>(rows[s], static_cast<int32_t>(s + 100)))
            .ok());
  }
  sender.join();
  cudaStreamDestroy(stream);
}

TEST(NcclTransportTest, ActivationsAndTokensArriveIntact) {
  REQUIRE_GPUS(2);
  Pair p = Join();
  ASSERT_TRUE(p.first && p.last);
  ExchangeAndCheck(p, {16, 1, 7, 0, 3});  // a prefill, decodes, an empty step
  EXPECT_FALSE(p.first->aborted());
  EXPECT_FALSE(p.last->aborted());
}

// Frames larger than a first message (64 KiB of activations: 512 rows of hidden 64 in f16;
// 4 KiB of tokens: 1024) move in two messages; sizes on both sides of the boundary.
TEST(NcclTransportTest, FramesLargerThanTheFirstMessageArriveIntact) {
  REQUIRE_GPUS(2);
  Pair p = Join(absl::Seconds(20), /*max_rows=*/2048);
  ASSERT_TRUE(p.first && p.last);
  ExchangeAndCheck(p, {2048, 512, 513, 1, 1024, 1025, 0, 2047});
  EXPECT_FALSE(p.first->aborted());
  EXPECT_FALSE(p.last->aborted());
}

TEST(NcclTransportTest, PostedReceivesArriveIntact) {
  REQUIRE_GPUS(2);
  {
    Pair p = Join();
    ASSERT_TRUE(p.first && p.last);
    ExchangeAndCheck(p, {16, 1, 7, 0, 3}, /*posted=*/true);
    EXPECT_FALSE(p.last->aborted());
  }
  Pair p = Join(absl::Seconds(20), /*max_rows=*/2048);
  ASSERT_TRUE(p.first && p.last);
  ExchangeAndCheck(p, {2048, 512, 513, 1, 1024, 1025, 0, 2047}, /*posted=*/true);
  EXPECT_FALSE(p.first->aborted());
  EXPECT_FALSE(p.last->aborted());
}

// Both ranks move their token frames apart, at once (each joins the token communicator).
void Separate(Pair& p) {
  absl::Status a, b;
  std::thread t([&] { a = p.first->SeparateTokens(); });
  b = p.last->SeparateTokens();
  t.join();
  ASSERT_TRUE(a.ok()) << a;
  ASSERT_TRUE(b.ok()) << b;
}

std::vector<int32_t> TokensOf(uint64_t step, int count) {
  std::vector<int32_t> t(count);
  for (int k = 0; k < count; ++k) t[k] = static_cast<int32_t>(step * 10000 + k);
  return t;
}

// The first rank posts each step's token receive right after sending its activations, as a first
// stage fed by the last does; the last rank receives every step's activations before it sends the
// first step's tokens (one frame from device memory), so a posted token receive must never hold
// back the activations behind it. Counts on both sides of a first message (1,024 tokens) and 0.
TEST(NcclTransportTest, PostedTokenReceivesNeverHoldBackActivations) {
  REQUIRE_GPUS(2);
  Pair p = Join(absl::Seconds(20), /*max_rows=*/2048);
  ASSERT_TRUE(p.first && p.last);
  Separate(p);
  const std::vector<int> counts = {3, 0, 1025, 1, 1024, 16};
  std::thread first([&] {
    cudaSetDevice(0);
    std::vector<PostedTokens> posted;
    for (size_t s = 0; s < counts.size(); ++s) {
      ASSERT_TRUE(p.first->Send(s + 1, HostActivations(s + 1, 2)).ok());
      absl::StatusOr<PostedTokens> t = p.first->PostRecvTokens(s + 1, counts[s]);
      ASSERT_TRUE(t.ok()) << t.status();
      posted.push_back(*std::move(t));
    }
    for (size_t s = 0; s < counts.size(); ++s) {
      absl::StatusOr<std::vector<int32_t>> tokens = posted[s].take(kNever);
      ASSERT_TRUE(tokens.ok()) << tokens.status();
      EXPECT_EQ(*tokens, TokensOf(s + 1, counts[s])) << "step " << s + 1;
      EXPECT_TRUE(posted[s].arrived());
    }
  });
  cudaSetDevice(1);
  for (size_t s = 0; s < counts.size(); ++s) {
    absl::StatusOr<Activations> a = p.last->Recv(s + 1, kNever);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(ToHost(*a), Bytes(HostActivations(s + 1, 2))) << "step " << s + 1;
  }
  for (size_t s = 0; s < counts.size(); ++s) {
    const std::vector<int32_t> t = TokensOf(s + 1, counts[s]);
    if (s == 3) {
      int32_t* d = nullptr;
      ASSERT_EQ(cudaMalloc(&d, sizeof(int32_t)), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d, t.data(), sizeof(int32_t), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_TRUE(p.last->SendDeviceTokens(s + 1, d, 1).ok());
      ASSERT_TRUE(p.last->Watch().ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      cudaFree(d);
    } else {
      ASSERT_TRUE(p.last->SendTokens(s + 1, t).ok());
    }
  }
  first.join();
  EXPECT_FALSE(p.first->aborted());
  EXPECT_FALSE(p.last->aborted());
}

// A posted token receive whose frame holds another count or another step is DATA_LOSS, and the
// transport is aborted.
TEST(NcclTransportTest, PostedTokenReceiveOfAnotherCountIsDataLoss) {
  REQUIRE_GPUS(2);
  Pair p = Join(absl::Seconds(5));
  ASSERT_TRUE(p.first && p.last);
  // Posted receives only once token frames move apart, and then no waited ones.
  EXPECT_EQ(p.first->PostRecvTokens(1, 1).status().code(), absl::StatusCode::kFailedPrecondition);
  Separate(p);
  EXPECT_EQ(p.first->RecvTokens(1, kNever).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.last->PostRecvTokens(1, 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.first->PostRecvTokens(1, 17).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<PostedTokens> t = p.first->PostRecvTokens(1, 2);
  ASSERT_TRUE(t.ok()) << t.status();
  cudaSetDevice(1);
  ASSERT_TRUE(p.last->SendTokens(1, {4, 5, 6}).ok());
  cudaSetDevice(0);
  absl::StatusOr<std::vector<int32_t>> tokens = t->take(kNever);
  EXPECT_EQ(tokens.status().code(), absl::StatusCode::kDataLoss) << tokens.status();
  EXPECT_THAT(std::string(tokens.status().message()), HasSubstr("2 tokens"));
  EXPECT_TRUE(p.first->aborted());
  p.last->Abort(absl::CancelledError("test over"));
}

// A receive posted for a peer that never sends: `arrival` ends at the timeout, the communicator
// is aborted, and a stream queued behind `ready` drains instead of hanging.
TEST(NcclTransportTest, PostedReceiveFromASilentPeerEndsAndFreesTheStream) {
  REQUIRE_GPUS(2);
  Pair p = Join(absl::Seconds(2));
  ASSERT_TRUE(p.first && p.last);
  cudaSetDevice(1);
  auto a = p.last->PostRecv(1, 4, kNever);
  ASSERT_TRUE(a.ok()) << a.status();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(a->ready), 0), cudaSuccess);
  const absl::StatusOr<absl::Time> arrived = a->arrival();
  EXPECT_EQ(arrived.status().code(), absl::StatusCode::kDeadlineExceeded) << arrived.status();
  EXPECT_EQ(a->arrival().status(), arrived.status());  // remembered
  EXPECT_TRUE(p.last->aborted());
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
  EXPECT_EQ(p.last->PostRecv(2, 4, kNever).status().code(), absl::StatusCode::kFailedPrecondition);
}

// The header of a posted receive is checked against the step and the rows the receiver expected.
TEST(NcclTransportTest, PostedReceiveOfAnotherStepOrRowCountIsDataLoss) {
  REQUIRE_GPUS(2);
  {
    Pair p = Join(absl::Seconds(5));
    ASSERT_TRUE(p.first && p.last);
    std::thread sender([&] { EXPECT_TRUE(p.first->Send(1, HostActivations(1, 3)).ok()); });
    cudaSetDevice(1);
    auto a = p.last->PostRecv(1, 2, kNever);
    ASSERT_TRUE(a.ok()) << a.status();
    const absl::Status st = a->arrival().status();
    sender.join();
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
    EXPECT_NE(st.message().find("got 3 rows"), absl::string_view::npos) << st;
    EXPECT_TRUE(p.last->aborted());
  }
  Pair p = Join(absl::Seconds(5));
  ASSERT_TRUE(p.first && p.last);
  std::thread sender([&] { EXPECT_TRUE(p.first->Send(7, HostActivations(7, 2)).ok()); });
  cudaSetDevice(1);
  auto a = p.last->PostRecv(8, 2, kNever);
  ASSERT_TRUE(a.ok()) << a.status();
  const absl::Status st = a->arrival().status();
  sender.join();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(st.message().find("step 7"), absl::string_view::npos) << st;
  EXPECT_TRUE(p.last->aborted());
}

// A transport on a stream of the caller's (NcclTransportOptions::stream, as a stage shares its
// own): Send and SendDeviceTokens take device data that work queued earlier on that stream is
// still to write (here: behind a host function that sleeps), and what arrives is what that work
// wrote, not what the memory held when the call returned.
TEST(NcclTransportTest, OnTheCallersStreamSendsWhatWorkQueuedBeforeItWrites) {
  REQUIRE_GPUS(2);
  cudaStream_t s0 = nullptr, s1 = nullptr;
  cudaSetDevice(0);
  ASSERT_EQ(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking), cudaSuccess);
  cudaSetDevice(1);
  ASSERT_EQ(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), cudaSuccess);
  const auto sleep = [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); };
  {
    Pair p = Join(absl::Seconds(20), 16, s0, s1);
    ASSERT_TRUE(p.first && p.last);
    std::thread sender([&] {
      cudaSetDevice(0);
      void* d = nullptr;
      void* pinned = nullptr;
      ASSERT_EQ(cudaMalloc(&d, 16 * 64 * 2), cudaSuccess);
      ASSERT_EQ(cudaMallocHost(&pinned, 16 * 64 * 2), cudaSuccess);
      for (uint64_t step = 1; step <= 3; ++step) {
        const int rows = static_cast<int>(step) * 3;
        Activations a = HostActivations(step, rows);
        ASSERT_EQ(cudaMemset(d, 0, 16 * 64 * 2), cudaSuccess);
        std::memcpy(pinned, a.data.get(), a.nbytes());
        ASSERT_EQ(cudaLaunchHostFunc(s0, sleep, nullptr), cudaSuccess);
        ASSERT_EQ(cudaMemcpyAsync(d, pinned, a.nbytes(), cudaMemcpyHostToDevice, s0), cudaSuccess);
        a.data = std::shared_ptr<void>(d, [](void*) {});
        a.where = Where::kDevice;
        ASSERT_TRUE(p.first->Send(step, a).ok());
        auto tokens = p.first->RecvTokens(step, kNever);
        ASSERT_TRUE(tokens.ok()) << tokens.status();
        std::vector<int32_t> want(rows);
        for (int i = 0; i < rows; ++i) want[i] = static_cast<int32_t>(step * 100 + i);
        EXPECT_EQ(*tokens, want) << "step " << step;
      }
      cudaFreeHost(pinned);
      cudaFree(d);
    });
    cudaSetDevice(1);
    int32_t* d = nullptr;
    int32_t* pinned = nullptr;
    ASSERT_EQ(cudaMalloc(&d, 16 * sizeof(int32_t)), cudaSuccess);
    ASSERT_EQ(cudaMallocHost(&pinned, 16 * sizeof(int32_t)), cudaSuccess);
    for (uint64_t step = 1; step <= 3; ++step) {
      const int rows = static_cast<int>(step) * 3;
      auto a = p.last->PostRecv(step, rows, kNever);
      ASSERT_TRUE(a.ok()) << a.status();
      ASSERT_TRUE(a->arrival().ok());
      ASSERT_EQ(cudaStreamSynchronize(s1), cudaSuccess);
      EXPECT_EQ(ToHost(*a), Bytes(HostActivations(step, rows))) << "step " << step;
      ASSERT_EQ(cudaMemset(d, 0, 16 * sizeof(int32_t)), cudaSuccess);
      for (int i = 0; i < rows; ++i) pinned[i] = static_cast<int32_t>(step * 100 + i);
      ASSERT_EQ(cudaLaunchHostFunc(s1, sleep, nullptr), cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(d, pinned, rows * sizeof(int32_t), cudaMemcpyHostToDevice, s1),
                cudaSuccess);
      ASSERT_TRUE(p.last->SendDeviceTokens(step, d, rows).ok());
      ASSERT_EQ(cudaStreamSynchronize(s1), cudaSuccess);
    }
    sender.join();
    EXPECT_FALSE(p.first->aborted());
    EXPECT_FALSE(p.last->aborted());
    cudaFreeHost(pinned);
    cudaFree(d);
  }
  cudaStreamDestroy(s0);
  cudaStreamDestroy(s1);
}

// A stage waiting on the stream it shares with its transport polls Watch: a send the next stage
// never takes (here: rank 1 receives nothing, so the frames fill NCCL's buffers and a send stays
// queued) ends in DEADLINE_EXCEEDED and an abort at the timeout, after which the stream drains;
// while the sends complete, Watch is OK. UseStream is refused once a frame has moved.
TEST(NcclTransportTest, WatchEndsASendThePeerNeverTakes) {
  REQUIRE_GPUS(2);
  cudaStream_t s0 = nullptr;
  cudaSetDevice(0);
  ASSERT_EQ(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking), cudaSuccess);
  {
    Pair p = Join(absl::Seconds(3), /*max_rows=*/2048);
    ASSERT_TRUE(p.first && p.last);
    cudaSetDevice(0);
    ASSERT_TRUE(p.first->UseStream(s0).ok());
    void* d = nullptr;
    ASSERT_EQ(cudaMalloc(&d, 2048 * 64 * 2), cudaSuccess);
    Activations a = HostActivations(1, 2048);  // 256 KiB frames: two messages each
    a.data = std::shared_ptr<void>(d, [](void*) {});
    a.where = Where::kDevice;
    cudaEvent_t marker = nullptr;
    ASSERT_EQ(cudaEventCreate(&marker), cudaSuccess);
    bool stuck = false;
    for (uint64_t step = 1; step <= 400 && !stuck; ++step) {
      ASSERT_TRUE(p.first->Send(step, a).ok()) << "step " << step;
      ASSERT_EQ(cudaEventRecord(marker, s0), cudaSuccess);
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
      while (cudaEventQuery(marker) == cudaErrorNotReady) {
        if (std::chrono::steady_clock::now() > until) {
          stuck = true;
          break;
        }
      }
      if (!stuck) EXPECT_TRUE(p.first->Watch().ok()) << "step " << step;
    }
    ASSERT_TRUE(stuck) << "400 frames of 256 KiB all went out without a receiver";
    EXPECT_EQ(p.first->UseStream(s0).code(), absl::StatusCode::kFailedPrecondition);
    absl::Status watched;
    const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (watched.ok() && std::chrono::steady_clock::now() < limit) {
      watched = p.first->Watch();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(watched.code(), absl::StatusCode::kDeadlineExceeded) << watched;
    EXPECT_NE(watched.message().find("not taken by rank 1"), absl::string_view::npos) << watched;
    EXPECT_TRUE(p.first->aborted());
    EXPECT_EQ(p.first->Watch().code(), absl::StatusCode::kFailedPrecondition);
    // The abort ended the kernel: the stream drains.
    const auto drain = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (cudaEventQuery(marker) == cudaErrorNotReady &&
           std::chrono::steady_clock::now() < drain) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(cudaEventQuery(marker), cudaSuccess);
    cudaEventDestroy(marker);
    cudaFree(d);
    p.last->Abort(absl::CancelledError("test over"));
  }
  cudaStreamDestroy(s0);
}

TEST(NcclTransportTest, WrongDirectionsAndShapesAreRejected) {
  REQUIRE_GPUS(2);
  Pair p = Join();
  ASSERT_TRUE(p.first && p.last);
  EXPECT_EQ(p.last->Send(1, HostActivations(1, 2)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.first->Recv(1, kNever).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.first->PostRecv(1, 2, kNever).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.last->PostRecv(1, 17, kNever).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.last->PostRecv(1, -1, kNever).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.first->SendTokens(1, {1}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.last->RecvTokens(1, kNever).status().code(), absl::StatusCode::kFailedPrecondition);
  Activations wide = HostActivations(1, 2);
  wide.cols = 32;
  EXPECT_EQ(p.first->Send(1, wide).code(), absl::StatusCode::kInvalidArgument);
  Activations bf = HostActivations(1, 2);
  bf.dtype = DType::kBF16;
  EXPECT_EQ(p.first->Send(1, bf).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.first->Send(1, HostActivations(1, 17)).code(), absl::StatusCode::kInvalidArgument);
  Activations empty = HostActivations(1, 2);
  empty.data = nullptr;
  EXPECT_EQ(p.first->Send(1, empty).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.last->SendTokens(1, std::vector<int32_t>(17, 0)).code(),
            absl::StatusCode::kInvalidArgument);
  int32_t* device_tokens = nullptr;
  cudaSetDevice(1);
  ASSERT_EQ(cudaMalloc(&device_tokens, 17 * sizeof(int32_t)), cudaSuccess);
  EXPECT_EQ(p.first->SendDeviceTokens(1, device_tokens, 1).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.last->SendDeviceTokens(1, device_tokens, 17).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.last->SendDeviceTokens(1, device_tokens, -1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.last->SendDeviceTokens(1, nullptr, 2).code(), absl::StatusCode::kInvalidArgument);
  cudaFree(device_tokens);
  // None of these touched the communicator.
  EXPECT_FALSE(p.first->aborted());
  EXPECT_FALSE(p.last->aborted());
}

TEST(NcclTransportTest, SilentPeerEndsInDeadlineExceededAndAbort) {
  REQUIRE_GPUS(2);
  Pair p = Join(absl::Seconds(2));
  ASSERT_TRUE(p.first && p.last);
  const auto start = std::chrono::steady_clock::now();
  auto a = p.last->Recv(1, kNever);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kDeadlineExceeded) << a.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
  EXPECT_TRUE(p.last->aborted());
  EXPECT_EQ(p.last->Recv(2, kNever).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(NcclTransportTest, CancellationDuringARecvAborts) {
  REQUIRE_GPUS(2);
  Pair p = Join(absl::Seconds(5));
  ASSERT_TRUE(p.first && p.last);
  std::atomic<bool> cancel{false};
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    cancel = true;
  });
  auto a = p.last->Recv(1, [&] { return cancel.load(); });
  canceller.join();
  EXPECT_EQ(a.status().code(), absl::StatusCode::kCancelled) << a.status();
  EXPECT_TRUE(p.last->aborted());
  // A cancellation seen before anything was posted leaves the communicator alone.
  Pair q = Join(absl::Seconds(5));
  ASSERT_TRUE(q.first && q.last);
  EXPECT_EQ(q.last->Recv(1, [] { return true; }).status().code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(q.last->aborted());
}

TEST(NcclTransportTest, FrameOfAnotherStepIsDataLoss) {
  REQUIRE_GPUS(2);
  Pair p = Join(absl::Seconds(5));
  ASSERT_TRUE(p.first && p.last);
  std::thread sender([&] { EXPECT_TRUE(p.first->Send(7, HostActivations(7, 0)).ok()); });
  auto a = p.last->Recv(8, kNever);
  sender.join();
  EXPECT_EQ(a.status().code(), absl::StatusCode::kDataLoss) << a.status();
  EXPECT_NE(a.status().message().find("step 7"), absl::string_view::npos) << a.status();
  EXPECT_TRUE(p.last->aborted());
  EXPECT_EQ(p.last->Recv(9, kNever).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tandem
