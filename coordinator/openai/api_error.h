// Errors of the OpenAI-compatible HTTP API: which HTTP status an absl::Status becomes (decided
// here and nowhere else), and OpenAI's error body
//   {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature",
//              "code": null}}
// A status made by InvalidField carries the request field it is about (OpenAI's `param`).
#pragma once

#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "nlohmann/json.hpp"

namespace tandem::openai {

// INVALID_ARGUMENT about request field `param` (a JSON path such as "messages[1].content").
absl::Status InvalidField(absl::string_view param, absl::string_view message);
// The same with the whole message given ("param: ..." is not prepended).
absl::Status InvalidFieldMessage(absl::string_view param, absl::string_view message);
// The field a status is about: InvalidField's, else "" (no field).
std::string ParamOf(const absl::Status& status);

// The HTTP status for a request that ended with `status`: 400 invalid, 404 not found, 429 queue
// full, 499 client gone (never seen by the client), 503 no pipeline, 504 deadline, 500 the rest.
int HttpStatusOf(const absl::Status& status);
// OpenAI's `type` for an HTTP status ("invalid_request_error", "rate_limit_error", ...).
absl::string_view ErrorTypeOf(int http_status);

// The body for `status` (not OK).
nlohmann::json ErrorBody(const absl::Status& status);

}  // namespace tandem::openai
