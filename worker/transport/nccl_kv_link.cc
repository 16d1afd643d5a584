// NcclKvLink: ncclSend/ncclRecv of KV-cache bytes on a blocking two-rank communicator. Joining it
// (and connecting its two ranks) runs on a thread of its own that the caller gives up on at the
// timeout or a cancellation; every transfer is queued without blocking (the ranks are connected)
// and waited for by polling a CUDA event and the communicator's async error against a deadline,
// aborting the communicator on any failure.
#include "worker/transport/nccl_kv_link.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_check.h"
#include "worker/transport/nccl_transport.h"

namespace tandem {
namespace {

using Clock = std::chrono::steady_clock;

absl::Status NcclFailure(ncclResult_t r, const char* what, ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  return absl::InternalError(absl::StrCat("NCCL error ", ncclGetErrorString(r), " in ", what,
                                          last != nullptr && *last ? ": " : "",
                                          last != nullptr ? last : ""));
}

// Polls `done` (recorded behind the work) and `comm`'s async error until the work has run, the
// deadline passes or `cancelled` says so; spins the first millisecond (a transfer of tens of MB
// takes a fraction of one), then sleeps between looks.
absl::Status AwaitEvent(cudaEvent_t done, ncclComm_t comm, Clock::time_point deadline,
                        const std::function<bool()>& cancelled, const char* what) {
  const Clock::time_point start = Clock::now();
  for (;;) {
    const cudaError_t q = cudaEventQuery(done);
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) return cuda::CudaError(q, what, __FILE__, __LINE__);
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return NcclFailure(r, what, comm);
    if (state != ncclSuccess && state != ncclInProgress) return NcclFailure(state, what, comm);
    if (cancelled && cancelled()) return absl::CancelledError(absl::StrCat(what, ": cancelled"));
    const Clock::time_point now = Clock::now();
    if (now > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(what, ": the peer did not take part in time"));
    }
    if (now - start < std::chrono::milliseconds(1)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

// The communicator a joining thread made, handed to the caller or, if the caller gave up before
// it was done, aborted by the thread itself.
struct Joining {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  bool abandoned = false;
  absl::Status status;
  ncclComm_t comm = nullptr;
};

// On the joining thread: the blocking communicator, then one byte each way so that both ranks'
// connections exist before any transfer (a transfer then only queues work). Polls `abandoned`
// while the byte moves; the blocking init itself cannot be interrupted.
absl::Status JoinAndConnect(int device, int rank, const ncclUniqueId& id,
                            const std::atomic<bool>& abandoned, ncclComm_t* out) {
  CUDA_CHECK(cudaSetDevice(device));
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRank(&comm, 2, id, rank);
  if (r != ncclSuccess) {
    const absl::Status st = NcclFailure(r, "ncclCommInitRank (KV)", comm);
    if (comm != nullptr) ncclCommAbort(comm);
    return st;
  }
  cuda::Stream stream;
  cuda::DeviceBuffer buf;
  cuda::Event done;
  absl::Status st = stream.Create();
  if (st.ok()) st = buf.Allocate(2);
  if (st.ok()) st = done.Create();
  if (st.ok()) {
    ncclResult_t g = ncclGroupStart();
    if (g == ncclSuccess) g = ncclSend(buf.as<char>(), 1, ncclUint8, 1 - rank, comm, stream.get());
    if (g == ncclSuccess) {
      g = ncclRecv(buf.as<char>() + 1, 1, ncclUint8, 1 - rank, comm, stream.get());
    }
    const ncclResult_t end = ncclGroupEnd();
    if (g == ncclSuccess) g = end;
    if (g != ncclSuccess) st = NcclFailure(g, "connecting the KV link", comm);
  }
  if (st.ok()) {
    const cudaError_t e = cudaEventRecord(done.get(), stream.get());
    if (e != cudaSuccess) st = cuda::CudaError(e, "cudaEventRecord", __FILE__, __LINE__);
  }
  if (st.ok()) {
    st = AwaitEvent(
        done.get(), comm, Clock::time_point::max(), [&abandoned] { return abandoned.load(); },
        "connecting the KV link");
  }
  if (!st.ok()) {
    ncclCommAbort(comm);
    return st;
  }
  *out = comm;
  return absl::OkStatus();
}

}  // namespace

struct NcclKvLink::State {
  int device = 0;
  int rank = 0;
  absl::Duration timeout;
  ncclComm_t comm = nullptr;
  cuda::Stream stream;
  cuda::Event done;
  bool broken = false;

  ~State() {
    if (comm == nullptr) return;
    cudaSetDevice(device);
    // Every transfer was waited for, so nothing is in flight: aborting frees the communicator
    // without waiting for a peer that may be gone.
    ncclCommAbort(comm);
  }

  absl::Status Fail(absl::Status st) {
    broken = true;
    if (comm != nullptr) ncclCommAbort(comm);
    comm = nullptr;
    return st;
  }

  // ncclSend (`send`) or ncclRecv of every buffer, in order, as one NCCL group, waited for.
  template <typename Ptr>
  absl::Status Move(bool send, std::span<const std::pair<Ptr, size_t>> buffers) {
    if (broken || comm == nullptr) {
      return absl::FailedPreconditionError("the KV link broke earlier; join a new one");
    }
    CUDA_CHECK(cudaSetDevice(device));
    const char* what = send ? "ncclSend (KV)" : "ncclRecv (KV)";
    const int peer = 1 - rank;
    ncclResult_t r = ncclGroupStart();
    for (const auto& [p, bytes] : buffers) {
      if (r != ncclSuccess || bytes == 0) continue;
      void* at = const_cast<void*>(static_cast<const void*>(p));
      r = send ? ncclSend(at, bytes, ncclUint8, peer, comm, stream.get())
               : ncclRecv(at, bytes, ncclUint8, peer, comm, stream.get());
    }
    const ncclResult_t end = ncclGroupEnd();
    if (r == ncclSuccess) r = end;
    if (r != ncclSuccess) return Fail(NcclFailure(r, what, comm));
    const cudaError_t e = cudaEventRecord(done.get(), stream.get());
    if (e != cudaSuccess) return Fail(cuda::CudaError(e, "cudaEventRecord", __FILE__, __LINE__));
    const absl::Status st = AwaitEvent(
        done.get(), comm, Clock::now() + absl::ToChronoNanoseconds(timeout), nullptr, what);
    return st.ok() ? st : Fail(st);
  }
};

NcclKvLink::NcclKvLink(std::unique_ptr<State> state) : s_(std::move(state)) {}
NcclKvLink::~NcclKvLink() = default;

absl::StatusOr<std::unique_ptr<NcclKvLink>> NcclKvLink::Join(int device, int rank,
                                                             absl::string_view unique_id,
                                                             absl::Duration timeout,
                                                             std::function<bool()> cancelled) {
  RETURN_IF_ERROR(ValidateNcclUniqueId(unique_id));
  if (rank != 0 && rank != 1) {
    return absl::InvalidArgumentError(absl::StrCat("KV link rank ", rank, " (expected 0 or 1)"));
  }
  auto s = std::make_unique<State>();
  s->device = device;
  s->rank = rank;
  s->timeout = timeout;
  CUDA_CHECK(cudaSetDevice(device));
  RETURN_IF_ERROR(s->stream.Create());
  RETURN_IF_ERROR(s->done.Create());
  ncclUniqueId id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  // The blocking init waits for the peer without end, so it runs on a thread of its own: given
  // up on at the timeout or a cancellation, that thread aborts what it made if it ever finishes.
  auto joining = std::make_shared<Joining>();
  auto abandoned = std::make_shared<std::atomic<bool>>(false);
  std::thread([joining, abandoned, device, rank, id] {
    ncclComm_t comm = nullptr;
    absl::Status st = JoinAndConnect(device, rank, id, *abandoned, &comm);
    std::lock_guard<std::mutex> lock(joining->mu);
    if (joining->abandoned) {
      if (st.ok()) ncclCommAbort(comm);
      return;
    }
    joining->status = std::move(st);
    joining->comm = comm;
    joining->done = true;
    joining->cv.notify_all();
  }).detach();
  const Clock::time_point deadline = Clock::now() + absl::ToChronoNanoseconds(timeout);
  std::unique_lock<std::mutex> lock(joining->mu);
  while (!joining->done) {
    joining->cv.wait_for(lock, std::chrono::milliseconds(5));
    if (joining->done) break;
    const bool gone = cancelled && cancelled();
    if (gone || Clock::now() > deadline) {
      joining->abandoned = true;
      abandoned->store(true);
      return gone ? absl::CancelledError("joining the KV link: cancelled")
                  : absl::DeadlineExceededError(
                        absl::StrCat("joining the KV link: the peer did not join within ",
                                     absl::FormatDuration(timeout)));
    }
  }
  RETURN_IF_ERROR(joining->status);
  s->comm = joining->comm;
  return std::unique_ptr<NcclKvLink>(new NcclKvLink(std::move(s)));
}

absl::Status NcclKvLink::Send(std::span<const std::pair<const void*, size_t>> buffers) {
  return s_->Move(/*send=*/true, buffers);
}

absl::Status NcclKvLink::Recv(std::span<const std::pair<void*, size_t>> buffers) {
  return s_->Move(/*send=*/false, buffers);
}

absl::StatusOr<std::shared_ptr<uint8_t>> NcclKvLink::Allocate(size_t bytes) {
  CUDA_CHECK(cudaSetDevice(s_->device));
  void* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
  return std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [device = s_->device](uint8_t* q) {
    cudaSetDevice(device);
    cudaFree(q);
  });
}

bool NcclKvLink::broken() const { return s_->broken; }

}  // namespace tandem
