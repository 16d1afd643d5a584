// NcclTransport's frames: activations sent to the next stage and received from the previous one
// (waited for on the host, or posted so that the step queues behind the receive on the device),
// and the last stage's sampled tokens back to the first.
#include "worker/transport/nccl_transport.h"

#include "worker/transport/nccl_transport_state.h"

namespace tandem {

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

absl::StatusOr<bool> NcclTransport::BindStage(Stage& stage) {
  ASSIGN_OR_RETURN(void* stream, stage.DeviceStream());
  RETURN_IF_ERROR(UseStream(stream));
  RETURN_IF_ERROR(stage.SetStreamWatch([this] { return Watch(); }));
  return true;
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
