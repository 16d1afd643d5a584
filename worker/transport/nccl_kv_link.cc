// NcclKvLink: ncclSend/ncclRecv of KV-cache bytes on a non-blocking two-rank communicator, every
// wait polling the communicator's async error and a CUDA event against a deadline.
#include "worker/transport/nccl_kv_link.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_check.h"
#include "worker/transport/nccl_transport.h"

namespace tandem {
namespace {

absl::Status NcclFailure(ncclResult_t r, const char* what, ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  return absl::InternalError(absl::StrCat("NCCL error ", ncclGetErrorString(r), " in ", what,
                                          last != nullptr && *last ? ": " : "",
                                          last != nullptr ? last : ""));
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

  // Waits until the communicator has no call in progress, then, if `event_recorded`, until the
  // stream's work up to `done` has run; polls both against the timeout (and `cancelled`). Any
  // failure aborts the communicator.
  absl::Status Wait(const char* what, bool event_recorded,
                    const std::function<bool()>& cancelled = {}) {
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::nanoseconds(absl::ToInt64Nanoseconds(timeout));
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
      if (r != ncclSuccess) return Fail(NcclFailure(r, what, comm));
      if (state != ncclSuccess && state != ncclInProgress) {
        return Fail(NcclFailure(state, what, comm));
      }
      if (state == ncclSuccess) {
        if (!event_recorded) return absl::OkStatus();
        const cudaError_t q = cudaEventQuery(done.get());
        if (q == cudaSuccess) return absl::OkStatus();
        if (q != cudaErrorNotReady) return Fail(cuda::CudaError(q, what, __FILE__, __LINE__));
      }
      if (cancelled && cancelled()) {
        return Fail(absl::CancelledError(absl::StrCat(what, ": cancelled")));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return Fail(absl::DeadlineExceededError(absl::StrCat(
            what, ": the peer did not take part within ", absl::FormatDuration(timeout))));
      }
      // Spinning the first millisecond (a transfer of tens of MB takes a fraction of one), then
      // sleeping between looks.
      if (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(1)) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  absl::Status Fail(absl::Status st) {
    broken = true;
    ncclCommAbort(comm);
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
    if (r != ncclSuccess && r != ncclInProgress) return Fail(NcclFailure(r, what, comm));
    RETURN_IF_ERROR(Wait(what, /*event_recorded=*/false));
    const cudaError_t e = cudaEventRecord(done.get(), stream.get());
    if (e != cudaSuccess) return Fail(cuda::CudaError(e, "cudaEventRecord", __FILE__, __LINE__));
    return Wait(what, /*event_recorded=*/true);
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
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t r = ncclCommInitRankConfig(&s->comm, 2, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (s->comm == nullptr) return NcclFailure(r, "ncclCommInitRankConfig (KV)", nullptr);
    return s->Fail(NcclFailure(r, "ncclCommInitRankConfig (KV)", s->comm));
  }
  RETURN_IF_ERROR(s->Wait("joining the KV link", /*event_recorded=*/false, cancelled));
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
