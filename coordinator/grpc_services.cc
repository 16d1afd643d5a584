// gRPC handlers. A generation handler submits the request, then waits on it, streaming tokens as
// they come and watching the client's cancellation and the deadline.
#include "coordinator/grpc_services.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "common/dtype.h"
#include "common/utf8.h"
#include "coordinator/peer_address.h"
#include "coordinator/request_group.h"
#include "coordinator/request_stream.h"
#include "spdlog/spdlog.h"

namespace tandem {
namespace {

// Follows a request's sequences for a gRPC call: its deadline and its cancellation.
absl::StatusOr<std::vector<RequestState::Snapshot>> Follow(
    Coordinator& c, grpc::ServerContext* ctx,
    const std::vector<std::shared_ptr<RequestState>>& choices,
    const OnChoiceProgress& on_progress) {
  return FollowChoices(c, choices, absl::FromChrono(ctx->deadline()),
                       [ctx] { return ctx->IsCancelled(); }, on_progress);
}

double Seconds(absl::Time from, absl::Time to) {
  if (to == absl::InfinitePast() || from == absl::InfinitePast()) return 0;
  return absl::ToDoubleSeconds(to - from);
}

// Usage over every sequence; timings from the first admission and first token to the last end.
void FillSummary(const std::vector<std::shared_ptr<RequestState>>& choices,
                 const std::vector<RequestState::Snapshot>& snaps, v1::Usage* usage,
                 v1::Timings* timings) {
  const ChoicesUsage u = CountUsage(choices, snaps);
  usage->set_prompt_tokens(u.prompt_tokens);
  usage->set_completion_tokens(u.completion_tokens);
  const absl::Time arrival = choices[0]->arrival();
  absl::Time admitted = absl::InfiniteFuture(), first = absl::InfiniteFuture();
  absl::Time finished = absl::InfinitePast();
  for (const RequestState::Snapshot& s : snaps) {
    if (s.admitted != absl::InfinitePast()) admitted = std::min(admitted, s.admitted);
    if (s.first_token != absl::InfinitePast()) first = std::min(first, s.first_token);
    finished = std::max(finished, s.finished);
  }
  auto seen = [](absl::Time t) { return t == absl::InfiniteFuture() ? absl::InfinitePast() : t; };
  timings->set_queue_seconds(Seconds(arrival, seen(admitted)));
  timings->set_time_to_first_token_seconds(Seconds(arrival, seen(first)));
  timings->set_total_seconds(Seconds(arrival, finished));
}

void ToProto(const TokenLogprob& in, v1::TokenLogprob* out) {
  out->set_token_id(in.token);
  out->set_logprob(in.logprob);
  for (const auto& [token, logprob] : in.top) {
    v1::TopLogprob* t = out->add_top_logprobs();
    t->set_token_id(token);
    t->set_logprob(logprob);
  }
}

// logprobs[from, to) into `out` (fewer when the request asked for none).
void AddLogprobs(const std::vector<TokenLogprob>& logprobs, size_t from, size_t to,
                 google::protobuf::RepeatedPtrField<v1::TokenLogprob>* out) {
  for (size_t i = from; i < std::min(to, logprobs.size()); ++i) ToProto(logprobs[i], out->Add());
}

// The answer of an Admin call that changes the topology: the new one, or why not.
grpc::Status TopologyReply(absl::StatusOr<v1::Topology> topology, v1::Topology* resp) {
  if (!topology.ok()) return ToGrpcStatus(topology.status());
  *resp = *std::move(topology);
  return grpc::Status::OK;
}

// Counts a request refused before it was submitted (invalid, or the queue is full).
grpc::Status Rejected(Coordinator& c, const absl::Status& why) {
  RecordRejected(c, why);
  return ToGrpcStatus(why);
}

}  // namespace

grpc::Status InferenceService::Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                                        v1::GenerateResponse* resp) {
  if (grpc::Status a = CheckCaller(*ctx, access_); !a.ok()) return a;
  absl::StatusOr<ValidatedRequest> v = ValidateRequest(*req, c_.limits(), c_.tokenizer());
  if (!v.ok()) return Rejected(c_, v.status());
  absl::StatusOr<std::vector<std::shared_ptr<RequestState>>> r = SubmitChoices(c_, {*std::move(v)});
  if (!r.ok()) return Rejected(c_, r.status());
  absl::StatusOr<std::vector<RequestState::Snapshot>> s =
      Follow(c_, ctx, *r, [](int, const RequestState::Snapshot&) { return true; });
  RecordEnd(c_, *(*r)[0], s.status());
  if (!s.ok()) return ToGrpcStatus(s.status());
  resp->set_request_id((*r)[0]->request().request_id);
  for (size_t i = 0; i < s->size(); ++i) {
    const RequestState::Snapshot& snap = (*s)[i];
    v1::Choice* choice = resp->add_choices();
    choice->set_index(static_cast<int>(i));
    choice->mutable_token_ids()->Assign(snap.tokens.begin(), snap.tokens.end());
    if (c_.tokenizer() != nullptr) {
      absl::StatusOr<std::string> text = c_.tokenizer()->Decode(snap.tokens);
      if (text.ok()) {
        if (snap.text_limit >= 0) text->resize(std::min<size_t>(text->size(), snap.text_limit));
        choice->set_text(ToValidUtf8(*text));
      }
    }
    choice->set_finish_reason(snap.finish);
    AddLogprobs(snap.logprobs, 0, snap.logprobs.size(), choice->mutable_logprobs());
  }
  const v1::Choice& first = resp->choices(0);
  *resp->mutable_token_ids() = first.token_ids();
  resp->set_text(first.text());
  resp->set_finish_reason(first.finish_reason());
  const std::vector<TokenLogprob>& prompt = (*s)[0].prompt_logprobs;
  AddLogprobs(prompt, 0, prompt.size(), resp->mutable_prompt_logprobs());
  FillSummary(*r, *s, resp->mutable_usage(), resp->mutable_timings());
  return grpc::Status::OK;
}

grpc::Status InferenceService::GenerateStream(
    grpc::ServerContext* ctx, const v1::GenerateRequest* req,
    grpc::ServerWriter<v1::GenerateStreamResponse>* writer) {
  if (grpc::Status a = CheckCaller(*ctx, access_); !a.ok()) return a;
  absl::StatusOr<ValidatedRequest> v = ValidateRequest(*req, c_.limits(), c_.tokenizer());
  if (!v.ok()) return Rejected(c_, v.status());
  absl::StatusOr<std::vector<std::shared_ptr<RequestState>>> r = SubmitChoices(c_, {*std::move(v)});
  if (!r.ok()) return Rejected(c_, r.status());
  const std::vector<std::shared_ptr<RequestState>>& choices = *r;
  const std::string& request_id = choices[0]->request().request_id;
  const size_t n = choices.size();
  std::vector<TextStream> texts;
  for (const auto& c : choices) texts.emplace_back(c_.tokenizer(), c->request().stop_strings);
  std::vector<size_t> sent_tokens(n, 0);
  bool sent_prompt = false;
  // Calls are serialized by FollowChoices.
  auto on_progress = [&](int i, const RequestState::Snapshot& s) {
    if (s.done && !s.status.ok()) return true;  // the error goes in the call's status
    v1::GenerateStreamResponse msg;
    msg.set_request_id(request_id);
    msg.set_index(i);
    for (size_t k = sent_tokens[i]; k < s.tokens.size(); ++k) msg.add_token_ids(s.tokens[k]);
    AddLogprobs(s.logprobs, sent_tokens[i], s.tokens.size(), msg.mutable_logprobs());
    sent_tokens[i] = s.tokens.size();
    if (i == 0 && !sent_prompt) {
      AddLogprobs(s.prompt_logprobs, 0, s.prompt_logprobs.size(), msg.mutable_prompt_logprobs());
      sent_prompt = true;
    }
    msg.set_text(texts[i].Next(TextTokens(s.tokens, s.done, s.finish), s.done, s.text_limit));
    if (s.done) {
      msg.set_finish_reason(s.finish);
      // One sequence: its last message is the stream's and carries the summary.
      if (n == 1) FillSummary(choices, {s}, msg.mutable_usage(), msg.mutable_timings());
    }
    return writer->Write(msg);
  };
  absl::StatusOr<std::vector<RequestState::Snapshot>> s = Follow(c_, ctx, choices, on_progress);
  RecordEnd(c_, *choices[0], s.status());
  if (s.ok() && n > 1) {
    v1::GenerateStreamResponse last;
    last.set_request_id(request_id);
    FillSummary(choices, *s, last.mutable_usage(), last.mutable_timings());
    writer->Write(last);
  }
  return ToGrpcStatus(s.status());
}

grpc::Status InferenceService::GetModelInfo(grpc::ServerContext* ctx,
                                            const v1::GetModelInfoRequest*, v1::ModelInfo* resp) {
  if (grpc::Status a = CheckCaller(*ctx, access_); !a.ok()) return a;
  const ModelConfig& m = c_.model();
  resp->set_model_dir(c_.config().model_dir.string());
  resp->set_architecture(std::string(ArchName(m.arch)));
  resp->set_model_type(m.model_type);
  resp->set_vocab_size(m.vocab_size);
  resp->set_hidden_size(m.hidden_size);
  resp->set_num_layers(m.num_layers);
  resp->set_context_length(c_.limits().context_length);
  resp->set_eos_token_id(c_.limits().eos_token_id);
  resp->set_has_tokenizer(c_.tokenizer() != nullptr);
  const TextConfig& text = c_.text_config();
  resp->set_bos_token_id(text.bos_token_id.value_or(-1));
  for (int32_t id : text.eos_token_ids) resp->add_eos_token_ids(id);
  resp->set_add_bos_token(text.add_bos_token);
  resp->set_has_chat_template(!text.chat_template.empty());
  resp->set_max_length(text.max_length.value_or(0));
  resp->set_dtype(std::string(TorchDTypeName(m.dtype)));
  resp->set_max_slots(MaxSlots(c_.config()));
  resp->set_max_batch(MaxBatch(c_.config()));
  resp->set_kv_cache_dtype(std::string(KvCacheDTypeName(KvCacheDTypeOf(c_.config()))));
  return grpc::Status::OK;
}

grpc::Status AdminService::GetTopology(grpc::ServerContext* ctx, const v1::GetTopologyRequest*,
                                       v1::Topology* resp) {
  if (grpc::Status a = CheckCaller(*ctx, access_); !a.ok()) return a;
  *resp = c_.GetTopology();
  return grpc::Status::OK;
}

grpc::Status AdminService::SetTopology(grpc::ServerContext* ctx,
                                       const v1::SetTopologyRequest* req, v1::Topology* resp) {
  if (grpc::Status a = CheckCaller(*ctx, access_); !a.ok()) return a;
  return TopologyReply(
      c_.SetTopology(
          req->stages(), req->replicas(),
          req->has_prefill_replicas() ? std::optional<int>(req->prefill_replicas()) : std::nullopt,
          req->has_tensor_parallel() ? std::optional<int>(req->tensor_parallel()) : std::nullopt),
      resp);
}

grpc::Status AdminService::ListWorkers(grpc::ServerContext* ctx, const v1::ListWorkersRequest*,
                                       v1::ListWorkersResponse* resp) {
  if (grpc::Status a = CheckCaller(*ctx, access_); !a.ok()) return a;
  for (v1::WorkerInfo& w : c_.ListWorkers()) *resp->add_workers() = std::move(w);
  return grpc::Status::OK;
}

grpc::Status AdminService::Drain(grpc::ServerContext* ctx, const v1::DrainRequest* req,
                                 v1::Topology* resp) {
  if (grpc::Status a = CheckCaller(*ctx, access_); !a.ok()) return a;
  return TopologyReply(c_.Drain(req->worker_id()), resp);
}

grpc::Status AdminService::Undrain(grpc::ServerContext* ctx, const v1::UndrainRequest* req,
                                   v1::Topology* resp) {
  if (grpc::Status a = CheckCaller(*ctx, access_); !a.ok()) return a;
  return TopologyReply(c_.Undrain(req->worker_id()), resp);
}

grpc::Status RegistryService::Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req,
                                       v1::RegisterResponse* resp) {
  if (grpc::Status a = CheckCaller(*ctx, access_); !a.ok()) return a;
  if (req->address().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "address: empty");
  }
  if (!trust_addresses_) {
    if (absl::Status st = CheckAddressMatchesPeer(req->address(), ctx->peer()); !st.ok()) {
      spdlog::warn("registration refused: {}", st.ToString());
      return ToGrpcStatus(st);
    }
  }
  resp->set_worker_id(c_.RegisterWorker(req->address(), req->backend(),
                                        std::max(1, req->tensor_parallel())));
  resp->set_heartbeat_interval_ms(c_.config().heartbeat_interval_ms);
  return grpc::Status::OK;
}

grpc::Status RegistryService::Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                                        v1::HeartbeatResponse* resp) {
  if (grpc::Status a = CheckCaller(*ctx, access_); !a.ok()) return a;
  resp->set_known(c_.Heartbeat(req->worker_id()));
  return grpc::Status::OK;
}

}  // namespace tandem
