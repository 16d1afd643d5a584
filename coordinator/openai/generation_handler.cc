// From an HTTP body to the coordinator and back: parse, tokenize, validate every prompt, submit
// all or none, then answer whole or as a stream of chunks.
#include "coordinator/openai/generation_handler.h"

#include <pthread.h>

#include <atomic>
#include <optional>
#include <memory>
#include <span>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "common/utf8.h"
#include "coordinator/openai/api_error.h"
#include "coordinator/openai/reasoning_parser.h"
#include "coordinator/openai/response_format.h"
#include "coordinator/request_group.h"
#include "coordinator/request_stream.h"
#include "coordinator/request_validation.h"

namespace tandem::openai {
namespace {

using nlohmann::json;

// A request's choices, submitted: prompt p's sequence j is choice p * n + j.
struct Submitted {
  ApiRequest api;
  ResponseHead head;
  std::vector<std::shared_ptr<RequestState>> choices;
  std::vector<std::string> echo;  // per prompt: its text, with echo
  int prompt_tokens = 0;          // every prompt once
  ToolCallFormat tool_format = ToolCallFormat::kNone;
  // Chat with tools and a tool_choice other than none: replies are read for calls.
  bool reads_calls() const {
    return api.endpoint == Endpoint::kChat && api.tool_choice.kind != ToolChoice::Kind::kNone;
  }
  // Chat with --reasoning_parser: how the text splits into reasoning_content and content.
  ReasoningParser reasoning = ReasoningParser::kNone;
  PromptThought prompt_thought = PromptThought::kMayOpen;
};

// A whole reply split into text and calls, as `s` asks.
ParsedReply ReadCalls(const Submitted& s, std::string text) {
  if (!s.reads_calls()) return {std::move(text), {}};
  if (s.api.tool_choice.kind == ToolChoice::Kind::kAuto) {
    return ParseToolCalls(s.tool_format, text);
  }
  return ParseForcedCalls(s.api.tool_choice, text, s.tool_format);
}

std::string NewId(std::string_view prefix) {
  static std::atomic<uint64_t> counter{0};
  const uint64_t n = counter.fetch_add(1) + 1;
  return absl::StrFormat("%s-%x%06x", prefix, FreshSeed() & 0xffffffffu, n);
}

// Tokenizes every prompt, checks each against the model and submits all of them (or none).
absl::StatusOr<Submitted> Submit(Coordinator& c, ApiRequest api,
                                 const std::vector<std::vector<int32_t>>& ids) {
  Submitted out;
  std::vector<ValidatedRequest> validated;
  for (size_t p = 0; p < ids.size(); ++p) {
    const std::string param = api.endpoint == Endpoint::kChat ? "messages"
                              : ids.size() == 1               ? "prompt"
                                                              : absl::StrCat("prompt[", p, "]");
    absl::StatusOr<ValidatedRequest> v =
        ValidateRequest(PromptRequest(api, ids[p]), c.limits(), c.tokenizer());
    if (!v.ok()) return ToApiError(v.status(), api.endpoint, param);
    v->min_tokens = api.min_tokens;
    out.prompt_tokens += static_cast<int>(ids[p].size());
    validated.push_back(*std::move(v));
  }
  absl::StatusOr<std::vector<std::shared_ptr<RequestState>>> choices =
      SubmitChoices(c, std::move(validated));
  if (absl::IsUnimplemented(choices.status()) && api.echo && api.logprobs.has_value()) {
    return InvalidField("echo", absl::StrCat("with logprobs needs the prompt's logprobs, which "
                                             "this service cannot compute (",
                                             choices.status().message(), ")"));
  }
  // More sequences than the service can hold: the prompts and n make them.
  if (absl::IsInvalidArgument(choices.status())) {
    return InvalidFieldMessage(ids.size() > 1 ? "prompt" : "n", choices.status().message());
  }
  if (!choices.ok()) return choices.status();
  out.choices = *std::move(choices);
  out.api = std::move(api);
  return out;
}

// The prompts of a request as token ids, with the text of each for echo.
// Text is bounded before it is tokenized (CheckPromptText).
absl::StatusOr<std::vector<std::vector<int32_t>>> PromptIds(const ApiRequest& api,
                                                            const Tokenizer* tokenizer,
                                                            const ModelLimits& limits,
                                                            const ChatRenderer& render_chat,
                                                            std::vector<std::string>& texts) {
  std::vector<std::vector<int32_t>> ids;
  if (api.endpoint == Endpoint::kChat) {
    if (!render_chat) {
      return InvalidField("messages", "this model has no tokenizer, so it cannot chat");
    }
    absl::StatusOr<std::string> text = render_chat(api);
    if (!text.ok()) return text.status();
    RETURN_IF_ERROR(ToApiError(CheckPromptText("prompt", *text, limits), api.endpoint, "messages"));
    // The rendered text carries the template's BOS already: no special tokens are added.
    absl::StatusOr<std::vector<int32_t>> encoded =
        tokenizer->Encode(*text, /*add_special_tokens=*/false);
    if (!encoded.ok()) return InvalidField("messages", encoded.status().message());
    ids.push_back(*std::move(encoded));
    if (ids.back().empty()) return InvalidField("messages", "the conversation renders to no tokens");
    texts.push_back(*std::move(text));
    return ids;
  }
  for (size_t p = 0; p < api.prompts.size(); ++p) {
    const PromptInput& prompt = api.prompts[p];
    if (prompt.is_tokens) {
      ids.push_back(prompt.token_ids);
      std::string text;
      if (api.echo && tokenizer != nullptr) {
        absl::StatusOr<std::string> decoded = tokenizer->Decode(prompt.token_ids);
        if (decoded.ok()) text = ToValidUtf8(*decoded);
      }
      texts.push_back(std::move(text));
      continue;
    }
    const std::string param = api.prompts.size() == 1 ? "prompt" : absl::StrCat("prompt[", p, "]");
    if (tokenizer == nullptr) {
      return InvalidField(param, "this model has no tokenizer; give token ids");
    }
    RETURN_IF_ERROR(
        ToApiError(CheckPromptText("prompt", prompt.text, limits), api.endpoint, param));
    absl::StatusOr<std::vector<int32_t>> encoded = tokenizer->Encode(prompt.text);
    if (!encoded.ok()) return InvalidField(param, encoded.status().message());
    ids.push_back(*std::move(encoded));
    texts.push_back(prompt.text);
  }
  return ids;
}

// vLLM's stop_reason of a choice that ended.
json StopReasonOf(const Tokenizer* tokenizer, const RequestState& choice,
                  const RequestState::Snapshot& snap) {
  std::string text;
  if (snap.finish == v1::FINISH_REASON_STOP && snap.text_limit >= 0 && tokenizer != nullptr) {
    absl::StatusOr<std::string> decoded = tokenizer->Decode(snap.tokens);
    if (decoded.ok()) text = *std::move(decoded);
  }
  return StopReasonJson(snap.finish, snap.tokens, snap.text_limit, text,
                        choice.request().stop_strings);
}

json LogprobsOf(const Submitted& s, const Tokenizer* tokenizer,
                std::span<const TokenLogprob> logprobs, size_t offset) {
  if (!s.api.logprobs.has_value()) return nullptr;
  const std::vector<TokenLogprob> lp(logprobs.begin(), logprobs.end());
  return s.api.endpoint == Endpoint::kChat
             ? ChatLogprobs(tokenizer, lp, s.api.tokens_as_ids)
             : CompletionLogprobs(tokenizer, lp, offset, s.api.tokens_as_ids);
}

// vLLM's return_token_ids: a choice (a stream's chunk) carries the ids of its generated tokens
// (of that chunk) in `token_ids`, and its prompt's in `prompt_token_ids` (a stream: its first
// chunk only).
void AddTokenIds(const Submitted& s, size_t choice, std::span<const int32_t> generated,
                 bool with_prompt, json& out) {
  if (!s.api.return_token_ids) return;
  json& c = out["choices"][0];
  c["token_ids"] = std::vector<int32_t>(generated.begin(), generated.end());
  if (with_prompt) c["prompt_token_ids"] = s.choices[choice]->request().prompt;
}

void Answer(Coordinator& c, Submitted& s, HttpExchange& exchange, HttpResponse& res) {
  absl::StatusOr<std::vector<RequestState::Snapshot>> snaps = FollowChoices(
      c, s.choices, absl::InfiniteFuture(), [&exchange] { return exchange.ClientGone(); },
      [](int, const RequestState::Snapshot&) { return true; });
  for (const auto& r : s.choices) RecordEnd(c, *r, snaps.status());
  if (!snaps.ok()) {
    SetError(res, snaps.status());
    return;
  }
  const Tokenizer* tokenizer = c.tokenizer();
  std::vector<ChoiceResult> results;
  std::vector<json> logprobs;
  std::vector<std::string> reasoning;  // per choice, with a reasoning parser
  int completion_tokens = 0;
  for (size_t i = 0; i < snaps->size(); ++i) {
    const RequestState::Snapshot& snap = (*snaps)[i];
    TextStream text(tokenizer, s.choices[i]->request().stop_strings);
    const std::string prefix = s.api.echo ? s.echo[i / s.api.n] : "";
    ChoiceResult r;
    r.index = static_cast<int>(i);
    r.text =
        prefix + text.Next(TextTokens(snap.tokens, true, snap.finish), true, snap.text_limit);
    if (s.reasoning != ReasoningParser::kNone) {
      ReasoningSplit split = SplitReasoning(s.reasoning, s.prompt_thought, r.text);
      r.text = std::move(split.content);
      reasoning.push_back(std::move(split.reasoning));
    }
    // Calls are read from the content, after the thought (as vLLM does).
    ParsedReply reply = ReadCalls(s, std::move(r.text));
    r.text = std::move(reply.content);
    r.tool_calls = std::move(reply.calls);
    r.finish = snap.finish;
    r.stop_reason = StopReasonOf(tokenizer, *s.choices[i], snap);
    json lp = LogprobsOf(s, tokenizer, snap.logprobs, prefix.size());
    if (s.api.echo && s.api.logprobs.has_value()) {
      // The prompt's logprobs come with its group's first sequence (request_group.h).
      const RequestState::Snapshot& first = (*snaps)[i / s.api.n * s.api.n];
      lp = EchoedLogprobs(tokenizer, s.choices[i]->request().prompt, first.prompt_logprobs, lp,
                          s.api.tokens_as_ids);
    }
    logprobs.push_back(std::move(lp));
    completion_tokens += static_cast<int>(snap.tokens.size());
    results.push_back(std::move(r));
  }
  const UsageCounts usage{s.prompt_tokens, completion_tokens};
  json body = s.api.endpoint == Endpoint::kChat
                  ? ChatResponse(s.head, results, logprobs, usage)
                  : CompletionResponse(s.head, results, logprobs, usage);
  for (size_t i = 0; i < reasoning.size(); ++i) {
    json& message = body["choices"][i]["message"];
    message["reasoning_content"] = reasoning[i].empty() ? json() : json(reasoning[i]);
  }
  if (s.api.return_token_ids) {
    for (size_t i = 0; i < snaps->size(); ++i) {
      json& c = body["choices"][i];
      c["token_ids"] = (*snaps)[i].tokens;
      c["prompt_token_ids"] = s.choices[i]->request().prompt;
    }
  }
  res.status = 200;
  res.body = JsonText(body);
}

// One streamed request: its chunks, written in order from FollowChoices' serialized callbacks.
class Stream {
 public:
  Stream(Coordinator& c, Submitted s) : c_(c), s_(std::move(s)) {
    for (const auto& r : s_.choices) {
      texts_.emplace_back(c_.tokenizer(), r->request().stop_strings);
      calls_.emplace_back();
      if (s_.reads_calls()) calls_.back().emplace(s_.tool_format, s_.api.tool_choice);
      reasoning_.emplace_back(s_.reasoning, s_.prompt_thought);
    }
    sent_.assign(s_.choices.size(), 0);
    offsets_.assign(s_.choices.size(), 0);
  }

  // Runs the whole stream; false when the client went away.
  bool Run(HttpExchange& sink) {
    sink_ = &sink;
    const bool chat = s_.api.endpoint == Endpoint::kChat;
    for (size_t i = 0; i < s_.choices.size(); ++i) {
      const int index = static_cast<int>(i);
      if (chat) {
        if (!Write(ChatChunk(s_.head, index, {{"role", "assistant"}, {"content", ""}}, nullptr,
                             v1::FINISH_REASON_UNSPECIFIED, s_.api.include_usage))) {
          return Abandon();
        }
      } else if (s_.api.echo) {
        const std::string& prompt = s_.echo[i / s_.api.n];
        offsets_[i] = prompt.size();
        json logprobs = nullptr;
        if (s_.api.logprobs.has_value()) {
          // The prompt's logprobs come with its group's first sequence (request_group.h).
          std::optional<std::vector<TokenLogprob>> prompt_logprobs =
              PromptLogprobs(i / s_.api.n * s_.api.n);
          if (!prompt_logprobs.has_value()) return Abandon();
          logprobs = EchoedLogprobs(c_.tokenizer(), s_.choices[i]->request().prompt,
                                    *prompt_logprobs, json::object(), s_.api.tokens_as_ids);
        }
        if (!Write(CompletionChunk(s_.head, index, prompt, logprobs, v1::FINISH_REASON_UNSPECIFIED,
                                   s_.api.include_usage))) {
          return Abandon();
        }
      }
    }
    absl::StatusOr<std::vector<RequestState::Snapshot>> snaps = FollowChoices(
        c_, s_.choices, absl::InfiniteFuture(), [this] { return gone_ || sink_->ClientGone(); },
        [this](int i, const RequestState::Snapshot& snap) { return Progress(i, snap); });
    for (const auto& r : s_.choices) RecordEnd(c_, *r, snaps.status());
    if (!snaps.ok()) {
      if (gone_ || snaps.status().code() == absl::StatusCode::kCancelled) return false;
      // Headers are sent: the error goes in the stream, as vLLM does.
      if (!Write(ErrorBody(snaps.status()))) return false;
    } else if (s_.api.include_usage) {
      int completion_tokens = 0;
      for (const auto& snap : *snaps) completion_tokens += static_cast<int>(snap.tokens.size());
      if (!Write(UsageChunk(s_.head, chat ? "chat.completion.chunk" : "text_completion",
                            {s_.prompt_tokens, completion_tokens}))) {
        return false;
      }
    }
    if (!sink.Write(kSseDone)) return false;
    sink.End();
    return true;
  }

  // Called when the stream ends, however it ended: a request still running is cancelled.
  void Release() {
    for (const auto& r : s_.choices) c_.Cancel(r, absl::CancelledError("the client went away"));
  }

 private:
  bool Abandon() {
    Release();
    return false;
  }

  // Choice `k`'s prompt logprobs, once it has them all (its first token, or its end); nullopt
  // when the client goes away first.
  std::optional<std::vector<TokenLogprob>> PromptLogprobs(size_t k) {
    RequestState::Snapshot snap;
    while (!snap.done && snap.tokens.empty()) {
      if (sink_->ClientGone()) return std::nullopt;
      s_.choices[k]->WaitMore(snap, absl::Now() + absl::Milliseconds(50));
    }
    return std::move(snap.prompt_logprobs);
  }

  bool Write(const json& event) {
    if (gone_) return false;
    const std::string text = SseEvent(event);
    if (!sink_->Write(text)) gone_ = true;
    return !gone_;
  }

  // One chunk per new token; the last token's chunk carries the finish reason (chat: a chunk of
  // its own with an empty delta, as OpenAI sends it).
  bool Progress(int i, const RequestState::Snapshot& snap) {
    if (snap.done && !snap.status.ok()) return true;  // written after FollowChoices returns
    const bool chat = s_.api.endpoint == Endpoint::kChat;
    const Tokenizer* tokenizer = c_.tokenizer();
    const size_t count = snap.tokens.size();
    for (size_t k = sent_[i] + 1; k <= count; ++k) {
      const bool last = snap.done && k == count;
      const std::span<const int32_t> tokens(snap.tokens.data(), k);
      const std::string piece =
          texts_[i].Next(TextTokens(tokens, last, snap.finish), last, snap.text_limit);
      json logprobs = nullptr;
      if (s_.api.logprobs.has_value() && k <= snap.logprobs.size()) {
        logprobs =
            LogprobsOf(s_, tokenizer, std::span(snap.logprobs).subspan(k - 1, 1), offsets_[i]);
      }
      offsets_[i] += piece.size();
      const v1::FinishReason finish = last ? snap.finish : v1::FINISH_REASON_UNSPECIFIED;
      // Chat: the thought first (reasoning_content), then calls read from the rest.
      const ReasoningSplit split = chat ? reasoning_[i].Next(piece, last)
                                        : ReasoningSplit{.reasoning = {}, .content = piece};
      json chunk =
          chat ? ChatChunk(s_.head, i, ReasoningDelta(split), logprobs,
                           v1::FINISH_REASON_UNSPECIFIED, s_.api.include_usage)
               : CompletionChunk(s_.head, i, piece, logprobs, finish, s_.api.include_usage,
                                 last ? StopReasonOf(tokenizer, *s_.choices[i], snap) : json());
      AddTokenIds(s_, i, std::span(snap.tokens).subspan(k - 1, 1), k == 1, chunk);
      if (calls_[i].has_value()) {
        if (!split.reasoning.empty()) {
          if (!Write(ChatChunk(s_.head, i, {{"reasoning_content", split.reasoning}}, logprobs,
                               v1::FINISH_REASON_UNSPECIFIED, s_.api.include_usage))) {
            return false;
          }
          logprobs = nullptr;
        }
        if (!WriteCalls(i, calls_[i]->Next(split.content), logprobs)) return false;
        continue;
      }
      if (!Write(chunk)) return false;
    }
    sent_[i] = count;
    if (snap.done && (chat || count == 0)) {
      const json stop_reason = StopReasonOf(tokenizer, *s_.choices[i], snap);
      bool called = false;
      if (calls_[i].has_value()) {
        if (!WriteCalls(i, calls_[i]->Finish(), nullptr)) return false;
        called = calls_[i]->called();
      }
      json last = chat ? ChatChunk(s_.head, i, json::object(), nullptr, snap.finish,
                                   s_.api.include_usage, stop_reason)
                       : CompletionChunk(s_.head, i, "", nullptr, snap.finish,
                                         s_.api.include_usage, stop_reason);
      last["choices"][0]["finish_reason"] = FinishReasonJson(snap.finish, called);
      if (!Write(last)) return false;
    }
    return true;
  }

  // A reply read for calls: its text (never a call marker's) and its calls, each a chunk.
  bool WriteCalls(int i, const ToolCallStream::Delta& delta, const json& logprobs) {
    if (!delta.content.empty() &&
        !Write(ChatChunk(s_.head, i, {{"content", delta.content}}, logprobs,
                         v1::FINISH_REASON_UNSPECIFIED, s_.api.include_usage))) {
      return false;
    }
    for (const json& call : delta.tool_calls) {
      if (!Write(ChatChunk(s_.head, i, {{"tool_calls", json::array({call})}}, nullptr,
                           v1::FINISH_REASON_UNSPECIFIED, s_.api.include_usage))) {
        return false;
      }
    }
    return true;
  }

  Coordinator& c_;
  Submitted s_;
  std::vector<TextStream> texts_;
  std::vector<std::optional<ToolCallStream>> calls_;  // per choice, when replies are read for calls
  std::vector<ReasoningSplitter> reasoning_;  // per choice; kNone: all content
  std::vector<size_t> sent_;     // tokens streamed, per choice
  std::vector<size_t> offsets_;  // bytes of text streamed, per choice (completions' text_offset)
  HttpExchange* sink_ = nullptr;
  bool gone_ = false;
};

}  // namespace

void SetError(HttpResponse& res, const absl::Status& status) {
  res.status = HttpStatusOf(status);
  res.content_type = "application/json";
  res.body = JsonText(ErrorBody(status));
}

void GenerationHandler::WaitForFollowers() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int* n) { return *n == 0; }, &followers_));
}

void GenerationHandler::Handle(Endpoint endpoint, const HttpRequest& req,
                               std::shared_ptr<HttpExchange> exchange) {
  HttpResponse res;
  absl::StatusOr<ApiRequest> api =
      endpoint == Endpoint::kChat ? ParseChatRequest(req.body) : ParseCompletionRequest(req.body);
  if (!api.ok()) {
    RecordRejected(c_, api.status());
    SetError(res, api.status());
    return exchange->Respond(std::move(res));
  }
  Serve(*std::move(api), std::move(exchange));
}

void GenerationHandler::Serve(ApiRequest api, std::shared_ptr<HttpExchange> exchange) {
  HttpResponse res;
  const Endpoint endpoint = api.endpoint;
  if (!api.model.empty() && api.model != model_name_) {
    const absl::Status s = absl::NotFoundError(absl::StrFormat(
        "model: '%s' is not served here; this server serves '%s'", api.model, model_name_));
    RecordRejected(c_, s);
    SetError(res, s);
    return exchange->Respond(std::move(res));
  }
  if (api.tool_choice.kind == ToolChoice::Kind::kAuto && tool_format_ == ToolCallFormat::kNone) {
    const absl::Status s = InvalidField(
        "tools", "this model's chat template has no tool-call format, so its replies could not "
                 "be read for calls; start the coordinator with --tool_call_parser (llama3_json, "
                 "hermes or mistral), or force a call with tool_choice");
    RecordRejected(c_, s);
    SetError(res, s);
    return exchange->Respond(std::move(res));
  }
  std::vector<std::string> texts;
  absl::StatusOr<std::vector<std::vector<int32_t>>> ids =
      PromptIds(api, c_.tokenizer(), c_.limits(), render_chat_, texts);
  if (!ids.ok()) {
    RecordRejected(c_, ids.status());
    SetError(res, ids.status());
    return exchange->Respond(std::move(res));
  }
  absl::StatusOr<Submitted> s = Submit(c_, std::move(api), *ids);
  if (!s.ok()) {
    RecordRejected(c_, s.status());
    SetError(res, s.status());
    return exchange->Respond(std::move(res));
  }
  if (endpoint == Endpoint::kChat) {
    // Checked when the server started (StartHttpApi).
    s->reasoning = ParseReasoningParserName(c_.config().reasoning_parser)
                       .value_or(ReasoningParser::kNone);
    s->prompt_thought = PromptThoughtOf(texts.front());
  }
  s->echo = std::move(texts);
  s->tool_format = tool_format_;
  s->head = {.id = NewId(endpoint == Endpoint::kChat ? "chatcmpl" : "cmpl"),
             .created = absl::ToUnixSeconds(absl::Now()),
             .model = model_name_};

  // Followed on a thread of its own: the number of these is bounded by what the coordinator
  // admits (running slots and the waiting queue); the event threads never wait on generation.
  {
    absl::MutexLock lock(&mu_);
    ++followers_;
  }
  auto submitted = std::make_shared<Submitted>(*std::move(s));
  std::thread([this, submitted, exchange] {
    pthread_setname_np(pthread_self(), "http-follow");
    if (!submitted->api.stream) {
      HttpResponse res;
      Answer(c_, *submitted, *exchange, res);
      exchange->Respond(std::move(res));
    } else {
      Stream stream(c_, std::move(*submitted));
      HttpResponse head;
      head.content_type = "text/event-stream";
      head.headers = {{"Cache-Control", "no-cache"}};
      exchange->StartStream(std::move(head));
      stream.Run(*exchange);
      // However it ended: a request still running is cancelled.
      stream.Release();
      exchange->End();
    }
    absl::MutexLock lock(&mu_);
    --followers_;
  }).detach();
}

}  // namespace tandem::openai
