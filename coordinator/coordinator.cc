// Continuous batching over pipelines of stage workers, and what happens when workers come and go.
#include "coordinator/coordinator.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/metrics.h"
#include "common/thread_name.h"
#include "spdlog/spdlog.h"

namespace tandem {
namespace {

constexpr int kMaxMessageBytes = 512 << 20;
// A stage may load gigabytes from disk before it answers AssignStage.
constexpr absl::Duration kAssignTimeout = absl::Seconds(300);

std::shared_ptr<grpc::Channel> MakeWorkerChannel(const std::string& address,
                                                const ClientAuth& auth) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // A dead worker should fail calls fast rather than wait for a reconnect.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return MakeChannel(address, auth, args);
}

TokenLogprob FromProto(const v1::TokenLogprob& in) {
  TokenLogprob out{.token = in.token_id(), .logprob = in.logprob(), .top = {}};
  for (const v1::TopLogprob& t : in.top_logprobs()) out.top.emplace_back(t.token_id(), t.logprob());
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// RequestState

RequestState::Snapshot RequestState::Wait(size_t seen, absl::Time until) {
  absl::MutexLock lock(&mu_);
  auto ready = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return s_.done || s_.tokens.size() > seen;
  };
  mu_.AwaitWithDeadline(absl::Condition(&ready), until);
  return s_;
}

void RequestState::Admitted(absl::Time t) {
  absl::MutexLock lock(&mu_);
  s_.admitted = t;
}

void RequestState::Append(int32_t token, absl::Time t, TokenLogprob* logprob) {
  absl::MutexLock lock(&mu_);
  if (s_.done) return;
  if (s_.tokens.empty()) s_.first_token = t;
  s_.tokens.push_back(token);
  if (logprob != nullptr) s_.logprobs.push_back(std::move(*logprob));
}

void RequestState::AppendPromptLogprobs(std::vector<TokenLogprob> logprobs) {
  absl::MutexLock lock(&mu_);
  if (s_.done) return;
  for (TokenLogprob& l : logprobs) s_.prompt_logprobs.push_back(std::move(l));
}

void RequestState::Finish(absl::Status status, v1::FinishReason finish, int text_limit,
                          absl::Time t) {
  absl::MutexLock lock(&mu_);
  if (s_.done) return;
  s_.done = true;
  s_.status = std::move(status);
  s_.finish = finish;
  s_.text_limit = text_limit;
  s_.finished = t;
}

size_t RequestState::num_tokens() {
  absl::MutexLock lock(&mu_);
  return s_.tokens.size();
}

// ---------------------------------------------------------------------------------------------
// Construction and threads

Coordinator::Coordinator(const CoordinatorConfig& config) : config_(config) {}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(const CoordinatorConfig& config) {
  if (absl::Status s = ValidateCoordinatorConfig(config); !s.ok()) return s;
  std::unique_ptr<Coordinator> c(new Coordinator(config));
  absl::StatusOr<ModelConfig> model = LoadModelConfig(config.model_dir);
  if (!model.ok()) return model.status();
  c->model_ = *model;
  c->limits_.vocab_size = model->vocab_size;
  c->limits_.context_length = config.max_seq_len > 0
                                  ? std::min(config.max_seq_len, model->max_positions)
                                  : model->max_positions;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromDir(config.model_dir);
  if (tok.ok()) {
    c->tokenizer_ = std::move(*tok);
  } else if (tok.status().code() == absl::StatusCode::kNotFound) {
    spdlog::warn("no tokenizer in {} ({}); only token_ids prompts will be accepted",
                 config.model_dir.string(), tok.status().ToString());
  } else {
    // A tokenizer that would split text differently from the model's own is worse than none.
    spdlog::error("the tokenizer in {} cannot be used: {}; only token_ids prompts will be "
                  "accepted",
                  config.model_dir.string(), tok.status().ToString());
  }
  absl::StatusOr<TextConfig> text = LoadTextConfig(config.model_dir, *model, c->tokenizer_.get());
  if (!text.ok()) return text.status();
  c->text_config_ = std::move(*text);
  c->limits_.eos_token_ids = c->text_config_.eos_token_ids;
  c->limits_.eos_token_id =
      c->limits_.eos_token_ids.empty() ? model->eos_token_id : c->limits_.eos_token_ids.front();
  if (config.stages > model->num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "config: stages (%d) exceeds the model's %d layers", config.stages, model->num_layers));
  }
  absl::MutexLock lock(&c->mu_);
  c->wanted_stages_ = c->effective_stages_ = config.stages;
  c->wanted_replicas_ = config.replicas;
  return c;
}

Coordinator::~Coordinator() { Shutdown(); }

void Coordinator::Start() {
  threads_.emplace_back([this] {
    SetThreadName("scheduler");
    SchedulerLoop();
  });
  threads_.emplace_back([this] {
    SetThreadName("health");
    HealthLoop();
  });
  threads_.emplace_back([this] {
    SetThreadName("planner");
    PlannerLoop();
  });
}

void Coordinator::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    wake_scheduler_ = replan_needed_ = true;
    const absl::Status why = absl::UnavailableError("the coordinator is shutting down");
    for (auto& r : waiting_) r->Finish(why, v1::FINISH_REASON_UNSPECIFIED, -1, absl::Now());
    waiting_.clear();
    std::vector<int> ids;
    for (auto& [id, p] : pipelines_) ids.push_back(id);
    for (int id : ids) FailPipeline(id, why);
  }
  for (auto& t : threads_) t.join();
  threads_.clear();
  CloseLinks();
}

void Coordinator::SchedulerLoop() {
  while (true) {
    std::vector<std::pair<std::shared_ptr<PipelineLink>, v1::StepRequest>> out;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&wake_scheduler_), absl::Milliseconds(100));
      if (stopping_) return;
      wake_scheduler_ = false;
      Admit();
      for (auto& [id, p] : pipelines_) FormSteps(*p, out);
      UpdateGauges();
    }
    // Writes happen outside mu_ (a slow stream must not stall the callbacks); this thread is the
    // only writer, so every stage sees the same order.
    for (auto& [link, step] : out) link->Send(step);
  }
}

void Coordinator::HealthLoop() {
  const absl::Duration timeout = absl::Milliseconds(config_.heartbeat_timeout_ms);
  while (true) {
    absl::MutexLock lock(&mu_);
    bool stop = false;
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(50));
    stop = stopping_;
    if (stop) return;
    const absl::Time now = absl::Now();
    std::vector<int64_t> silent;
    for (auto& [id, w] : workers_) {
      if (w.state != v1::WORKER_STATE_DOWN && now - w.last_heartbeat > timeout) silent.push_back(id);
    }
    for (int64_t id : silent) {
      MarkDown(id, absl::StrFormat("no heartbeat for %s", absl::FormatDuration(timeout)));
    }
  }
}

void Coordinator::PlannerLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&replan_needed_), absl::Milliseconds(200));
      if (stopping_) return;
      if (!replan_needed_) continue;
    }
    if (absl::Status s = RunPlan(); !s.ok()) spdlog::warn("re-plan: {}", s.ToString());
  }
}

// ---------------------------------------------------------------------------------------------
// Requests

absl::StatusOr<std::shared_ptr<RequestState>> Coordinator::Submit(ValidatedRequest request) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the coordinator is shutting down");
  if (static_cast<int>(waiting_.size()) >= config_.max_waiting) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "the waiting queue is full (%d requests); retry later", config_.max_waiting));
  }
  if (pipelines_.empty() && !planning_ && !replan_needed_) {
    return absl::UnavailableError("no pipeline is serving: no (or too few) workers are up");
  }
  if (request.prompt_logprobs >= 0) {
    // The CUDA backend's head scores only the rows it samples.
    for (const auto& [id, w] : workers_) {
      if (w.state == v1::WORKER_STATE_SERVING && w.backend == "cuda") {
        return absl::UnimplementedError(
            "sampling.prompt_logprobs: not computed by CUDA workers, which serve this model");
      }
    }
  }
  if (request.request_id.empty()) request.request_id = absl::StrCat("req-", next_seq_id_);
  auto state = std::make_shared<RequestState>(std::move(request), absl::Now());
  waiting_.push_back(state);
  wake_scheduler_ = true;
  return state;
}

void Coordinator::Cancel(const std::shared_ptr<RequestState>& request, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  auto w = std::find(waiting_.begin(), waiting_.end(), request);
  if (w != waiting_.end()) {
    waiting_.erase(w);
    request->Finish(why, v1::FINISH_REASON_UNSPECIFIED, -1, absl::Now());
    return;
  }
  auto it = seq_of_request_.find(request.get());
  if (it != seq_of_request_.end()) {
    EndSequence(it->second, why, v1::FINISH_REASON_UNSPECIFIED, -1);
  } else {
    request->Finish(why, v1::FINISH_REASON_UNSPECIFIED, -1, absl::Now());
  }
}

void Coordinator::Admit() {
  const absl::Time now = absl::Now();
  while (!waiting_.empty()) {
    Pipeline* best = nullptr;
    for (auto& [id, p] : pipelines_) {
      if (p->draining || p->slots.free() == 0) continue;
      if (best == nullptr || p->running.size() < best->running.size()) best = p.get();
    }
    if (best == nullptr) return;
    std::shared_ptr<RequestState> req = std::move(waiting_.front());
    waiting_.pop_front();
    auto seq = std::make_unique<Sequence>();
    seq->id = next_seq_id_++;
    seq->request = req;
    seq->pipeline = best->id;
    seq->slot = *best->slots.Allocate();
    seq->pending = req->request().prompt;
    const SamplingParams& sp = req->request().sampling;
    if (sp.repetition_penalty != 1.0f) {
      for (int32_t t : seq->pending) seq->seen[t].second = true;
    }
    best->running.push_back(seq->id);
    seq_of_request_[req.get()] = seq->id;
    req->Admitted(now);
    if (metrics_ != nullptr) {
      metrics_->queue_time.Observe(absl::ToDoubleSeconds(now - req->arrival()));
      metrics_->prompt_tokens.Increment(static_cast<double>(req->request().prompt.size()));
    }
    seqs_.emplace(seq->id, std::move(seq));
  }
}

void Coordinator::FormSteps(
    Pipeline& p, std::vector<std::pair<std::shared_ptr<PipelineLink>, v1::StepRequest>>& out) {
  const int stages = static_cast<int>(p.workers.size());
  // At least one micro-batch per stage in flight, so that no stage waits for the others.
  const int micro = std::max(config_.micro_batches, stages);
  int free = micro - static_cast<int>(p.inflight.size());
  std::vector<Sequence*> ready;
  for (uint64_t id : p.running) {
    Sequence& s = *seqs_.at(id);
    if (!s.in_flight) ready.push_back(&s);
  }
  size_t i = 0;
  while (free > 0 && i < ready.size()) {
    const int left = static_cast<int>(ready.size() - i);
    const int n = std::min(config_.max_batch, (left + free - 1) / free);
    v1::StepRequest step;
    step.set_assignment_id(p.assignment);
    step.set_step_id(p.next_step++);
    std::vector<StepEntry> entries;
    for (int k = 0; k < n; ++k) {
      Sequence& s = *ready[i++];
      const int nt = std::min<int>(static_cast<int>(s.pending.size()), config_.prefill_chunk);
      const bool sample = nt == static_cast<int>(s.pending.size());
      const SamplingParams& sp = s.request->request().sampling;
      v1::SequenceStep* ss = step.add_seqs();
      ss->set_slot(s.slot);
      ss->set_position(s.position);
      ss->set_num_tokens(nt);
      ss->set_sample(sample);
      ss->set_temperature(sp.temperature);
      ss->set_top_k(sp.top_k);
      ss->set_top_p(sp.top_p);
      ss->set_seed(sp.seed);
      ss->set_sample_index(static_cast<uint64_t>(s.generated));
      ss->set_min_p(sp.min_p);
      ss->set_presence_penalty(sp.presence_penalty);
      ss->set_frequency_penalty(sp.frequency_penalty);
      ss->set_repetition_penalty(sp.repetition_penalty);
      if (sample && sp.has_penalties()) {
        for (const auto& [token, seen] : s.seen) {
          ss->add_seen_token_ids(token);
          ss->add_seen_output_counts(seen.first);
          ss->add_seen_in_prompt(seen.second);
        }
      }
      const ValidatedRequest& rq = s.request->request();
      if (sample && rq.logprobs >= 0) {
        ss->set_logprobs(true);
        ss->set_top_logprobs(rq.logprobs);
      }
      // Prompt logprobs score the prompt as it is fed, chunk by chunk, before the first token.
      if (s.generated == 0 && rq.prompt_logprobs >= 0) {
        ss->set_prompt_logprobs(true);
        ss->set_prompt_top_logprobs(rq.prompt_logprobs);
        ss->set_next_prompt_token(sample ? -1 : s.pending[nt]);
      }
      for (int t = 0; t < nt; ++t) step.add_tokens(s.pending[t]);
      s.in_flight = true;
      entries.push_back({s.id, nt, sample});
    }
    p.inflight.emplace(step.step_id(), std::move(entries));
    if (metrics_ != nullptr) metrics_->batch_size.Observe(n);
    out.emplace_back(p.link, std::move(step));
    --free;
  }
}

void Coordinator::OnStepResult(int pipeline, uint64_t assignment, int stage,
                               const v1::StepResult& r) {
  absl::MutexLock lock(&mu_);
  auto pit = pipelines_.find(pipeline);
  if (pit == pipelines_.end() || pit->second->assignment != assignment) return;
  Pipeline& p = *pit->second;
  if (r.error_code() != 0) {
    FailPipeline(pipeline, absl::Status(static_cast<absl::StatusCode>(r.error_code()),
                                        absl::StrFormat("pipeline %d stage %d step %d: %s",
                                                        pipeline, stage, r.step_id(),
                                                        r.error_message())));
    return;
  }
  auto it = p.inflight.find(r.step_id());
  if (it == p.inflight.end()) {
    FailPipeline(pipeline, absl::InternalError(absl::StrFormat(
                               "pipeline %d: result for unknown step %d", pipeline, r.step_id())));
    return;
  }
  std::vector<StepEntry> entries = std::move(it->second);
  p.inflight.erase(it);
  const int sampled = static_cast<int>(
      std::count_if(entries.begin(), entries.end(), [](const StepEntry& e) { return e.sample; }));
  if (sampled != r.tokens_size()) {
    FailPipeline(pipeline, absl::InternalError(absl::StrFormat(
                               "pipeline %d step %d: %d tokens returned, %d expected", pipeline,
                               r.step_id(), r.tokens_size(), sampled)));
    return;
  }
  // The logprobs of entry i, if its sequence asked for any.
  std::vector<const v1::SequenceLogprobs*> logprobs(entries.size(), nullptr);
  for (const v1::SequenceLogprobs& l : r.logprobs()) {
    if (l.seq() >= 0 && l.seq() < static_cast<int>(entries.size())) logprobs[l.seq()] = &l;
  }
  int k = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const StepEntry& e = entries[i];
    const int32_t token = e.sample ? r.tokens(k++) : -1;
    auto sit = seqs_.find(e.seq);
    if (sit == seqs_.end()) continue;  // cancelled while the step ran
    Sequence& s = *sit->second;
    s.in_flight = false;
    s.position += e.num_tokens;
    s.pending.erase(s.pending.begin(), s.pending.begin() + e.num_tokens);
    if (logprobs[i] != nullptr && logprobs[i]->prompt_size() > 0) {
      std::vector<TokenLogprob> prompt;
      for (const v1::TokenLogprob& p : logprobs[i]->prompt()) prompt.push_back(FromProto(p));
      s.request->AppendPromptLogprobs(std::move(prompt));
    }
    if (!e.sample) continue;
    if (token < 0 || token >= limits_.vocab_size) {
      FailPipeline(pipeline, absl::InternalError(absl::StrFormat(
                                 "pipeline %d: sampled token %d outside the vocabulary", pipeline,
                                 token)));
      return;
    }
    std::optional<TokenLogprob> logprob;
    if (logprobs[i] != nullptr && logprobs[i]->has_sampled()) {
      logprob = FromProto(logprobs[i]->sampled());
    }
    AppendToken(s, token, logprob ? &*logprob : nullptr);
  }
  wake_scheduler_ = true;
}

void Coordinator::AppendToken(Sequence& seq, int32_t token, TokenLogprob* logprob) {
  const ValidatedRequest& r = seq.request->request();
  ++seq.generated;
  if (r.sampling.has_penalties()) ++seq.seen[token].first;
  seq.request->Append(token, absl::Now(), logprob);
  if (metrics_ != nullptr) {
    const absl::Time now = absl::Now();
    metrics_->generated_tokens.Increment();
    if (seq.generated == 1) {
      metrics_->time_to_first_token.Observe(absl::ToDoubleSeconds(now - seq.request->arrival()));
    } else {
      metrics_->inter_token_latency.Observe(absl::ToDoubleSeconds(now - seq.last_token));
    }
    seq.last_token = now;
  }
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  int text_limit = -1;
  if (seq.generated <= r.min_tokens) {
    // min_tokens: neither EOS nor a stop condition ends the sequence yet.
  } else if (IsEos(r, token)) {
    finish = v1::FINISH_REASON_EOS;
  } else if (std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), token) !=
             r.stop_token_ids.end()) {
    finish = v1::FINISH_REASON_STOP;
  } else if (!r.stop_strings.empty() && tokenizer_ != nullptr) {
    // Tokens come back one at a time, so the earliest match is always in the newest text.
    const RequestState::Snapshot snap = seq.request->Wait(0, absl::InfinitePast());
    absl::StatusOr<std::string> text = tokenizer_->Decode(snap.tokens);
    if (text.ok()) {
      size_t best = std::string::npos;
      for (const std::string& stop : r.stop_strings) best = std::min(best, text->find(stop));
      if (best != std::string::npos) {
        finish = v1::FINISH_REASON_STOP;
        text_limit = static_cast<int>(best);
      }
    }
  }
  const int prompt = static_cast<int>(r.prompt.size());
  // The next step would feed this token at position prompt + generated - 1.
  if (finish == v1::FINISH_REASON_UNSPECIFIED &&
      (seq.generated >= r.max_new_tokens || prompt + seq.generated > limits_.context_length)) {
    finish = v1::FINISH_REASON_LENGTH;
  }
  if (finish != v1::FINISH_REASON_UNSPECIFIED) {
    EndSequence(seq.id, absl::OkStatus(), finish, text_limit);
  } else {
    seq.pending.assign(1, token);
  }
}

void Coordinator::EndSequence(uint64_t seq_id, absl::Status status, v1::FinishReason finish,
                              int text_limit) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  Sequence& s = *it->second;
  auto pit = pipelines_.find(s.pipeline);
  if (pit != pipelines_.end()) {
    // Reusing the slot at once is safe even while a step that uses it is in flight: every stage
    // runs steps in issue order, so the old step finishes with the slot before a new prefill
    // (position 0) overwrites it.
    pit->second->slots.Free(s.slot);
    auto& running = pit->second->running;
    running.erase(std::remove(running.begin(), running.end(), seq_id), running.end());
  }
  s.request->Finish(std::move(status), finish, text_limit, absl::Now());
  seq_of_request_.erase(s.request.get());
  seqs_.erase(it);
  wake_scheduler_ = true;
}

// ---------------------------------------------------------------------------------------------
// Failures

void Coordinator::OnLinkBroken(int pipeline, uint64_t assignment, int stage,
                               const absl::Status& s) {
  absl::MutexLock lock(&mu_);
  auto pit = pipelines_.find(pipeline);
  if (pit == pipelines_.end() || pit->second->assignment != assignment) return;
  const int64_t worker = pit->second->workers[stage];
  const std::string address = workers_.count(worker) ? workers_[worker].address : "?";
  const std::string why = absl::StrFormat("worker %d (%s), pipeline %d stage %d: %s", worker,
                                          address, pipeline, stage, s.message());
  // A transport failure means the process is gone or unreachable; anything else (a failed step)
  // leaves the worker usable for the re-plan.
  if (s.code() == absl::StatusCode::kUnavailable) {
    MarkDown(worker, why);
  } else {
    FailPipeline(pipeline, absl::UnavailableError(why));
  }
}

void Coordinator::MarkDown(int64_t worker_id, const std::string& why) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.state == v1::WORKER_STATE_DOWN) return;
  WorkerEntry& w = it->second;
  spdlog::warn("worker {} ({}) is down: {}", w.id, w.address, why);
  const int pipeline = w.pipeline;
  w.state = v1::WORKER_STATE_DOWN;
  if (pipeline >= 0) {
    FailPipeline(pipeline, absl::UnavailableError(absl::StrFormat(
                               "worker %d (%s) of pipeline %d is down: %s", w.id, w.address,
                               pipeline, why)));
  }
  w.pipeline = -1;
  replan_needed_ = true;
}

void Coordinator::FailPipeline(int pipeline, const absl::Status& why) {
  auto pit = pipelines_.find(pipeline);
  if (pit == pipelines_.end()) return;
  Pipeline& p = *pit->second;
  if (!p.running.empty()) {
    spdlog::warn("pipeline {} removed, failing {} requests: {}", pipeline, p.running.size(),
                 why.ToString());
  }
  const std::vector<uint64_t> running = p.running;
  for (uint64_t id : running) EndSequence(id, why, v1::FINISH_REASON_UNSPECIFIED, -1);
  for (int64_t wid : p.workers) {
    auto wit = workers_.find(wid);
    if (wit == workers_.end()) continue;
    if (wit->second.state == v1::WORKER_STATE_SERVING) wit->second.state = v1::WORKER_STATE_IDLE;
    if (wit->second.pipeline == pipeline) {
      wit->second.pipeline = -1;
      wit->second.stage = -1;
    }
  }
  if (p.link) links_to_close_.push_back(std::move(p.link));
  pipelines_.erase(pit);
  replan_needed_ = true;
  wake_scheduler_ = true;
}

void Coordinator::CloseLinks() {
  std::vector<std::shared_ptr<PipelineLink>> links;
  {
    absl::MutexLock lock(&mu_);
    links.swap(links_to_close_);
  }
  for (auto& l : links) l->Close();
}

// ---------------------------------------------------------------------------------------------
// Planning

absl::Status Coordinator::RunPlan() {
  absl::MutexLock plan(&plan_mu_);
  CloseLinks();
  std::vector<int> retiring;
  double drain_s = config_.drain_timeout_s;
  {
    absl::MutexLock lock(&mu_);
    planning_ = true;
    replan_needed_ = false;
    int kept = 0;
    for (auto& [id, p] : pipelines_) {
      bool retire = p->draining || static_cast<int>(p->workers.size()) != effective_stages_;
      for (int64_t w : p->workers) retire |= workers_[w].state == v1::WORKER_STATE_DRAINED;
      if (!retire && kept >= wanted_replicas_) retire = true;
      if (retire) {
        p->draining = true;
        retiring.push_back(id);
      } else {
        ++kept;
      }
    }
    if (!retiring.empty()) {
      spdlog::info("draining {} pipeline(s) for the new topology", retiring.size());
      auto drained = [this, &retiring]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        for (int id : retiring) {
          auto it = pipelines_.find(id);
          if (it != pipelines_.end() && !it->second->running.empty()) return false;
        }
        return true;
      };
      mu_.AwaitWithTimeout(absl::Condition(&drained), absl::Seconds(drain_s));
      for (int id : retiring) {
        FailPipeline(id, absl::UnavailableError(
                             "the pipeline was retired by a topology change before it drained"));
      }
    }
  }
  CloseLinks();

  absl::Status result;
  while (true) {
    std::vector<int64_t> chosen;
    std::vector<LayerRange> ranges;
    int id = 0;
    uint64_t assignment = 0;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
      const int live = static_cast<int>(pipelines_.size());
      if (live >= wanted_replicas_) break;
      std::vector<int64_t> idle;
      for (auto& [wid, w] : workers_) {
        if (w.state == v1::WORKER_STATE_IDLE) idle.push_back(wid);
      }
      int stages = effective_stages_;
      if (static_cast<int>(idle.size()) < stages) {
        // After a loss, serve on what is left rather than not at all.
        if (live == 0 && planned_once_ && !idle.empty()) {
          stages = static_cast<int>(idle.size());
          spdlog::warn("only {} workers left: serving with {} stage(s) instead of {}", stages,
                       stages, effective_stages_);
          effective_stages_ = stages;
        } else {
          break;
        }
      }
      absl::StatusOr<std::vector<LayerRange>> plan = PlanEvenPartition(model_.num_layers, stages);
      if (!plan.ok()) {
        result = plan.status();
        break;
      }
      ranges = *plan;
      chosen.assign(idle.begin(), idle.begin() + stages);
      id = next_pipeline_id_++;
      assignment = next_assignment_++;
      for (int s = 0; s < stages; ++s) {
        WorkerEntry& w = workers_[chosen[s]];
        w.state = v1::WORKER_STATE_SERVING;
        w.pipeline = id;
        w.stage = s;
        w.layers = ranges[s];
      }
    }
    absl::Status s = BuildPipeline(id, assignment, chosen, ranges);
    if (!s.ok()) {
      spdlog::warn("building pipeline {}: {}", id, s.ToString());
      absl::MutexLock lock(&mu_);
      for (int64_t wid : chosen) {
        WorkerEntry& w = workers_[wid];
        if (w.pipeline == id) {
          w.pipeline = -1;
          w.stage = -1;
        }
        if (w.state == v1::WORKER_STATE_SERVING) w.state = v1::WORKER_STATE_IDLE;
      }
      // Worker-side trouble marks that worker down and the loop tries the others; anything else
      // (a bad checkpoint) would fail the same way again.
      if (s.code() != absl::StatusCode::kUnavailable &&
          s.code() != absl::StatusCode::kDeadlineExceeded) {
        result = s;
        break;
      }
    }
  }

  absl::MutexLock lock(&mu_);
  planning_ = false;
  if (!pipelines_.empty()) planned_once_ = true;
  if (pipelines_.empty() && !replan_needed_) {
    // Nothing can serve: waiting requests would otherwise wait for their deadlines.
    const absl::Status why = absl::UnavailableError(
        result.ok() ? "no pipeline is serving: no (or too few) workers are up"
                    : absl::StrCat("no pipeline is serving: ", result.message()));
    for (auto& r : waiting_) r->Finish(why, v1::FINISH_REASON_UNSPECIFIED, -1, absl::Now());
    waiting_.clear();
  }
  wake_scheduler_ = true;
  return result;
}

absl::Status Coordinator::BuildPipeline(int id, uint64_t assignment,
                                        const std::vector<int64_t>& workers,
                                        const std::vector<LayerRange>& ranges) {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::string> addresses;
  {
    absl::MutexLock lock(&mu_);
    for (int64_t w : workers) {
      channels.push_back(workers_[w].channel);
      addresses.push_back(workers_[w].address);
    }
  }
  const int stages = static_cast<int>(workers.size());
  std::vector<v1::AssignStageRequest> requests(stages);
  for (int s = 0; s < stages; ++s) {
    v1::AssignStageRequest& req = requests[s];
    req.set_assignment_id(assignment);
    req.set_pipeline_id(id);
    req.set_stage(s);
    req.set_num_stages(stages);
    req.set_model_dir(config_.model_dir.string());
    req.set_first_layer(ranges[s].first);
    req.set_last_layer(ranges[s].last);
    req.set_max_slots(config_.max_slots);
    req.set_max_seq_len(limits_.context_length);
    req.set_max_step_rows(static_cast<int64_t>(config_.max_batch) * config_.prefill_chunk);
    if (s + 1 < stages) req.set_next_address(addresses[s + 1]);
  }
  std::vector<v1::AssignStageResponse> responses;
  if (std::optional<StageAssignError> err =
          AssignPipelineStages(channels, std::move(requests), kAssignTimeout, &responses)) {
    const int s = err->stage;
    const grpc::Status& st = err->status;
    const std::string why = absl::StrFormat("AssignStage to worker %d (%s): %s", workers[s],
                                            addresses[s], st.error_message());
    const auto code = static_cast<absl::StatusCode>(st.error_code());
    if (code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded) {
      absl::MutexLock lock(&mu_);
      MarkDown(workers[s], why);
    }
    return absl::Status(code, why);
  }
  for (int s = 0; s < stages; ++s) {
    spdlog::info("pipeline {} stage {}: worker {} ({}) loaded layers [{}, {}) in {:.2f} s", id, s,
                 workers[s], addresses[s], ranges[s].first, ranges[s].last,
                 responses[s].load_seconds());
  }
  PipelineLink::Callbacks cb;
  cb.on_result = [this, id, assignment](int stage, const v1::StepResult& r) {
    OnStepResult(id, assignment, stage, r);
  };
  cb.on_broken = [this, id, assignment](int stage, const absl::Status& s) {
    OnLinkBroken(id, assignment, stage, s);
  };
  auto link = std::make_shared<PipelineLink>(channels, std::move(cb),
                                             absl::StrFormat("p%da%d", id, assignment));
  absl::MutexLock lock(&mu_);
  for (int64_t w : workers) {
    if (workers_[w].state != v1::WORKER_STATE_SERVING || workers_[w].pipeline != id) {
      links_to_close_.push_back(std::move(link));
      return absl::UnavailableError(
          absl::StrFormat("worker %d went away while pipeline %d was built", w, id));
    }
  }
  auto p = std::make_unique<Pipeline>(config_.max_slots);
  p->id = id;
  p->assignment = assignment;
  p->workers = workers;
  p->ranges = ranges;
  p->link = std::move(link);
  pipelines_.emplace(id, std::move(p));
  wake_scheduler_ = true;
  spdlog::info("pipeline {} serves with {} stage(s)", id, stages);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Registry and Admin

int64_t Coordinator::RegisterWorker(const std::string& address, const std::string& backend) {
  absl::MutexLock lock(&mu_);
  // A worker that restarted on the same address replaces its old entry.
  std::vector<int64_t> stale;
  for (auto& [id, w] : workers_) {
    if (w.address == address && w.state != v1::WORKER_STATE_DOWN) stale.push_back(id);
  }
  for (int64_t id : stale) MarkDown(id, "it registered again");
  WorkerEntry w;
  w.id = next_worker_id_++;
  w.address = address;
  w.backend = backend;
  w.channel = MakeWorkerChannel(address, worker_auth_);
  w.last_heartbeat = absl::Now();
  spdlog::info("worker {} registered: {} ({})", w.id, address, backend);
  const int64_t id = w.id;
  workers_.emplace(id, std::move(w));
  replan_needed_ = true;
  return id;
}

bool Coordinator::Heartbeat(int64_t worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.state == v1::WORKER_STATE_DOWN) return false;
  it->second.last_heartbeat = absl::Now();
  return true;
}

int Coordinator::LivePipelines() { return static_cast<int>(pipelines_.size()); }

void Coordinator::UpdateGauges() {
  if (metrics_ == nullptr) return;
  int running = 0;
  std::vector<CoordinatorMetrics::KvUse> kv;
  for (auto& [id, p] : pipelines_) {
    running += static_cast<int>(p->running.size());
    // Every stage of a pipeline holds the same slots (the coordinator allocates them).
    for (size_t s = 0; s < p->workers.size(); ++s) {
      kv.push_back({id, static_cast<int>(s), config_.max_slots - p->slots.free(),
                    config_.max_slots});
    }
  }
  metrics_->running_sequences.Set(running);
  metrics_->waiting_sequences.Set(static_cast<double>(waiting_.size()));
  metrics_->SetKvSlots(kv);
  std::map<std::string, bool> up;
  for (auto& [id, w] : workers_) {
    const bool is_up =
        w.state == v1::WORKER_STATE_IDLE || w.state == v1::WORKER_STATE_SERVING;
    up[w.address] = up[w.address] || is_up;  // a restarted worker reuses its address
  }
  metrics_->SetWorkersUp(up);
}

v1::Topology Coordinator::TopologyLocked() {
  v1::Topology t;
  t.set_stages(wanted_stages_);
  t.set_replicas(wanted_replicas_);
  t.set_waiting_requests(static_cast<int>(waiting_.size()));
  for (auto& [id, p] : pipelines_) {
    v1::PipelineInfo* pi = t.add_pipelines();
    pi->set_pipeline_id(id);
    pi->set_running_sequences(static_cast<int>(p->running.size()));
    pi->set_free_slots(p->slots.free());
    for (size_t s = 0; s < p->workers.size(); ++s) {
      v1::StagePlacement* sp = pi->add_stages();
      sp->set_stage(static_cast<int>(s));
      sp->set_worker_id(p->workers[s]);
      sp->set_worker_address(workers_[p->workers[s]].address);
      sp->set_first_layer(p->ranges[s].first);
      sp->set_last_layer(p->ranges[s].last);
    }
  }
  return t;
}

v1::Topology Coordinator::GetTopology() {
  absl::MutexLock lock(&mu_);
  return TopologyLocked();
}

absl::StatusOr<v1::Topology> Coordinator::SetTopology(int stages, int replicas) {
  if (stages < 1 || stages > model_.num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "stages: must be between 1 and the model's %d layers, got %d", model_.num_layers, stages));
  }
  if (replicas < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("replicas: must be >= 1, got %d", replicas));
  }
  {
    absl::MutexLock lock(&mu_);
    int usable = 0;
    for (auto& [id, w] : workers_) {
      usable += w.state == v1::WORKER_STATE_IDLE || w.state == v1::WORKER_STATE_SERVING;
    }
    if (stages * replicas > usable) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%d stages x %d replicas needs %d workers; %d are registered and up", stages, replicas,
          stages * replicas, usable));
    }
    spdlog::info("topology change: {} stage(s) x {} replica(s)", stages, replicas);
    wanted_stages_ = effective_stages_ = stages;
    wanted_replicas_ = replicas;
  }
  absl::Status s = RunPlan();
  absl::MutexLock lock(&mu_);
  if (!s.ok()) return s;
  if (LivePipelines() < wanted_replicas_) {
    return absl::UnavailableError(absl::StrFormat(
        "only %d of %d pipelines could be built (workers failed while loading)", LivePipelines(),
        wanted_replicas_));
  }
  return TopologyLocked();
}

std::vector<v1::WorkerInfo> Coordinator::ListWorkers() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  std::vector<v1::WorkerInfo> out;
  for (auto& [id, w] : workers_) {
    v1::WorkerInfo wi;
    wi.set_worker_id(id);
    wi.set_address(w.address);
    wi.set_backend(w.backend);
    wi.set_state(w.state);
    wi.set_pipeline_id(w.pipeline);
    wi.set_stage(w.pipeline >= 0 ? w.stage : -1);
    wi.set_first_layer(w.pipeline >= 0 ? w.layers.first : 0);
    wi.set_last_layer(w.pipeline >= 0 ? w.layers.last : 0);
    wi.set_seconds_since_heartbeat(absl::ToDoubleSeconds(now - w.last_heartbeat));
    out.push_back(std::move(wi));
  }
  return out;
}

absl::StatusOr<v1::Topology> Coordinator::Drain(int64_t worker_id) {
  {
    absl::MutexLock lock(&mu_);
    auto it = workers_.find(worker_id);
    if (it == workers_.end()) {
      return absl::NotFoundError(absl::StrFormat("worker_id: no worker %d", worker_id));
    }
    if (it->second.state == v1::WORKER_STATE_DOWN) {
      return absl::FailedPreconditionError(
          absl::StrFormat("worker_id: worker %d is already down", worker_id));
    }
    it->second.state = v1::WORKER_STATE_DRAINED;
    replan_needed_ = true;
  }
  if (absl::Status s = RunPlan(); !s.ok()) return s;
  return GetTopology();
}

}  // namespace tandem
