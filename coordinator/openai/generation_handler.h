// POST /v1/completions and /v1/chat/completions: a parsed request becomes one coordinator request
// per prompt (each with n sequences, request_group.h), followed on the HTTP handler's thread, and
// answered whole or streamed as server-sent events, one chunk per generated token.
//
// A streamed request whose client goes away (a write fails) is cancelled at once, which frees its
// KV slots; a non-streamed one runs to its end or its deadline (cpp-httplib 0.11 does not say when
// a client that is not being written to has left).
#pragma once

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "coordinator/coordinator.h"
#include "coordinator/openai/request_parsing.h"

namespace httplib {
struct Request;
struct Response;
}  // namespace httplib

namespace tandem::openai {

// The prompt text of a chat request (its messages through the model's chat template), or an
// error naming the field (400) or saying why the model cannot chat.
using ChatRenderer = std::function<absl::StatusOr<std::string>(const ApiRequest&)>;

class GenerationHandler {
 public:
  // `model_name`: the id /v1/models lists; requests naming another model get 404.
  // `render_chat`: null when the model has no tokenizer (chat requests then get 400).
  GenerationHandler(Coordinator& c, std::string model_name, ChatRenderer render_chat)
      : c_(c), model_name_(std::move(model_name)), render_chat_(std::move(render_chat)) {}

  void Handle(Endpoint endpoint, const httplib::Request& req, httplib::Response& res) const;

 private:
  Coordinator& c_;
  const std::string model_name_;
  const ChatRenderer render_chat_;
};

// Writes `status` (not OK) as OpenAI's error body with its HTTP status (api_error.h).
void SetError(httplib::Response& res, const absl::Status& status);

}  // namespace tandem::openai
