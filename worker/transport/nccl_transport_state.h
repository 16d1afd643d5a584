// The NcclTransport's state and the pieces its files share: nccl_transport_setup.cc (joining and
// closing the communicators), nccl_transport.cc (frames of activations and tokens). Internal to
// worker/transport/.
//
// The transport moves framed ncclSend/ncclRecv between neighbouring stages on a blocking data
// communicator joined through a non-blocking root one; every wait polls a CUDA event and the
// communicators' async errors against a deadline.
#pragma once

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
#include "worker/transport/nccl_transport.h"

namespace tandem {

static_assert(kNcclUniqueIdBytes == NCCL_UNIQUE_ID_BYTES);
static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES);

using Clock = std::chrono::steady_clock;

// An NCCL failure of `expr` as INTERNAL, with the communicator's last error (`comm` may be null).
absl::Status NcclError(ncclResult_t r, const char* expr, const char* file, int line,
                       ncclComm_t comm);

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

// The frame header: 64 bytes, the same layout on every rank (one build, one architecture).
inline constexpr uint64_t kFrameMagic = 0x314e4d45444e4154ull;  // "TANDEMN1", little-endian
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
inline constexpr size_t kHeaderRegion = 256;
// Payload bytes in a frame's first message, whose size is fixed so that the receiver can post it
// before it knows the step's size: a decode step of up to 10 rows of hidden 3200 in f16, or 1024
// tokens. The same constants on every rank, whatever its options.
inline constexpr size_t kInlineActivationBytes = 64 << 10;
inline constexpr size_t kInlineTokenBytes = 4 << 10;

inline size_t InlineBytes(uint32_t kind) {
  return kind == kActivationFrame ? kInlineActivationBytes : kInlineTokenBytes;
}

inline std::chrono::nanoseconds ToChrono(absl::Duration d) {
  return std::chrono::nanoseconds(absl::ToInt64Nanoseconds(d));
}

inline const char* KindName(uint32_t kind) {
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
                          const char* name, const std::atomic<bool>& abandoned, ncclComm_t* out);

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

}  // namespace tandem
