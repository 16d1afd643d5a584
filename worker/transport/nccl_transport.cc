// NcclTransport: framed ncclSend/ncclRecv between neighbouring stages on a blocking data
// communicator joined through a non-blocking root one; every wait polls a CUDA event and the
// communicators' async errors against a deadline.
#include "worker/transport/nccl_transport.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_check.h"

namespace tandem {
namespace {

static_assert(kNcclUniqueIdBytes == NCCL_UNIQUE_ID_BYTES);
static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES);

using Clock = std::chrono::steady_clock;

absl::Status NcclError(ncclResult_t r, const char* expr, const char* file, int line,
                       ncclComm_t comm) {
  const char* last = comm != nullptr ? ncclGetLastError(comm) : ncclGetLastError(nullptr);
  return absl::InternalError(absl::StrCat("NCCL error ", ncclGetErrorString(r), " in ", expr,
                                          " at ", file, ":", line,
                                          last != nullptr && *last ? ": " : "",
                                          last != nullptr ? last : ""));
}

}  // namespace
}  // namespace tandem

// A blocking NCCL call outside a communicator (ncclGetUniqueId); returns INTERNAL naming it.
#define NCCL_CHECK(expr)                                                                    \
  do {                                                                                      \
    ncclResult_t _tandem_nccl_r = (expr);                                                   \
    if (_tandem_nccl_r != ncclSuccess)                                                      \
      return ::tandem::NcclError(_tandem_nccl_r, #expr, __FILE__, __LINE__, nullptr);       \
  } while (0)

// A call on one of the transport's communicators: ncclInProgress (the non-blocking root) is waited
// out, bounded by the timeout; any failure aborts both communicators.
#define NCCL_ISSUE(state, expr) RETURN_IF_ERROR((state).Issue((expr), #expr, __FILE__, __LINE__))
#define NCCL_ISSUE_C(state, expr, cancelled) \
  RETURN_IF_ERROR((state).Issue((expr), #expr, __FILE__, __LINE__, &(cancelled)))

namespace tandem {
namespace {

// The frame header: 64 bytes, the same layout on every rank (one build, one architecture).
constexpr uint64_t kFrameMagic = 0x314e4d45444e4154ull;  // "TANDEMN1", little-endian
enum FrameKind : uint32_t { kActivationFrame = 1, kTokenFrame = 2 };
struct FrameHeader {
  uint64_t magic;
  uint64_t step_id;
  int64_t rows;
  int64_t cols;
  uint32_t kind;
  uint32_t dtype;
  uint64_t reserved[3];
};
static_assert(sizeof(FrameHeader) == 64);

// A frame in device memory: [kHeaderRegion bytes, the header first][payload]. 256 bytes keep the
// payload as aligned as cudaMalloc's memory for the kernels that read it.
constexpr size_t kHeaderRegion = 256;
// Payload bytes in a frame's first message, whose size is fixed so that the receiver can post it
// before it knows the step's size: a decode step of up to 10 rows of hidden 3200 in f16, or 1024
// tokens. The same constants on every rank, whatever its options.
constexpr size_t kInlineActivationBytes = 64 << 10;
constexpr size_t kInlineTokenBytes = 4 << 10;

size_t InlineBytes(uint32_t kind) {
  return kind == kActivationFrame ? kInlineActivationBytes : kInlineTokenBytes;
}

std::chrono::nanoseconds ToChrono(absl::Duration d) {
  return std::chrono::nanoseconds(absl::ToInt64Nanoseconds(d));
}

const char* KindName(uint32_t kind) {
  return kind == kActivationFrame ? "activations" : kind == kTokenFrame ? "tokens" : "unknown";
}

// A blocking NCCL step (joining or closing the data communicator) run on a thread of its own, so
// that the caller can give up at a deadline. ncclCommAbort may not be called on a communicator
// whose blocking init is still running in another thread (NCCL would free it under that thread),
// so a step past its deadline is abandoned instead: its thread stays blocked until the peer's
// sockets close, and cleans up after itself if it ever finishes.
class BoundedNcclStep {
 public:
  // `fn` runs on the new thread with a flag that turns true once the caller has given up;
  // `undo` (if any) runs there when `fn` succeeded after the caller gave up.
  explicit BoundedNcclStep(std::function<absl::Status(const std::atomic<bool>& abandoned)> fn,
                           std::function<void()> undo = nullptr)
      : shared_(std::make_shared<Shared>()) {
    std::thread([shared = shared_, fn = std::move(fn), undo = std::move(undo)] {
      absl::Status st = fn(shared->abandoned);
      bool late = false;
      {
        std::lock_guard<std::mutex> lock(shared->mu);
        late = shared->abandoned && st.ok();
        shared->status = std::move(st);
        shared->done = true;
        shared->cv.notify_all();
      }
      if (late && undo) undo();
    }).detach();
  }

  // The step's status, or DEADLINE_EXCEEDED (and the step abandoned) after `timeout`.
  absl::Status Wait(absl::Duration timeout, const std::string& what) {
    std::unique_lock<std::mutex> lock(shared_->mu);
    if (shared_->cv.wait_for(lock, ToChrono(timeout), [&] { return shared_->done; })) {
      return shared_->status;
    }
    shared_->abandoned = true;
    return absl::DeadlineExceededError(
        absl::StrCat(what, " did not complete within ", absl::FormatDuration(timeout)));
  }

 private:
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    absl::Status status;
    std::atomic<bool> abandoned{false};
  };
  std::shared_ptr<Shared> shared_;
};

// Joins the blocking data communicator and connects it around the ring (rank i sends to i + 1 and
// receives from i - 1: activations forward, tokens from the last rank to the first), so that no
// later send or receive has to wait on the host for a peer to connect. On the step's own thread.
absl::Status JoinDataComm(int device, int rank, int world, const ncclUniqueId& id,
                          const char* name, const std::atomic<bool>& abandoned, ncclComm_t* out) {
  CUDA_CHECK(cudaSetDevice(device));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, world, id, rank, &config);
  if (r != ncclSuccess) {
    const absl::Status st = NcclError(r, absl::StrCat("ncclCommInitRankConfig (", name, ")").c_str(),
                                      __FILE__, __LINE__, comm);
    if (comm != nullptr) ncclCommAbort(comm);
    return st;
  }
  // One byte each way on a stream of this thread; the event is polled so that an abandoned step
  // can abort its own communicator (this thread owns it) and stop the kernel.
  cuda::Stream stream;
  cuda::DeviceBuffer buf;
  cuda::Event done;
  absl::Status st = stream.Create();
  if (st.ok()) st = buf.Allocate(2);
  if (st.ok()) st = done.Create();
  if (st.ok()) {
    ncclResult_t g = ncclGroupStart();
    if (g == ncclSuccess) {
      g = ncclSend(buf.as<char>(), 1, ncclUint8, (rank + 1) % world, comm, stream.get());
      if (g == ncclSuccess) {
        g = ncclRecv(buf.as<char>() + 1, 1, ncclUint8, (rank + world - 1) % world, comm,
                     stream.get());
      }
      const ncclResult_t end = ncclGroupEnd();
      if (g == ncclSuccess) g = end;
    }
    if (g != ncclSuccess) {
      st = NcclError(g, absl::StrCat("connecting the ", name, " communicator").c_str(), __FILE__,
                     __LINE__, comm);
    }
  }
  if (st.ok()) {
    const cudaError_t e = cudaEventRecord(done.get(), stream.get());
    if (e != cudaSuccess) st = cuda::CudaError(e, "cudaEventRecord", __FILE__, __LINE__);
  }
  while (st.ok()) {
    const cudaError_t q = cudaEventQuery(done.get());
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) {
      st = cuda::CudaError(q, "cudaEventQuery", __FILE__, __LINE__);
      break;
    }
    ncclResult_t state = ncclSuccess;
    const ncclResult_t a = ncclCommGetAsyncError(comm, &state);
    if (a != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
      st = NcclError(a != ncclSuccess ? a : state,
                     absl::StrCat("connecting the ", name, " communicator").c_str(), __FILE__,
                     __LINE__, comm);
      break;
    }
    if (abandoned) {
      st = absl::DeadlineExceededError(
          absl::StrCat("connecting the ", name, " communicator was abandoned"));
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (!st.ok() || abandoned) {
    ncclCommAbort(comm);
    return st.ok() ? absl::DeadlineExceededError(
                         absl::StrCat("joining the ", name, " communicator was abandoned"))
                   : st;
  }
  *out = comm;
  return absl::OkStatus();
}

}  // namespace

struct NcclTransport::State {
  NcclTransportOptions opt;
  ncclComm_t root = nullptr;  // the non-blocking communicator every rank joined; aborts and joins
  ncclComm_t data = nullptr;  // the blocking communicator activation frames move on
  // The first and the last rank (world > 1): a blocking communicator of the two (the first is its
  // rank 0) that token frames move on once both ranks have called SeparateTokens (tokens_apart),
  // so that a receive of tokens waiting for the last rank never holds back the activations behind
  // it. The first rank receives them on a stream of its own, so that its next steps run
  // meanwhile; the last sends them on its usual stream, behind the sampling (the first rank posts
  // each step's receive once it has run the step, before the last has it). Otherwise token frames
  // move on the data communicator, as the activations do.
  ncclComm_t tokens = nullptr;
  ncclUniqueId token_id{};     // rank 0 made it; the first and last rank join with it
  cuda::Stream token_stream;  // the first rank's
  bool tokens_apart = false;
  absl::Status broken;        // OK while the communicators are usable; the abort's reason after
  cuda::Stream comm_stream;   // every ncclSend/ncclRecv, in issue order (unless opt.stream)
  cuda::Stream copy_stream;  // staging copies into send buffers, never behind a waiting send
  cudaStream_t comm() const {
    return opt.stream != nullptr ? static_cast<cudaStream_t>(opt.stream) : comm_stream.get();
  }
  cudaStream_t copy() const {
    return opt.stream != nullptr ? static_cast<cudaStream_t>(opt.stream) : copy_stream.get();
  }

  // Two send buffers ([kHeaderRegion][payload]), alternated: a send may wait for the next stage
  // while the next is staged. The last rank's hold token frames.
  struct SendSlot {
    cuda::DeviceBuffer frame;
    cuda::PinnedBuffer host_header;  // the header, and on the last rank the tokens behind it
    cuda::Event copied, sent;
    bool in_flight = false;
    Clock::time_point queued;  // when the send was queued
    uint64_t step_id = 0;
  };
  SendSlot send[2];
  uint64_t sends = 0;

  // Two receive buffers ([kHeaderRegion][payload]), alternated: a returned payload stays valid
  // through the next Recv.
  cuda::DeviceBuffer recv_frame[2];
  cuda::Event recv_done[2];
  uint64_t recvs = 0;
  // The header region and the inline tokens of a received frame, copied to the host.
  cuda::PinnedBuffer recv_host;
  cuda::Event header_done;
  // A posted receive's header (PostRecv), per receive buffer, and the end of its copy to the host.
  cuda::PinnedBuffer posted_header[2];
  cuda::Event posted_header_done[2];

  // The first rank's posted token receives (PostRecvTokens), used in turn: the frame, its copy on
  // the host, and the end of that copy.
  struct PostedTokenRecv {
    cuda::DeviceBuffer frame;
    cuda::PinnedBuffer host;
    cuda::Event done;
    bool taken = true;
  };
  PostedTokenRecv token_recv[kMaxPostedTokenReceives];
  uint64_t token_posts = 0;

  // A transport that failed to join (or whose close was cut short) leaves nothing joined behind.
  ~State() { Abort(absl::CancelledError("the transport was destroyed")); }

  size_t row_bytes() const { return static_cast<size_t>(opt.hidden_size) * DTypeSize(opt.dtype); }
  bool last() const { return opt.rank == opt.world - 1; }
  // The other end of the token communicator.
  int token_peer() const { return last() ? 0 : 1; }

  absl::Status Healthy() const {
    if (broken.ok()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "NCCL transport of rank ", opt.rank, " was aborted: ", std::string(broken.message())));
  }

  // Aborts both communicators, each on its own (NCCL rejects a group mixing blocking and
  // non-blocking communicators). Aborting the blocking one also stops its kernels.
  void Abort(const absl::Status& reason) {
    if (!broken.ok()) return;
    broken = reason.ok() ? absl::CancelledError("aborted") : reason;
    cudaSetDevice(opt.device);
    if (data != nullptr) ncclCommAbort(data);
    if (tokens != nullptr) ncclCommAbort(tokens);
    if (root != nullptr) ncclCommAbort(root);
    data = tokens = root = nullptr;
  }

  // Fails (and aborts) with `st`.
  absl::Status Fail(absl::Status st) {
    Abort(st);
    return st;
  }

  absl::Status Issue(ncclResult_t r, const char* expr, const char* file, int line,
                     const std::function<bool()>* cancelled = nullptr) {
    if (r == ncclSuccess) return absl::OkStatus();
    ncclComm_t comm = data != nullptr ? data : root;
    if (r != ncclInProgress) return Fail(NcclError(r, expr, file, line, comm));
    // Only the non-blocking root answers ncclInProgress.
    const auto deadline = Clock::now() + ToChrono(opt.timeout);
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(root, &state);
      if (q != ncclSuccess) return Fail(NcclError(q, "ncclCommGetAsyncError", file, line, root));
      if (cancelled != nullptr && *cancelled && (*cancelled)()) {
        return Fail(absl::CancelledError(absl::StrCat("cancelled on rank ", opt.rank, " in ", expr)));
      }
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) return Fail(NcclError(state, expr, file, line, root));
      if (Clock::now() > deadline) {
        return Fail(absl::DeadlineExceededError(
            absl::StrCat(expr, " on rank ", opt.rank, " did not complete within ",
                         absl::FormatDuration(opt.timeout))));
      }
      std::this_thread::yield();
    }
  }

  // An async error of `comm` (null: none) as UNAVAILABLE, or OK.
  absl::Status CommError(ncclComm_t comm, const std::string& what) const {
    if (comm == nullptr) return absl::OkStatus();
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r == ncclSuccess && (state == ncclSuccess || state == ncclInProgress)) {
      return absl::OkStatus();
    }
    return absl::UnavailableError(absl::StrCat(
        "NCCL failed on rank ", opt.rank, " while waiting for ", what, ": ",
        ncclGetErrorString(r != ncclSuccess ? r : state), ": ", ncclGetLastError(comm)));
  }

  // Polls `event` until it completes; the peer's failure, a timeout or `cancelled` abort.
  absl::Status Wait(cudaEvent_t event, const std::function<bool()>* cancelled,
                    const std::string& what) {
    const auto deadline = Clock::now() + ToChrono(opt.timeout);
    for (uint64_t i = 0;; ++i) {
      const cudaError_t q = cudaEventQuery(event);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) return Fail(cuda::CudaError(q, "cudaEventQuery", __FILE__, __LINE__));
      if (absl::Status st = CommError(data != nullptr ? data : root, what); !st.ok()) {
        return Fail(std::move(st));
      }
      if ((i & 63) == 0) {
        for (ncclComm_t other : {data != nullptr ? root : nullptr, tokens}) {
          if (absl::Status st = CommError(other, what); !st.ok()) return Fail(std::move(st));
        }
        if (cancelled != nullptr && *cancelled && (*cancelled)()) {
          return Fail(absl::CancelledError(
              absl::StrCat("cancelled on rank ", opt.rank, " while waiting for ", what)));
        }
        if (Clock::now() > deadline) {
          return Fail(absl::DeadlineExceededError(
              absl::StrCat("rank ", opt.rank, " waited ", absl::FormatDuration(opt.timeout),
                           " for ", what, "; the peer stage is silent or gone")));
        }
      }
      if (i > 4096) std::this_thread::yield();
    }
  }

  // Sends one frame to `peer` through send slot sends % 2: the header, and `bytes` of payload
  // copied from `src` (`copy_kind`) behind it; one NCCL group of one or two messages on the data
  // communicator behind the copy, or, for token frames moved apart, on the token communicator.
  absl::Status SendFrame(int peer, uint32_t kind, uint64_t step_id, int64_t rows, int64_t cols,
                         const void* src, size_t bytes, cudaMemcpyKind copy_kind) {
    const bool token = kind == kTokenFrame && tokens_apart;
    ncclComm_t on = token ? tokens : data;
    const int to = token ? token_peer() : peer;
    SendSlot& slot = send[sends % 2];
    if (slot.in_flight) {
      RETURN_IF_ERROR(Wait(slot.sent.get(), nullptr,
                           absl::StrCat("rank ", peer, " to take an earlier frame")));
      slot.in_flight = false;
    }
    if (kHeaderRegion + bytes > slot.frame.size()) {
      return absl::InvalidArgumentError(absl::StrCat("a ", KindName(kind), " frame of ", bytes,
                                                     " bytes exceeds the send buffer of ",
                                                     slot.frame.size() - kHeaderRegion, " bytes"));
    }
    FrameHeader* h = slot.host_header.as<FrameHeader>();
    *h = FrameHeader{kFrameMagic, step_id, rows, cols, kind,
                     static_cast<uint32_t>(opt.dtype), {0, 0, 0}};
    char* frame = slot.frame.as<char>();
    const cudaStream_t cs = copy();
    // Host data that fits behind the header in the slot's pinned buffer (a step's tokens) goes
    // there and over in one copy, and the caller's memory is free at once; otherwise it is free
    // once the staging copy is done.
    const bool pinned =
        copy_kind == cudaMemcpyHostToDevice && kHeaderRegion + bytes <= slot.host_header.size();
    if (pinned) {
      if (bytes > 0) std::memcpy(slot.host_header.as<char>() + kHeaderRegion, src, bytes);
      CUDA_CHECK(cudaMemcpyAsync(frame, h, kHeaderRegion + bytes, cudaMemcpyHostToDevice, cs));
    } else {
      if (bytes > 0) {
        CUDA_CHECK(cudaMemcpyAsync(frame + kHeaderRegion, src, bytes, copy_kind, cs));
      }
      CUDA_CHECK(cudaMemcpyAsync(frame, h, sizeof(FrameHeader), cudaMemcpyHostToDevice, cs));
    }
    CUDA_CHECK(cudaEventRecord(slot.copied.get(), cs));
    const cudaStream_t ns = comm();
    if (ns != cs) CUDA_CHECK(cudaStreamWaitEvent(ns, slot.copied.get(), 0));
    const size_t inline_bytes = InlineBytes(kind);
    NCCL_ISSUE(*this, ncclGroupStart());
    ncclResult_t r = ncclSend(frame, kHeaderRegion + inline_bytes, ncclUint8, to, on, ns);
    if (r == ncclSuccess && bytes > inline_bytes) {
      r = ncclSend(frame + kHeaderRegion + inline_bytes, bytes - inline_bytes, ncclUint8, to, on,
                   ns);
    }
    const ncclResult_t end = ncclGroupEnd();
    NCCL_ISSUE(*this, r);
    NCCL_ISSUE(*this, end);
    CUDA_CHECK(cudaEventRecord(slot.sent.get(), ns));
    slot.in_flight = true;
    slot.queued = Clock::now();
    slot.step_id = step_id;
    ++sends;
    // The send is queued behind the staging copy; the caller's memory is free once that is done,
    // and device memory at once for work queued behind it on a shared stream (opt.stream).
    const bool ordered = opt.stream != nullptr && copy_kind == cudaMemcpyDeviceToDevice;
    if (!pinned && !ordered) RETURN_IF_ERROR(Wait(slot.copied.get(), nullptr, "the staging copy"));
    return absl::OkStatus();
  }

  // The last rank's frame of a step's `count` tokens (host or device memory, `kind`) to rank 0.
  absl::Status SendTokenFrame(uint64_t step_id, const int32_t* tokens, int64_t count,
                              cudaMemcpyKind kind) {
    RETURN_IF_ERROR(Healthy());
    if (!last() || opt.world < 2) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", opt.rank, " of ", opt.world,
          ": only the last stage of a pipeline of 2 or more returns tokens to the first"));
    }
    if (count < 0 || count > opt.max_rows) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", step_id, ": ", count, " tokens are outside [0, max_rows = ", opt.max_rows, "]"));
    }
    if (count > 0 && tokens == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("step ", step_id, ": tokens have no data"));
    }
    CUDA_CHECK(cudaSetDevice(opt.device));
    return SendFrame(0, kTokenFrame, step_id, count, 1, tokens,
                     static_cast<size_t>(count) * sizeof(int32_t), kind);
  }

  // Joins a blocking communicator as `rank` of `world` with `id` and connects it around the ring
  // (JoinDataComm) on a thread of its own, given up on at the timeout; into `*out`.
  absl::Status JoinBlocking(int rank, int world, const ncclUniqueId& id, const char* name,
                            ncclComm_t* out) {
    auto joined = std::make_shared<ncclComm_t>(nullptr);
    const int device = opt.device;
    BoundedNcclStep join(
        [=](const std::atomic<bool>& abandoned) {
          return JoinDataComm(device, rank, world, id, name, abandoned, joined.get());
        },
        [=] {
          cudaSetDevice(device);
          ncclCommAbort(*joined);
        });
    const absl::Status st =
        join.Wait(opt.timeout, absl::StrCat("rank ", opt.rank, " of ", opt.world,
                                            " joining and connecting the NCCL ", name,
                                            " communicator"));
    CUDA_CHECK(cudaSetDevice(opt.device));
    if (st.ok()) *out = *joined;
    return st;
  }

  // Before a receive of tokens (RecvTokens, PostRecvTokens): a usable transport of the first rank
  // of several.
  absl::Status CanReceiveTokens() const {
    RETURN_IF_ERROR(Healthy());
    if (opt.rank != 0 || opt.world < 2) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", opt.rank, " of ", opt.world,
                       ": only the first stage of a pipeline of 2 or more receives tokens"));
    }
    return absl::OkStatus();
  }

  // The tokens of the receive posted into token_recv[i] for step `step_id` (PostRecvTokens): waits
  // for the frame's copy to the host, then checks its header, `count` included.
  absl::StatusOr<std::vector<int32_t>> TakeTokens(int i, uint64_t step_id, int64_t count,
                                                  const std::function<bool()>& cancelled) {
    PostedTokenRecv& r = token_recv[i];
    r.taken = true;
    RETURN_IF_ERROR(Healthy());
    CUDA_CHECK(cudaSetDevice(opt.device));
    const int peer = opt.world - 1;
    RETURN_IF_ERROR(Wait(r.done.get(), &cancelled,
                         absl::StrCat("step ", step_id, "'s tokens from rank ", peer)));
    ASSIGN_OR_RETURN(const FrameHeader h,
                     CheckHeader(*r.host.as<FrameHeader>(), peer, kTokenFrame, step_id));
    if (h.rows != count) {
      return Fail(absl::DataLossError(absl::StrCat("rank ", opt.rank, " expected step ", step_id,
                                                   "'s ", count, " tokens from rank ", peer,
                                                   " but got ", h.rows)));
    }
    std::vector<int32_t> tokens(static_cast<size_t>(count));
    if (count > 0) {
      std::memcpy(tokens.data(), r.host.as<char>() + kHeaderRegion,
                  tokens.size() * sizeof(int32_t));
    }
    return tokens;
  }

  // Before a receive of activations (Recv, PostRecv): a usable transport of a stage that has a
  // previous one, not cancelled yet; selects the device.
  absl::Status CanReceiveActivations(uint64_t step_id, const std::function<bool()>& cancelled) {
    RETURN_IF_ERROR(Healthy());
    if (opt.rank == 0) {
      return absl::FailedPreconditionError(
          "rank 0 is the first stage and receives no activations");
    }
    if (cancelled && cancelled()) {
      return absl::CancelledError(absl::StrCat("step ", step_id, ": cancelled before receiving"));
    }
    CUDA_CHECK(cudaSetDevice(opt.device));
    return absl::OkStatus();
  }

  // Receives the next frame from `peer` into `frame` (a receive buffer) and checks its header
  // against what is expected; `host_bytes` of the frame's first message (at least the header)
  // are copied to recv_host. The payload's rest, past the first message, is left to the caller.
  absl::StatusOr<FrameHeader> RecvFirst(int peer, uint32_t kind, uint64_t step_id, char* frame,
                                        size_t host_bytes, const std::function<bool()>& cancelled) {
    const cudaStream_t ns = comm();
    NCCL_ISSUE_C(*this,
                 ncclRecv(frame, kHeaderRegion + InlineBytes(kind), ncclUint8, peer, data, ns),
                 cancelled);
    CUDA_CHECK(cudaMemcpyAsync(recv_host.get(), frame, host_bytes, cudaMemcpyDeviceToHost, ns));
    CUDA_CHECK(cudaEventRecord(header_done.get(), ns));
    RETURN_IF_ERROR(Wait(header_done.get(), &cancelled,
                         absl::StrCat("step ", step_id, "'s ", KindName(kind), " from rank ", peer)));
    return CheckHeader(*recv_host.as<FrameHeader>(), peer, kind, step_id);
  }

  // `h` if it is the header of step `step_id`'s frame of `kind` from `peer` within this stage's
  // limits; otherwise DATA_LOSS (the pipeline lost or reordered a message), aborting.
  absl::StatusOr<FrameHeader> CheckHeader(const FrameHeader& h, int peer, uint32_t kind,
                                          uint64_t step_id) {
    auto bad = [&](auto&&... parts) {
      return Fail(absl::DataLossError(absl::StrCat("rank ", opt.rank, " expected step ", step_id,
                                                   "'s ", KindName(kind), " from rank ", peer,
                                                   " but got ", parts...)));
    };
    if (h.magic != kFrameMagic) return bad("a frame without the tandem header");
    if (h.kind != kind) return bad(KindName(h.kind), " of step ", h.step_id);
    if (h.step_id != step_id) return bad("step ", h.step_id);
    const int64_t max_rows = opt.max_rows;
    if (h.rows < 0 || h.rows > max_rows) {
      return bad(h.rows, " rows, outside [0, max_rows = ", max_rows, "]");
    }
    if (kind == kActivationFrame &&
        (h.cols != opt.hidden_size || h.dtype != static_cast<uint32_t>(opt.dtype))) {
      return bad("[", h.rows, ", ", h.cols, "] of dtype #", h.dtype, ", the stage has hidden ",
                 opt.hidden_size, " and ", std::string(DTypeName(opt.dtype)));
    }
    if (kind == kTokenFrame && h.cols != 1) return bad("a token frame with ", h.cols, " cols");
    return h;
  }

  // The verdict on the receive posted into buffer `i` for step `step_id` (PostRecv): waits for
  // its header, then checks it, `rows` included.
  absl::StatusOr<absl::Time> Arrival(int i, uint64_t step_id, int64_t rows, int peer,
                                     const std::function<bool()>& cancelled) {
    RETURN_IF_ERROR(Healthy());
    CUDA_CHECK(cudaSetDevice(opt.device));
    RETURN_IF_ERROR(Wait(posted_header_done[i].get(), &cancelled,
                         absl::StrCat("step ", step_id, "'s activations from rank ", peer)));
    const absl::Time arrived = absl::Now();
    ASSIGN_OR_RETURN(const FrameHeader h, CheckHeader(*posted_header[i].as<FrameHeader>(), peer,
                                                      kActivationFrame, step_id));
    if (h.rows != rows) {
      return Fail(absl::DataLossError(absl::StrCat("rank ", opt.rank, " expected step ", step_id,
                                                   "'s activations of ", rows, " rows from rank ",
                                                   peer, " but got ", h.rows, " rows")));
    }
    return arrived;
  }
};

absl::StatusOr<std::string> MakeNcclUniqueId() {
  ncclUniqueId id;
  NCCL_CHECK(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

absl::Status ValidateNcclUniqueId(absl::string_view bytes) {
  if (bytes.size() != kNcclUniqueIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("an NCCL unique id has ", kNcclUniqueIdBytes,
                                                   " bytes, got ", bytes.size()));
  }
  return absl::OkStatus();
}

absl::Status ValidateNcclTransportOptions(const NcclTransportOptions& o) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL transport options: ", parts...));
  };
  if (o.world < 1) return bad("world must be >= 1, got ", o.world);
  if (o.rank < 0 || o.rank >= o.world) {
    return bad("rank ", o.rank, " is outside [0, world = ", o.world, ")");
  }
  if (o.device < 0) return bad("device must be >= 0, got ", o.device);
  if (o.hidden_size < 1) return bad("hidden_size must be >= 1, got ", o.hidden_size);
  if (o.max_rows < 1) return bad("max_rows must be >= 1, got ", o.max_rows);
  if (o.dtype != DType::kF16 && o.dtype != DType::kBF16 && o.dtype != DType::kF32) {
    return bad("dtype must be f16, bf16 or f32, got ", std::string(DTypeName(o.dtype)));
  }
  if (o.timeout <= absl::ZeroDuration()) {
    return bad("timeout must be positive, got ", absl::FormatDuration(o.timeout));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<NcclTransport>> NcclTransport::Create(
    const NcclTransportOptions& options, absl::string_view unique_id) {
  RETURN_IF_ERROR(ValidateNcclTransportOptions(options));
  RETURN_IF_ERROR(ValidateNcclUniqueId(unique_id));
  int devices = 0;
  CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (options.device >= devices) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL transport options: device ",
                                                   options.device, " is outside the ", devices,
                                                   " CUDA devices present"));
  }
  auto s = std::make_unique<State>();
  s->opt = options;
  CUDA_CHECK(cudaSetDevice(options.device));
  if (options.stream == nullptr) {
    RETURN_IF_ERROR(s->comm_stream.Create());
    RETURN_IF_ERROR(s->copy_stream.Create());
  }
  // Frame buffers hold the header region and at least a first message's payload.
  const size_t act_bytes =
      kHeaderRegion +
      std::max(static_cast<size_t>(options.max_rows) * s->row_bytes(), kInlineActivationBytes);
  const size_t tok_bytes =
      kHeaderRegion +
      std::max(static_cast<size_t>(options.max_rows) * sizeof(int32_t), kInlineTokenBytes);
  if (options.world > 1) {
    // Ranks but the last send activations; the last sends tokens back to the first.
    const size_t send_bytes = s->last() ? tok_bytes : act_bytes;
    for (State::SendSlot& slot : s->send) {
      RETURN_IF_ERROR(slot.frame.Allocate(send_bytes));
      // The last rank's token frames are staged whole in pinned memory (SendFrame).
      RETURN_IF_ERROR(slot.host_header.Allocate(s->last() ? kHeaderRegion + kInlineTokenBytes
                                                          : sizeof(FrameHeader)));
      RETURN_IF_ERROR(slot.copied.Create());
      RETURN_IF_ERROR(slot.sent.Create());
    }
    // Ranks but the first receive activations; the first receives tokens.
    const size_t recv_bytes = options.rank == 0 ? tok_bytes : act_bytes;
    for (int i = 0; i < 2; ++i) {
      RETURN_IF_ERROR(s->recv_frame[i].Allocate(recv_bytes));
      RETURN_IF_ERROR(s->recv_done[i].Create());
      RETURN_IF_ERROR(s->posted_header[i].Allocate(sizeof(FrameHeader)));
      RETURN_IF_ERROR(s->posted_header_done[i].Create());
    }
    RETURN_IF_ERROR(s->recv_host.Allocate(options.rank == 0 ? tok_bytes : kHeaderRegion));
    RETURN_IF_ERROR(s->header_done.Create());
    if (options.rank == 0) RETURN_IF_ERROR(s->token_stream.Create());
    if (options.rank == 0) {
      for (State::PostedTokenRecv& r : s->token_recv) {
        RETURN_IF_ERROR(r.frame.Allocate(tok_bytes));
        RETURN_IF_ERROR(r.host.Allocate(tok_bytes));
        RETURN_IF_ERROR(r.done.Create());
      }
    }
  }

  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t r =
      ncclCommInitRankConfig(&s->root, options.world, id, options.rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    const absl::Status st = NcclError(r, "ncclCommInitRankConfig", __FILE__, __LINE__, s->root);
    s->Abort(st);
    return st;
  }
  // Joining waits for every rank; a rank that never comes ends it at the timeout.
  const auto deadline = Clock::now() + ToChrono(options.timeout);
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(s->root, &state);
    if (q != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
      const absl::Status st =
          NcclError(q != ncclSuccess ? q : state, "ncclCommInitRankConfig", __FILE__, __LINE__,
                    s->root);
      s->Abort(st);
      return st;
    }
    if (state == ncclSuccess) break;
    if (Clock::now() > deadline) {
      const absl::Status st = absl::DeadlineExceededError(absl::StrCat(
          "rank ", options.rank, " of ", options.world, " could not join the NCCL communicator "
          "within ", absl::FormatDuration(options.timeout), "; a stage did not join"));
      s->Abort(st);
      return st;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (options.world == 1) return std::unique_ptr<NcclTransport>(new NcclTransport(std::move(s)));

  // The ids of the data and token communicators: made by rank 0 (which hosts their bootstrap
  // roots), broadcast over the root communicator while every rank is known to be present. Every
  // rank joins the data communicator, the first and the last the token one, both at once.
  {
    cuda::DeviceBuffer id_dev;
    ncclUniqueId ids[2];  // data, tokens
    static_assert(sizeof(ids) <= kHeaderRegion);
    RETURN_IF_ERROR(id_dev.Allocate(sizeof(ids)));
    if (options.rank == 0) {
      NCCL_CHECK(ncclGetUniqueId(&ids[0]));
      NCCL_CHECK(ncclGetUniqueId(&ids[1]));
      CUDA_CHECK(cudaMemcpy(id_dev.get(), ids, sizeof(ids), cudaMemcpyHostToDevice));
    }
    const cudaStream_t ns = s->comm();
    NCCL_ISSUE(*s, ncclBroadcast(id_dev.get(), id_dev.get(), sizeof(ids), ncclUint8, 0, s->root,
                                 ns));
    CUDA_CHECK(cudaMemcpyAsync(s->recv_host.get(), id_dev.get(), sizeof(ids),
                               cudaMemcpyDeviceToHost, ns));
    CUDA_CHECK(cudaEventRecord(s->header_done.get(), ns));
    RETURN_IF_ERROR(s->Wait(s->header_done.get(), nullptr, "the data communicator's id"));
    std::memcpy(ids, s->recv_host.get(), sizeof(ids));

    s->token_id = ids[1];  // joined by SeparateTokens
    const absl::Status st = s->JoinBlocking(options.rank, options.world, ids[0], "data", &s->data);
    if (!st.ok()) return s->Fail(st);
  }
  return std::unique_ptr<NcclTransport>(new NcclTransport(std::move(s)));
}

NcclTransport::NcclTransport(std::unique_ptr<State> state) : s_(std::move(state)) {}

NcclTransport::~NcclTransport() {
  if (s_->root == nullptr) return;
  cudaSetDevice(s_->opt.device);
  // Let the last frames reach the peer, then leave the communicators cleanly.
  for (State::SendSlot& slot : s_->send) {
    if (slot.in_flight && !s_->Wait(slot.sent.get(), nullptr, "the last frames to be taken").ok()) {
      return;  // aborted
    }
  }
  // Token receives posted for steps the last rank never ran (the pipeline ended first) would keep
  // the token communicator from finalizing: a second for the last frames, then an abort.
  const auto settle = Clock::now() + std::chrono::seconds(1);
  for (State::PostedTokenRecv& r : s_->token_recv) {
    if (r.taken) continue;
    while (cudaEventQuery(r.done.get()) == cudaErrorNotReady) {
      if (Clock::now() > settle) {
        s_->Abort(absl::CancelledError("token receives were posted for steps never sent"));
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  const absl::Duration limit = std::min(s_->opt.timeout, absl::Seconds(30));
  for (ncclComm_t* held : {&s_->data, &s_->tokens}) {
    if (*held == nullptr) continue;
    // Finalizing a blocking communicator blocks until the peers finalize too: bounded, and on
    // timeout left to its thread (aborting it under that thread is not allowed).
    ncclComm_t comm = *held;
    *held = nullptr;
    const int device = s_->opt.device;
    BoundedNcclStep close([=](const std::atomic<bool>&) -> absl::Status {
      cudaSetDevice(device);
      const ncclResult_t r = ncclCommFinalize(comm);
      if (r != ncclSuccess) {
        ncclCommAbort(comm);
        return NcclError(r, "ncclCommFinalize", __FILE__, __LINE__, nullptr);
      }
      ncclCommDestroy(comm);
      return absl::OkStatus();
    });
    if (!close.Wait(limit, "closing a blocking communicator").ok()) {
      s_->Abort(absl::CancelledError("a blocking communicator did not finalize"));
      return;
    }
    cudaSetDevice(s_->opt.device);
  }
  const ncclResult_t r = ncclCommFinalize(s_->root);
  if (r != ncclSuccess && r != ncclInProgress) {
    s_->Abort(absl::CancelledError("the communicator did not finalize"));
    return;
  }
  // Finalizing waits until the communicator is quiet on every rank; a gone peer ends it.
  const auto deadline = Clock::now() + ToChrono(limit);
  for (;;) {
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(s_->root, &state) != ncclSuccess ||
        (state != ncclSuccess && state != ncclInProgress) || Clock::now() > deadline) {
      s_->Abort(absl::CancelledError("the communicator did not finalize"));
      return;
    }
    if (state == ncclSuccess) break;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  ncclCommDestroy(s_->root);
  s_->root = nullptr;
}

absl::Status NcclTransport::Send(uint64_t step_id, const Activations& a) {
  State& s = *s_;
  RETURN_IF_ERROR(s.Healthy());
  if (s.last()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", s.opt.rank, " is the last stage of ", s.opt.world,
                     " and has no next stage to send activations to"));
  }
  if (a.cols != s.opt.hidden_size || a.dtype != s.opt.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", step_id, ": activations [", a.rows, ", ", a.cols, "] ",
        std::string(DTypeName(a.dtype)), " do not match the transport's hidden size ",
        s.opt.hidden_size, " and ", std::string(DTypeName(s.opt.dtype))));
  }
  if (a.rows < 0 || a.rows > s.opt.max_rows) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step_id, ": ", a.rows,
                                                   " rows of activations are outside [0, ",
                                                   s.opt.max_rows, "] (max_rows)"));
  }
  if (a.rows > 0 && a.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step_id, ": activations have no data"));
  }
  CUDA_CHECK(cudaSetDevice(s.opt.device));
  return s.SendFrame(s.opt.rank + 1, kActivationFrame, step_id, a.rows, a.cols, a.data.get(),
                     a.nbytes(),
                     a.where == Where::kDevice ? cudaMemcpyDeviceToDevice
                                               : cudaMemcpyHostToDevice);
}

absl::StatusOr<Activations> NcclTransport::Recv(uint64_t step_id,
                                                const std::function<bool()>& cancelled) {
  State& s = *s_;
  RETURN_IF_ERROR(s.CanReceiveActivations(step_id, cancelled));
  const int peer = s.opt.rank - 1;
  const int i = static_cast<int>(s.recvs % 2);
  char* frame = s.recv_frame[i].as<char>();
  ASSIGN_OR_RETURN(FrameHeader h, s.RecvFirst(peer, kActivationFrame, step_id, frame,
                                              sizeof(FrameHeader), cancelled));
  Activations a;
  a.rows = h.rows;
  a.cols = h.cols;
  a.dtype = s.opt.dtype;
  a.where = Where::kDevice;
  const size_t bytes = a.nbytes();
  if (bytes > kInlineActivationBytes) {  // a prefill: the rest in a second message
    const cudaStream_t ns = s.comm();
    NCCL_ISSUE_C(s,
                 ncclRecv(frame + kHeaderRegion + kInlineActivationBytes,
                          bytes - kInlineActivationBytes, ncclUint8, peer, s.data, ns),
                 cancelled);
    CUDA_CHECK(cudaEventRecord(s.recv_done[i].get(), ns));
    RETURN_IF_ERROR(s.Wait(s.recv_done[i].get(), &cancelled,
                           absl::StrCat("step ", step_id, "'s activations from rank ", peer)));
  }
  a.data = std::shared_ptr<void>(frame + kHeaderRegion, [](void*) {});
  ++s.recvs;
  return a;
}

absl::StatusOr<Activations> NcclTransport::PostRecv(uint64_t step_id, int64_t rows,
                                                    const std::function<bool()>& cancelled) {
  State& s = *s_;
  if (rows < 0 || rows > s.opt.max_rows) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step_id, ": ", rows,
                                                   " rows of activations are outside [0, ",
                                                   s.opt.max_rows, "] (max_rows)"));
  }
  RETURN_IF_ERROR(s.CanReceiveActivations(step_id, cancelled));
  const int peer = s.opt.rank - 1;
  const int i = static_cast<int>(s.recvs % 2);
  char* frame = s.recv_frame[i].as<char>();
  Activations a;
  a.rows = rows;
  a.cols = s.opt.hidden_size;
  a.dtype = s.opt.dtype;
  a.where = Where::kDevice;
  const size_t bytes = a.nbytes();
  const cudaStream_t ns = s.comm();
  // The frame's messages as the sender groups them: the first of fixed size, then the rest.
  NCCL_ISSUE_C(s, ncclGroupStart(), cancelled);
  ncclResult_t r =
      ncclRecv(frame, kHeaderRegion + kInlineActivationBytes, ncclUint8, peer, s.data, ns);
  if (r == ncclSuccess && bytes > kInlineActivationBytes) {
    r = ncclRecv(frame + kHeaderRegion + kInlineActivationBytes, bytes - kInlineActivationBytes,
                 ncclUint8, peer, s.data, ns);
  }
  const ncclResult_t end = ncclGroupEnd();
  NCCL_ISSUE_C(s, r, cancelled);
  NCCL_ISSUE_C(s, end, cancelled);
  CUDA_CHECK(cudaEventRecord(s.recv_done[i].get(), ns));
  CUDA_CHECK(cudaMemcpyAsync(s.posted_header[i].get(), frame, sizeof(FrameHeader),
                             cudaMemcpyDeviceToHost, ns));
  CUDA_CHECK(cudaEventRecord(s.posted_header_done[i].get(), ns));
  ++s.recvs;
  a.data = std::shared_ptr<void>(frame + kHeaderRegion, [](void*) {});
  a.ready = s.recv_done[i].get();
  auto verdict = std::make_shared<std::optional<absl::StatusOr<absl::Time>>>();
  State* state = s_.get();
  a.arrival = [state, i, step_id, rows, peer, cancelled, verdict]() {
    if (!verdict->has_value()) *verdict = state->Arrival(i, step_id, rows, peer, cancelled);
    return **verdict;
  };
  return a;
}

absl::Status NcclTransport::SendTokens(uint64_t step_id, const std::vector<int32_t>& tokens) {
  return s_->SendTokenFrame(step_id, tokens.data(), static_cast<int64_t>(tokens.size()),
                            cudaMemcpyHostToDevice);
}

absl::Status NcclTransport::SendDeviceTokens(uint64_t step_id, const int32_t* device_tokens,
                                             int64_t count) {
  return s_->SendTokenFrame(step_id, device_tokens, count, cudaMemcpyDeviceToDevice);
}

absl::StatusOr<std::vector<int32_t>> NcclTransport::RecvTokens(
    uint64_t step_id, const std::function<bool()>& cancelled) {
  State& s = *s_;
  RETURN_IF_ERROR(s.CanReceiveTokens());
  if (s.tokens_apart) {
    return absl::FailedPreconditionError(
        "token frames move apart from the activations (SeparateTokens): post their receives");
  }
  if (cancelled && cancelled()) {
    return absl::CancelledError(absl::StrCat("step ", step_id, ": cancelled before receiving"));
  }
  CUDA_CHECK(cudaSetDevice(s.opt.device));
  const int peer = s.opt.world - 1;
  char* frame = s.recv_frame[0].as<char>();
  ASSIGN_OR_RETURN(FrameHeader h, s.RecvFirst(peer, kTokenFrame, step_id, frame,
                                              kHeaderRegion + kInlineTokenBytes, cancelled));
  std::vector<int32_t> tokens(static_cast<size_t>(h.rows));
  const size_t bytes = tokens.size() * sizeof(int32_t);
  const char* host = s.recv_host.as<char>() + kHeaderRegion;
  if (bytes > kInlineTokenBytes) {  // the rest in a second message
    const size_t rest = bytes - kInlineTokenBytes;
    char* dst = frame + kHeaderRegion + kInlineTokenBytes;
    const cudaStream_t ns = s.comm();
    NCCL_ISSUE_C(s, ncclRecv(dst, rest, ncclUint8, peer, s.data, ns), cancelled);
    CUDA_CHECK(cudaMemcpyAsync(s.recv_host.as<char>() + kHeaderRegion + kInlineTokenBytes, dst,
                               rest, cudaMemcpyDeviceToHost, ns));
    CUDA_CHECK(cudaEventRecord(s.recv_done[0].get(), ns));
    RETURN_IF_ERROR(s.Wait(s.recv_done[0].get(), &cancelled,
                           absl::StrCat("step ", step_id, "'s tokens from rank ", peer)));
  }
  if (bytes > 0) std::memcpy(tokens.data(), host, bytes);
  return tokens;
}

absl::StatusOr<PostedTokens> NcclTransport::PostRecvTokens(uint64_t step_id, int64_t count) {
  State& s = *s_;
  RETURN_IF_ERROR(s.CanReceiveTokens());
  if (!s.tokens_apart) {
    return absl::FailedPreconditionError(
        "token frames move with the activations: SeparateTokens first, on both ranks");
  }
  if (count < 0 || count > s.opt.max_rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", step_id, ": ", count, " tokens are outside [0, max_rows = ", s.opt.max_rows, "]"));
  }
  const int i = static_cast<int>(s.token_posts % kMaxPostedTokenReceives);
  State::PostedTokenRecv& r = s.token_recv[i];
  if (!r.taken) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step_id, ": ", kMaxPostedTokenReceives,
        " token receives are posted and not taken; take the oldest first"));
  }
  CUDA_CHECK(cudaSetDevice(s.opt.device));
  const size_t bytes = static_cast<size_t>(count) * sizeof(int32_t);
  char* frame = r.frame.as<char>();
  const cudaStream_t ns = s.token_stream.get();
  // The frame's messages as the last rank groups them: the first of fixed size, then the rest.
  NCCL_ISSUE(s, ncclGroupStart());
  ncclResult_t e = ncclRecv(frame, kHeaderRegion + kInlineTokenBytes, ncclUint8, s.token_peer(),
                            s.tokens, ns);
  if (e == ncclSuccess && bytes > kInlineTokenBytes) {
    e = ncclRecv(frame + kHeaderRegion + kInlineTokenBytes, bytes - kInlineTokenBytes, ncclUint8,
                 s.token_peer(), s.tokens, ns);
  }
  const ncclResult_t end = ncclGroupEnd();
  NCCL_ISSUE(s, e);
  NCCL_ISSUE(s, end);
  CUDA_CHECK(cudaMemcpyAsync(r.host.get(), frame, kHeaderRegion + bytes, cudaMemcpyDeviceToHost,
                             ns));
  CUDA_CHECK(cudaEventRecord(r.done.get(), ns));
  r.taken = false;
  ++s.token_posts;
  State* state = s_.get();
  PostedTokens posted;
  posted.arrived = [state, i] { return cudaEventQuery(state->token_recv[i].done.get()) == cudaSuccess; };
  posted.take = [state, i, step_id, count](const std::function<bool()>& cancelled) {
    return state->TakeTokens(i, step_id, count, cancelled);
  };
  return posted;
}

absl::Status NcclTransport::SeparateTokens() {
  State& s = *s_;
  RETURN_IF_ERROR(s.Healthy());
  if (s.tokens_apart || s.opt.world < 2 || (s.opt.rank != 0 && !s.last())) {
    return absl::OkStatus();  // done, a single stage, or a rank between
  }
  if (s.sends > 0 || s.recvs > 0) {
    return absl::FailedPreconditionError(
        "NCCL transport: token frames can move apart only before the first frame");
  }
  // Joined only here: joined at every pipeline's start, idle or not, it added 1-3% to each step
  // of a pipeline whose first rank waits for the tokens (tandem-pipeline-bench on two H100s).
  CUDA_CHECK(cudaSetDevice(s.opt.device));
  const absl::Status st =
      s.JoinBlocking(s.opt.rank == 0 ? 0 : 1, 2, s.token_id, "token", &s.tokens);
  if (!st.ok()) return s.Fail(st);
  s.tokens_apart = true;
  return absl::OkStatus();
}

absl::Status NcclTransport::UseStream(void* stream) {
  State& s = *s_;
  RETURN_IF_ERROR(s.Healthy());
  if (s.sends > 0 || s.recvs > 0) {
    return absl::FailedPreconditionError(
        "NCCL transport: the stream can change only before the first frame");
  }
  s.opt.stream = stream;
  return absl::OkStatus();
}

absl::Status NcclTransport::Watch() {
  State& s = *s_;
  RETURN_IF_ERROR(s.Healthy());
  const int peer = s.last() ? 0 : s.opt.rank + 1;
  for (State::SendSlot& slot : s.send) {
    if (!slot.in_flight) continue;
    const cudaError_t q = cudaEventQuery(slot.sent.get());
    if (q == cudaSuccess) continue;
    if (q != cudaErrorNotReady)
      return s.Fail(cuda::CudaError(q, "cudaEventQuery", __FILE__, __LINE__));
    if (Clock::now() - slot.queued > ToChrono(s.opt.timeout)) {
      return s.Fail(absl::DeadlineExceededError(absl::StrCat(
          "rank ", s.opt.rank, "'s frame of step ", slot.step_id, " was not taken by rank ", peer,
          " within ", absl::FormatDuration(s.opt.timeout), "; the peer stage is silent or gone")));
    }
  }
  for (ncclComm_t comm : {s.data, s.tokens, s.root}) {
    if (absl::Status st = s.CommError(comm, absl::StrCat("rank ", peer)); !st.ok()) {
      return s.Fail(std::move(st));
    }
  }
  return absl::OkStatus();
}

void NcclTransport::Abort(const absl::Status& reason) { s_->Abort(reason); }
bool NcclTransport::aborted() const { return !s_->broken.ok(); }
int NcclTransport::rank() const { return s_->opt.rank; }
int NcclTransport::world() const { return s_->opt.world; }

}  // namespace tandem
