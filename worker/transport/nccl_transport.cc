// NcclTransport: framed ncclSend/ncclRecv between neighbouring stages on a non-blocking
// communicator; every wait polls the communicator's async error against a deadline.
#include "worker/transport/nccl_transport.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
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

// A call on the transport's non-blocking communicator: ncclInProgress is waited out (bounded by
// the timeout), any failure aborts the communicator.
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

std::chrono::nanoseconds ToChrono(absl::Duration d) {
  return std::chrono::nanoseconds(absl::ToInt64Nanoseconds(d));
}

const char* KindName(uint32_t kind) {
  return kind == kActivationFrame ? "activations" : kind == kTokenFrame ? "tokens" : "unknown";
}

}  // namespace

struct NcclTransport::State {
  NcclTransportOptions opt;
  ncclComm_t root = nullptr;  // the non-blocking communicator every rank joined
  ncclComm_t comm = nullptr;  // where frames move (root; kept apart for a separate data comm)
  absl::Status broken;  // OK while the communicator is usable; the abort's reason after
  cuda::Stream comm_stream;  // every ncclSend/ncclRecv, in issue order
  cuda::Stream copy_stream;  // staging copies into send buffers, never behind a waiting send

  // Two send buffers, alternated: a send may wait for the next stage while the next is staged.
  struct SendSlot {
    cuda::DeviceBuffer payload, header;
    cuda::PinnedBuffer host_header;
    cuda::Event copied, sent;
    bool in_flight = false;
  };
  SendSlot send[2];
  uint64_t sends = 0;

  // Two receive buffers, alternated: a returned buffer stays valid through the next Recv.
  cuda::DeviceBuffer recv_payload[2];
  cuda::Event recv_done[2];
  uint64_t recvs = 0;
  cuda::DeviceBuffer recv_header;
  cuda::PinnedBuffer recv_host_header, recv_host_tokens;
  cuda::Event header_done;

  size_t row_bytes() const { return static_cast<size_t>(opt.hidden_size) * DTypeSize(opt.dtype); }
  bool last() const { return opt.rank == opt.world - 1; }

  absl::Status Healthy() const {
    if (broken.ok()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "NCCL transport of rank ", opt.rank, " was aborted: ", std::string(broken.message())));
  }

  void Abort(const absl::Status& reason) {
    if (!broken.ok()) return;
    broken = reason.ok() ? absl::CancelledError("aborted") : reason;
    cudaSetDevice(opt.device);
    if (comm != nullptr && comm != root) ncclCommAbort(comm);
    if (root != nullptr) ncclCommAbort(root);
    comm = root = nullptr;
  }

  // Fails (and aborts) with `st`.
  absl::Status Fail(absl::Status st) {
    Abort(st);
    return st;
  }

  absl::Status Issue(ncclResult_t r, const char* expr, const char* file, int line,
                     const std::function<bool()>* cancelled = nullptr) {
    if (r == ncclSuccess) return absl::OkStatus();
    if (r != ncclInProgress) return Fail(NcclError(r, expr, file, line, comm));
    const auto deadline = Clock::now() + ToChrono(opt.timeout);
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
      if (q != ncclSuccess) return Fail(NcclError(q, "ncclCommGetAsyncError", file, line, comm));
      if (cancelled != nullptr && *cancelled && (*cancelled)()) {
        return Fail(absl::CancelledError(absl::StrCat("cancelled on rank ", opt.rank, " in ", expr)));
      }
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) return Fail(NcclError(state, expr, file, line, comm));
      if (Clock::now() > deadline) {
        return Fail(absl::DeadlineExceededError(
            absl::StrCat(expr, " on rank ", opt.rank, " did not complete within ",
                         absl::FormatDuration(opt.timeout))));
      }
      std::this_thread::yield();
    }
  }

  // Polls `event` until it completes; the peer's failure, a timeout or `cancelled` abort.
  absl::Status Wait(cudaEvent_t event, const std::function<bool()>* cancelled,
                    const std::string& what) {
    const auto deadline = Clock::now() + ToChrono(opt.timeout);
    for (uint64_t i = 0;; ++i) {
      const cudaError_t q = cudaEventQuery(event);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) return Fail(cuda::CudaError(q, "cudaEventQuery", __FILE__, __LINE__));
      if (comm != nullptr) {
        ncclResult_t state = ncclSuccess;
        const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
        if (r != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
          return Fail(absl::UnavailableError(absl::StrCat(
              "NCCL failed on rank ", opt.rank, " while waiting for ", what, ": ",
              ncclGetErrorString(r != ncclSuccess ? r : state), ": ", ncclGetLastError(comm))));
        }
      }
      if ((i & 63) == 0) {
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

  // Sends one frame to `peer`: header, then `bytes` of payload staged by the caller (device
  // pointer `src`, `src_where`) through send slot sends % 2.
  absl::Status SendFrame(int peer, uint32_t kind, uint64_t step_id, int64_t rows, int64_t cols,
                         const void* src, size_t bytes, cudaMemcpyKind copy_kind) {
    SendSlot& slot = send[sends % 2];
    if (slot.in_flight) {
      RETURN_IF_ERROR(Wait(slot.sent.get(), nullptr,
                           absl::StrCat("rank ", peer, " to take an earlier frame")));
      slot.in_flight = false;
    }
    if (bytes > slot.payload.size()) {
      return absl::InvalidArgumentError(absl::StrCat("a ", KindName(kind), " frame of ", bytes,
                                                     " bytes exceeds the send buffer of ",
                                                     slot.payload.size(), " bytes"));
    }
    FrameHeader* h = slot.host_header.as<FrameHeader>();
    *h = FrameHeader{kFrameMagic, step_id, rows, cols, kind,
                     static_cast<uint32_t>(opt.dtype), {0, 0, 0}};
    const cudaStream_t cs = copy_stream.get();
    if (bytes > 0) CUDA_CHECK(cudaMemcpyAsync(slot.payload.get(), src, bytes, copy_kind, cs));
    CUDA_CHECK(cudaMemcpyAsync(slot.header.get(), h, sizeof(FrameHeader), cudaMemcpyHostToDevice,
                               cs));
    CUDA_CHECK(cudaEventRecord(slot.copied.get(), cs));
    // The caller's memory is free again once the staging copy is done.
    RETURN_IF_ERROR(Wait(slot.copied.get(), nullptr, "the staging copy"));
    const cudaStream_t ns = comm_stream.get();
    CUDA_CHECK(cudaStreamWaitEvent(ns, slot.copied.get(), 0));
    // One group: a single launch for header and payload.
    NCCL_ISSUE(*this, ncclGroupStart());
    ncclResult_t r = ncclSend(slot.header.get(), sizeof(FrameHeader), ncclUint8, peer, comm, ns);
    if (r == ncclSuccess && bytes > 0) {
      r = ncclSend(slot.payload.get(), bytes, ncclUint8, peer, comm, ns);
    }
    const ncclResult_t end = ncclGroupEnd();
    NCCL_ISSUE(*this, r);
    NCCL_ISSUE(*this, end);
    CUDA_CHECK(cudaEventRecord(slot.sent.get(), ns));
    slot.in_flight = true;
    ++sends;
    return absl::OkStatus();
  }

  // Receives the header of the next frame from `peer` and checks it against what is expected.
  absl::StatusOr<FrameHeader> RecvHeader(int peer, uint32_t kind, uint64_t step_id,
                                         const std::function<bool()>& cancelled) {
    const cudaStream_t ns = comm_stream.get();
    NCCL_ISSUE_C(*this, ncclRecv(recv_header.get(), sizeof(FrameHeader), ncclUint8, peer, comm, ns),
                 cancelled);
    CUDA_CHECK(cudaMemcpyAsync(recv_host_header.get(), recv_header.get(), sizeof(FrameHeader),
                               cudaMemcpyDeviceToHost, ns));
    CUDA_CHECK(cudaEventRecord(header_done.get(), ns));
    RETURN_IF_ERROR(Wait(header_done.get(), &cancelled,
                         absl::StrCat("step ", step_id, "'s ", KindName(kind), " from rank ", peer)));
    const FrameHeader h = *recv_host_header.as<FrameHeader>();
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
  RETURN_IF_ERROR(s->comm_stream.Create());
  RETURN_IF_ERROR(s->copy_stream.Create());
  const size_t act_bytes = static_cast<size_t>(options.max_rows) * s->row_bytes();
  const size_t tok_bytes = static_cast<size_t>(options.max_rows) * sizeof(int32_t);
  if (options.world > 1) {
    // Ranks but the last send activations; the last sends tokens back to the first.
    const size_t send_bytes = s->last() ? tok_bytes : act_bytes;
    for (State::SendSlot& slot : s->send) {
      RETURN_IF_ERROR(slot.payload.Allocate(send_bytes));
      RETURN_IF_ERROR(slot.header.Allocate(sizeof(FrameHeader)));
      RETURN_IF_ERROR(slot.host_header.Allocate(sizeof(FrameHeader)));
      RETURN_IF_ERROR(slot.copied.Create());
      RETURN_IF_ERROR(slot.sent.Create());
    }
    // Ranks but the first receive activations; the first receives tokens.
    const size_t recv_bytes = options.rank == 0 ? tok_bytes : act_bytes;
    for (int i = 0; i < 2; ++i) {
      RETURN_IF_ERROR(s->recv_payload[i].Allocate(recv_bytes));
      RETURN_IF_ERROR(s->recv_done[i].Create());
    }
    RETURN_IF_ERROR(s->recv_header.Allocate(sizeof(FrameHeader)));
    RETURN_IF_ERROR(s->recv_host_header.Allocate(sizeof(FrameHeader)));
    if (options.rank == 0) RETURN_IF_ERROR(s->recv_host_tokens.Allocate(tok_bytes));
    RETURN_IF_ERROR(s->header_done.Create());
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
  s->comm = s->root;
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
  s_->comm = s_->root;
  const ncclResult_t r = ncclCommFinalize(s_->root);
  if (r != ncclSuccess && r != ncclInProgress) {
    s_->Abort(absl::CancelledError("the communicator did not finalize"));
    return;
  }
  // Finalizing waits until the communicator is quiet on every rank; a gone peer ends it.
  const auto deadline = Clock::now() + ToChrono(std::min(s_->opt.timeout, absl::Seconds(30)));
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
  s_->comm = s_->root = nullptr;
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
  RETURN_IF_ERROR(s.Healthy());
  if (s.opt.rank == 0) {
    return absl::FailedPreconditionError("rank 0 is the first stage and receives no activations");
  }
  if (cancelled && cancelled()) {
    return absl::CancelledError(absl::StrCat("step ", step_id, ": cancelled before receiving"));
  }
  CUDA_CHECK(cudaSetDevice(s.opt.device));
  const int peer = s.opt.rank - 1;
  ASSIGN_OR_RETURN(FrameHeader h, s.RecvHeader(peer, kActivationFrame, step_id, cancelled));
  const int i = static_cast<int>(s.recvs % 2);
  Activations a;
  a.rows = h.rows;
  a.cols = h.cols;
  a.dtype = s.opt.dtype;
  a.where = Where::kDevice;
  const size_t bytes = a.nbytes();
  if (bytes > 0) {
    const cudaStream_t ns = s.comm_stream.get();
    NCCL_ISSUE_C(s, ncclRecv(s.recv_payload[i].get(), bytes, ncclUint8, peer, s.comm, ns),
                 cancelled);
    CUDA_CHECK(cudaEventRecord(s.recv_done[i].get(), ns));
    RETURN_IF_ERROR(s.Wait(s.recv_done[i].get(), &cancelled,
                           absl::StrCat("step ", step_id, "'s activations from rank ", peer)));
  }
  a.data = std::shared_ptr<void>(s.recv_payload[i].get(), [](void*) {});
  ++s.recvs;
  return a;
}

absl::Status NcclTransport::SendTokens(uint64_t step_id, const std::vector<int32_t>& tokens) {
  State& s = *s_;
  RETURN_IF_ERROR(s.Healthy());
  if (!s.last() || s.opt.world < 2) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", s.opt.rank, " of ", s.opt.world,
        ": only the last stage of a pipeline of 2 or more returns tokens to the first"));
  }
  if (static_cast<int64_t>(tokens.size()) > s.opt.max_rows) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step_id, ": ", tokens.size(),
                                                   " tokens exceed max_rows = ", s.opt.max_rows));
  }
  CUDA_CHECK(cudaSetDevice(s.opt.device));
  return s.SendFrame(0, kTokenFrame, step_id, static_cast<int64_t>(tokens.size()), 1,
                     tokens.data(), tokens.size() * sizeof(int32_t), cudaMemcpyHostToDevice);
}

absl::StatusOr<std::vector<int32_t>> NcclTransport::RecvTokens(
    uint64_t step_id, const std::function<bool()>& cancelled) {
  State& s = *s_;
  RETURN_IF_ERROR(s.Healthy());
  if (s.opt.rank != 0 || s.opt.world < 2) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", s.opt.rank, " of ", s.opt.world,
        ": only the first stage of a pipeline of 2 or more receives tokens"));
  }
  if (cancelled && cancelled()) {
    return absl::CancelledError(absl::StrCat("step ", step_id, ": cancelled before receiving"));
  }
  CUDA_CHECK(cudaSetDevice(s.opt.device));
  const int peer = s.opt.world - 1;
  ASSIGN_OR_RETURN(FrameHeader h, s.RecvHeader(peer, kTokenFrame, step_id, cancelled));
  std::vector<int32_t> tokens(static_cast<size_t>(h.rows));
  if (h.rows > 0) {
    const size_t bytes = tokens.size() * sizeof(int32_t);
    const cudaStream_t ns = s.comm_stream.get();
    NCCL_ISSUE_C(s, ncclRecv(s.recv_payload[0].get(), bytes, ncclUint8, peer, s.comm, ns),
                 cancelled);
    CUDA_CHECK(cudaMemcpyAsync(s.recv_host_tokens.get(), s.recv_payload[0].get(), bytes,
                               cudaMemcpyDeviceToHost, ns));
    CUDA_CHECK(cudaEventRecord(s.recv_done[0].get(), ns));
    RETURN_IF_ERROR(s.Wait(s.recv_done[0].get(), &cancelled,
                           absl::StrCat("step ", step_id, "'s tokens from rank ", peer)));
    std::memcpy(tokens.data(), s.recv_host_tokens.get(), bytes);
  }
  return tokens;
}

void NcclTransport::Abort(const absl::Status& reason) { s_->Abort(reason); }
bool NcclTransport::aborted() const { return !s_->broken.ok(); }
int NcclTransport::rank() const { return s_->opt.rank; }
int NcclTransport::world() const { return s_->opt.world; }

}  // namespace tandem
