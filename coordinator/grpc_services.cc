// gRPC handlers. A generation handler submits the request, then waits on it, streaming tokens as
// they come and watching the client's cancellation and the deadline.
#include "coordinator/grpc_services.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "common/metrics.h"
#include "spdlog/spdlog.h"

namespace tandem {
namespace {

// How often a waiting handler looks at its client's cancellation.
constexpr absl::Duration kPoll = absl::Milliseconds(20);

// Bytes of `text` that end on a whole UTF-8 character (a token may end inside one).
size_t CompleteUtf8Prefix(const std::string& text) {
  size_t n = text.size();
  size_t i = n;
  int back = 0;
  while (i > 0 && back < 4) {
    const unsigned char c = static_cast<unsigned char>(text[i - 1]);
    if ((c & 0xC0) != 0x80) {
      int len = (c & 0x80) == 0 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 :
                (c & 0xF8) == 0xF0 ? 4 : 1;
      return (n - (i - 1) >= static_cast<size_t>(len)) ? n : i - 1;
    }
    --i;
    ++back;
  }
  return n;
}

// `text` with every byte that is not part of a well-formed UTF-8 character replaced by U+FFFD
// (random or partial token sequences decode to arbitrary bytes; proto strings must be UTF-8).
std::string SanitizeUtf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    int len = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      len = 1;
      cp = c;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    }
    bool ok = len > 0 && i + len <= text.size();
    for (int k = 1; ok && k < len; ++k) {
      const unsigned char cc = static_cast<unsigned char>(text[i + k]);
      ok = (cc & 0xC0) == 0x80;
      cp = (cp << 6) | (cc & 0x3F);
    }
    // Overlong forms, surrogates and values past U+10FFFF are not UTF-8 either.
    static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    ok = ok && cp >= kMin[len] && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
    if (ok) {
      out.append(text.substr(i, len));
      i += len;
    } else {
      out.append("\xEF\xBF\xBD");
      ++i;
    }
  }
  return out;
}

// Bytes of `text` that can be shown while generation goes on: whole characters, minus a tail that
// could be the start of a stop string.
size_t ShowablePrefix(const std::string& text, const std::vector<std::string>& stops) {
  size_t n = CompleteUtf8Prefix(text);
  for (const std::string& stop : stops) {
    for (size_t k = std::min(stop.size() - 1, n); k > 0; --k) {
      if (text.compare(n - k, k, stop, 0, k) == 0) {
        n -= k;
        break;
      }
    }
  }
  return n;
}

double Seconds(absl::Time from, absl::Time to) {
  if (to == absl::InfinitePast() || from == absl::InfinitePast()) return 0;
  return absl::ToDoubleSeconds(to - from);
}

void FillSummary(const RequestState& r, const RequestState::Snapshot& s, v1::Usage* usage,
                 v1::Timings* timings) {
  usage->set_prompt_tokens(static_cast<int>(r.request().prompt.size()));
  usage->set_completion_tokens(static_cast<int>(s.tokens.size()));
  timings->set_queue_seconds(Seconds(r.arrival(), s.admitted));
  timings->set_time_to_first_token_seconds(Seconds(r.arrival(), s.first_token));
  timings->set_total_seconds(Seconds(r.arrival(), s.finished));
}

// Waits on a submitted request; calls `on_progress(snapshot)` whenever tokens arrive. Returns the
// final snapshot, or an error when the client went away or the deadline passed (the request is
// then cancelled, which frees its slot).
template <typename F>
absl::StatusOr<RequestState::Snapshot> Follow(Coordinator& c, grpc::ServerContext* ctx,
                                              const std::shared_ptr<RequestState>& r,
                                              F on_progress) {
  absl::Time deadline = absl::FromChrono(ctx->deadline());
  if (r->request().timeout != absl::InfiniteDuration()) {
    deadline = std::min(deadline, r->arrival() + r->request().timeout);
  }
  size_t seen = 0;
  while (true) {
    RequestState::Snapshot s = r->Wait(seen, std::min(deadline, absl::Now() + kPoll));
    if (s.tokens.size() > seen || s.done) {
      seen = s.tokens.size();
      if (!on_progress(s)) {
        c.Cancel(r, absl::CancelledError("the client stopped reading"));
        return absl::CancelledError("the client stopped reading");
      }
    }
    if (s.done) {
      if (!s.status.ok()) return s.status;
      return s;
    }
    if (ctx->IsCancelled()) {
      c.Cancel(r, absl::CancelledError("cancelled by the client"));
      return absl::CancelledError("cancelled by the client");
    }
    if (absl::Now() >= deadline) {
      const absl::Status why = absl::DeadlineExceededError(absl::StrFormat(
          "request %s: deadline exceeded after %d generated tokens", r->request().request_id,
          s.tokens.size()));
      c.Cancel(r, why);
      return why;
    }
  }
}

// Records a request that ended after it was submitted: its outcome and its duration.
void RecordEnd(Coordinator& c, const RequestState& r, const absl::Status& outcome) {
  if (c.metrics() == nullptr) return;
  c.metrics()->CountRequest(outcome);
  c.metrics()->request_duration.Observe(absl::ToDoubleSeconds(absl::Now() - r.arrival()));
}

// Counts a request refused before it was submitted (invalid, or the queue is full).
grpc::Status Rejected(Coordinator& c, const absl::Status& why) {
  if (c.metrics() != nullptr) c.metrics()->CountRequest(why);
  return ToGrpcStatus(why);
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

grpc::Status InferenceService::Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                                        v1::GenerateResponse* resp) {
  absl::StatusOr<ValidatedRequest> v = ValidateRequest(*req, c_.limits(), c_.tokenizer());
  if (!v.ok()) return Rejected(c_, v.status());
  absl::StatusOr<std::shared_ptr<RequestState>> r = c_.Submit(*std::move(v));
  if (!r.ok()) return Rejected(c_, r.status());
  absl::StatusOr<RequestState::Snapshot> s =
      Follow(c_, ctx, *r, [](const RequestState::Snapshot&) { return true; });
  RecordEnd(c_, **r, s.status());
  if (!s.ok()) return ToGrpcStatus(s.status());
  resp->set_request_id((*r)->request().request_id);
  resp->mutable_token_ids()->Assign(s->tokens.begin(), s->tokens.end());
  if (c_.tokenizer() != nullptr) {
    absl::StatusOr<std::string> text = c_.tokenizer()->Decode(s->tokens);
    if (text.ok()) {
      if (s->text_limit >= 0) text->resize(std::min<size_t>(text->size(), s->text_limit));
      resp->set_text(SanitizeUtf8(*text));
    }
  }
  resp->set_finish_reason(s->finish);
  FillSummary(**r, *s, resp->mutable_usage(), resp->mutable_timings());
  return grpc::Status::OK;
}

grpc::Status InferenceService::GenerateStream(
    grpc::ServerContext* ctx, const v1::GenerateRequest* req,
    grpc::ServerWriter<v1::GenerateStreamResponse>* writer) {
  absl::StatusOr<ValidatedRequest> v = ValidateRequest(*req, c_.limits(), c_.tokenizer());
  if (!v.ok()) return Rejected(c_, v.status());
  absl::StatusOr<std::shared_ptr<RequestState>> r = c_.Submit(*std::move(v));
  if (!r.ok()) return Rejected(c_, r.status());
  const RequestState& rs = **r;
  const Tokenizer* tok = c_.tokenizer();
  size_t sent_tokens = 0;
  size_t sent_text = 0;
  auto on_progress = [&](const RequestState::Snapshot& s) {
    v1::GenerateStreamResponse msg;
    msg.set_request_id(rs.request().request_id);
    for (size_t i = sent_tokens; i < s.tokens.size(); ++i) msg.add_token_ids(s.tokens[i]);
    sent_tokens = s.tokens.size();
    if (tok != nullptr) {
      absl::StatusOr<std::string> text = tok->Decode(s.tokens);
      if (text.ok()) {
        size_t show = s.done ? text->size() : ShowablePrefix(*text, rs.request().stop_strings);
        if (s.done && s.text_limit >= 0) show = std::min<size_t>(show, s.text_limit);
        if (show > sent_text) {
          msg.set_text(SanitizeUtf8(std::string_view(*text).substr(sent_text, show - sent_text)));
          sent_text = show;
        }
      }
    }
    if (s.done && s.status.ok()) {
      msg.set_finish_reason(s.finish);
      FillSummary(rs, s, msg.mutable_usage(), msg.mutable_timings());
    } else if (s.done) {
      return true;  // the error goes in the call's status
    }
    return writer->Write(msg);
  };
  absl::StatusOr<RequestState::Snapshot> s = Follow(c_, ctx, *r, on_progress);
  RecordEnd(c_, rs, s.status());
  return ToGrpcStatus(s.status());
}

grpc::Status InferenceService::GetModelInfo(grpc::ServerContext*, const v1::GetModelInfoRequest*,
                                            v1::ModelInfo* resp) {
  const ModelConfig& m = c_.model();
  resp->set_model_dir(c_.config().model_dir.string());
  resp->set_architecture(std::string(ArchName(m.arch)));
  resp->set_vocab_size(m.vocab_size);
  resp->set_hidden_size(m.hidden_size);
  resp->set_num_layers(m.num_layers);
  resp->set_context_length(c_.limits().context_length);
  resp->set_eos_token_id(m.eos_token_id);
  resp->set_has_tokenizer(c_.tokenizer() != nullptr);
  return grpc::Status::OK;
}

grpc::Status AdminService::GetTopology(grpc::ServerContext*, const v1::GetTopologyRequest*,
                                       v1::Topology* resp) {
  *resp = c_.GetTopology();
  return grpc::Status::OK;
}

grpc::Status AdminService::SetTopology(grpc::ServerContext*, const v1::SetTopologyRequest* req,
                                       v1::Topology* resp) {
  absl::StatusOr<v1::Topology> t = c_.SetTopology(req->stages(), req->replicas());
  if (!t.ok()) return ToGrpcStatus(t.status());
  *resp = *std::move(t);
  return grpc::Status::OK;
}

grpc::Status AdminService::ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                                       v1::ListWorkersResponse* resp) {
  for (v1::WorkerInfo& w : c_.ListWorkers()) *resp->add_workers() = std::move(w);
  return grpc::Status::OK;
}

grpc::Status AdminService::Drain(grpc::ServerContext*, const v1::DrainRequest* req,
                                 v1::Topology* resp) {
  absl::StatusOr<v1::Topology> t = c_.Drain(req->worker_id());
  if (!t.ok()) return ToGrpcStatus(t.status());
  *resp = *std::move(t);
  return grpc::Status::OK;
}

grpc::Status RegistryService::Register(grpc::ServerContext*, const v1::RegisterRequest* req,
                                       v1::RegisterResponse* resp) {
  if (req->address().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "address: empty");
  }
  resp->set_worker_id(c_.RegisterWorker(req->address(), req->backend()));
  resp->set_heartbeat_interval_ms(c_.config().heartbeat_interval_ms);
  return grpc::Status::OK;
}

grpc::Status RegistryService::Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                                        v1::HeartbeatResponse* resp) {
  resp->set_known(c_.Heartbeat(req->worker_id()));
  return grpc::Status::OK;
}

}  // namespace tandem
