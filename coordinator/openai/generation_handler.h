// POST /v1/completions and /v1/chat/completions: a parsed request becomes one coordinator request
// per prompt (each with n sequences, request_group.h), followed on a thread of its own (never on an
// HTTP event thread), and answered whole or streamed as server-sent events, one chunk per
// generated token.
//
// A request whose client goes away (its connection closes, streamed or not) is cancelled within
// milliseconds, which frees its KV slots.
#pragma once

#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/coordinator.h"
#include "coordinator/openai/http_daemon.h"
#include "coordinator/openai/request_parsing.h"
#include "coordinator/openai/tool_calls.h"

namespace tandem::openai {

// The prompt text of a chat request (its messages through the model's chat template), or an
// error naming the field (400) or saying why the model cannot chat.
using ChatRenderer = std::function<absl::StatusOr<std::string>(const ApiRequest&)>;

class GenerationHandler {
 public:
  // `model_name`: the id /v1/models lists; requests naming another model get 404.
  // `render_chat`: null when the model has no tokenizer (chat requests then get 400).
  // `tool_format`: how the model writes tool calls (kNone: chat requests with tools are refused).
  GenerationHandler(Coordinator& c, std::string model_name, ChatRenderer render_chat,
                    ToolCallFormat tool_format = ToolCallFormat::kNone)
      : c_(c),
        model_name_(std::move(model_name)),
        render_chat_(std::move(render_chat)),
        tool_format_(tool_format) {}
  ~GenerationHandler() { WaitForFollowers(); }

  // On an event thread: parses, tokenizes, validates and submits, answering a refusal at once;
  // a submitted request is followed on a thread of its own, which answers through `exchange`.
  void Handle(Endpoint endpoint, const HttpRequest& req, std::shared_ptr<HttpExchange> exchange);
  // The same for a request parsed already (the Responses API's, made a chat request).
  void Serve(ApiRequest api, std::shared_ptr<HttpExchange> exchange);
  // Until every follower thread has ended (their clients gone: HttpDaemon::AbandonAll).
  void WaitForFollowers();

 private:
  Coordinator& c_;
  const std::string model_name_;
  const ChatRenderer render_chat_;
  const ToolCallFormat tool_format_;
  absl::Mutex mu_;
  int followers_ ABSL_GUARDED_BY(mu_) = 0;
};

// Writes `status` (not OK) as OpenAI's error body with its HTTP status (api_error.h).
void SetError(HttpResponse& res, const absl::Status& status);

}  // namespace tandem::openai
