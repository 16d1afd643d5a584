// Joining and closing the NcclTransport's communicators: the root one every rank joins, the
// blocking data one (and the first and last ranks' token one) joined through it on threads the
// caller can give up on at a deadline; the unique ids and options they start from.
#include "worker/transport/nccl_transport_state.h"

namespace tandem {

absl::Status NcclError(ncclResult_t r, const char* expr, const char* file, int line,
                       ncclComm_t comm) {
  const char* last = comm != nullptr ? ncclGetLastError(comm) : ncclGetLastError(nullptr);
  return absl::InternalError(
      absl::StrCat("NCCL error ", ncclGetErrorString(r), " in ", expr, " at ", file, ":", line,
                   last != nullptr && *last ? ": " : "", last != nullptr ? last : ""));
}

absl::Status JoinDataComm(int device, int rank, int world, const ncclUniqueId& id, const char* name,
                          const std::atomic<bool>& abandoned, ncclComm_t* out) {
  CUDA_CHECK(cudaSetDevice(device));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, world, id, rank, &config);
  if (r != ncclSuccess) {
    const absl::Status st = NcclError(
        r, absl::StrCat("ncclCommInitRankConfig (", name, ")").c_str(), __FILE__, __LINE__, comm);
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

absl::StatusOr<std::string> MakeNcclUniqueId() {
  ncclUniqueId id;
  NCCL_CHECK(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

absl::Status ValidateNcclUniqueId(absl::string_view bytes) {
  if (bytes.size() != kNcclUniqueIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("an NCCL unique id has ", kNcclUniqueIdBytes, " bytes, got ", bytes.size()));
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

namespace {

// The frame buffers, events and streams of `s`'s rank: every rank but the last sends activations
// and the last sends tokens back to the first; the first receives tokens, the others activations.
absl::Status AllocateFrames(NcclTransport::State& s) {
  const NcclTransportOptions& o = s.opt;
  // Frame buffers hold the header region and at least a first message's payload.
  const size_t act_bytes = kHeaderRegion + std::max(static_cast<size_t>(o.max_rows) * s.row_bytes(),
                                                    kInlineActivationBytes);
  const size_t tok_bytes =
      kHeaderRegion +
      std::max(static_cast<size_t>(o.max_rows) * sizeof(int32_t), kInlineTokenBytes);
  if (o.world == 1) return absl::OkStatus();
  const size_t send_bytes = s.last() ? tok_bytes : act_bytes;
  for (NcclTransport::State::SendSlot& slot : s.send) {
    RETURN_IF_ERROR(slot.frame.Allocate(send_bytes));
    // The last rank's token frames are staged whole in pinned memory (SendFrame).
    RETURN_IF_ERROR(slot.host_header.Allocate(s.last() ? kHeaderRegion + kInlineTokenBytes
                                                       : sizeof(FrameHeader)));
    RETURN_IF_ERROR(slot.copied.Create());
    RETURN_IF_ERROR(slot.sent.Create());
  }
  // Ranks but the first receive activations; the first receives tokens.
  const size_t recv_bytes = o.rank == 0 ? tok_bytes : act_bytes;
  for (int i = 0; i < 2; ++i) {
    RETURN_IF_ERROR(s.recv_frame[i].Allocate(recv_bytes));
    RETURN_IF_ERROR(s.recv_done[i].Create());
    RETURN_IF_ERROR(s.posted_header[i].Allocate(sizeof(FrameHeader)));
    RETURN_IF_ERROR(s.posted_header_done[i].Create());
  }
  RETURN_IF_ERROR(s.recv_host.Allocate(o.rank == 0 ? tok_bytes : kHeaderRegion));
  RETURN_IF_ERROR(s.header_done.Create());
  if (o.rank == 0) RETURN_IF_ERROR(s.token_stream.Create());
  if (o.rank == 0) {
    for (NcclTransport::State::PostedTokenRecv& r : s.token_recv) {
      RETURN_IF_ERROR(r.frame.Allocate(tok_bytes));
      RETURN_IF_ERROR(r.host.Allocate(tok_bytes));
      RETURN_IF_ERROR(r.done.Create());
    }
  }
  return absl::OkStatus();
}

// Joins the root communicator every rank joins, waiting for every rank until the options'
// timeout (a rank that never comes ends it); on failure `s` is aborted with the error.
absl::Status JoinRoot(NcclTransport::State& s, absl::string_view unique_id) {
  const NcclTransportOptions& o = s.opt;
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t r = ncclCommInitRankConfig(&s.root, o.world, id, o.rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    const absl::Status st = NcclError(r, "ncclCommInitRankConfig", __FILE__, __LINE__, s.root);
    s.Abort(st);
    return st;
  }
  // Joining waits for every rank; a rank that never comes ends it at the timeout.
  const auto deadline = Clock::now() + ToChrono(o.timeout);
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(s.root, &state);
    if (q != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
      const absl::Status st = NcclError(q != ncclSuccess ? q : state, "ncclCommInitRankConfig",
                                        __FILE__, __LINE__, s.root);
      s.Abort(st);
      return st;
    }
    if (state == ncclSuccess) break;
    if (Clock::now() > deadline) {
      const absl::Status st = absl::DeadlineExceededError(absl::StrCat(
          "rank ", o.rank, " of ", o.world, " could not join the NCCL communicator within ",
          absl::FormatDuration(o.timeout), "; a stage did not join"));
      s.Abort(st);
      return st;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return absl::OkStatus();
}

// The ids of the data and token communicators: made by rank 0 (which hosts their bootstrap
// roots), broadcast over the root communicator while every rank is known to be present. Every
// rank joins the data communicator, the first and the last the token one, both at once.
absl::Status JoinData(NcclTransport::State& s) {
  const NcclTransportOptions& o = s.opt;
  cuda::DeviceBuffer id_dev;
  ncclUniqueId ids[2];  // data, tokens
  static_assert(sizeof(ids) <= kHeaderRegion);
  RETURN_IF_ERROR(id_dev.Allocate(sizeof(ids)));
  if (o.rank == 0) {
    NCCL_CHECK(ncclGetUniqueId(&ids[0]));
    NCCL_CHECK(ncclGetUniqueId(&ids[1]));
    CUDA_CHECK(cudaMemcpy(id_dev.get(), ids, sizeof(ids), cudaMemcpyHostToDevice));
  }
  const cudaStream_t ns = s.comm();
  NCCL_ISSUE(s, ncclBroadcast(id_dev.get(), id_dev.get(), sizeof(ids), ncclUint8, 0, s.root, ns));
  CUDA_CHECK(
      cudaMemcpyAsync(s.recv_host.get(), id_dev.get(), sizeof(ids), cudaMemcpyDeviceToHost, ns));
  CUDA_CHECK(cudaEventRecord(s.header_done.get(), ns));
  RETURN_IF_ERROR(s.Wait(s.header_done.get(), nullptr, "the data communicator's id"));
  std::memcpy(ids, s.recv_host.get(), sizeof(ids));

  s.token_id = ids[1];  // joined by SeparateTokens
  const absl::Status st = s.JoinBlocking(o.rank, o.world, ids[0], "data", &s.data);
  if (!st.ok()) return s.Fail(st);
  return absl::OkStatus();
}

}  // namespace

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
  RETURN_IF_ERROR(AllocateFrames(*s));
  RETURN_IF_ERROR(JoinRoot(*s, unique_id));
  if (options.world > 1) RETURN_IF_ERROR(JoinData(*s));
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

}  // namespace tandem
