// POST /v1/responses, OpenAI's Responses API, in the subset that the openai SDK's
// responses.create and LangChain's ChatOpenAI({useResponsesApi: true}) use: a request is made a
// chat request (input items become messages, function tools chat tools) and served by the chat
// path; its answer (whole or streamed) is turned into a response object or the Responses API's
// events (response.created ... response.completed, each with its sequence_number).
//
// Nothing is stored: previous_response_id, background and conversation are refused, as are tools
// other than functions and response fields tandem does not produce (reasoning, include).
#pragma once

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "coordinator/openai/generation_handler.h"
#include "coordinator/openai/http_daemon.h"
#include "coordinator/openai/request_parsing.h"
#include "nlohmann/json.hpp"

namespace tandem::openai {

// A Responses API request as the chat request that serves it, and what its answer echoes.
struct ResponsesRequest {
  ApiRequest chat;
  // The request's fields a response object repeats (instructions, tools, tool_choice,
  // temperature, top_p, max_output_tokens, metadata, ...), in the Responses API's shapes.
  nlohmann::ordered_json echo;
};

// Errors name the Responses API's fields ("input[2].call_id", "tools[0].type").
absl::StatusOr<ResponsesRequest> ParseResponsesRequest(std::string_view body);

// POST /v1/responses: parsed here (a 400 names the field), served by `generation`'s chat path.
void HandleResponses(GenerationHandler& generation, std::string_view model_name,
                     const HttpRequest& req, std::shared_ptr<HttpExchange> exchange);

// An exchange that answers the Responses API's way through `inner`, given the chat path's answer:
// a chat.completion becomes a response object, a stream of chat chunks the Responses API's
// events; errors pass unchanged (both APIs share OpenAI's error body).
std::shared_ptr<HttpExchange> ResponsesExchange(std::shared_ptr<HttpExchange> inner,
                                                nlohmann::ordered_json echo);

// The response object for a whole chat.completion `chat` (one choice).
nlohmann::ordered_json ResponseOfChat(const nlohmann::json& chat,
                                      const nlohmann::ordered_json& echo, std::string_view id);

}  // namespace tandem::openai
