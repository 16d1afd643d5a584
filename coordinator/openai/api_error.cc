// Status -> HTTP status and OpenAI's error JSON, in one place.
#include "coordinator/openai/api_error.h"

#include <optional>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace tandem::openai {
namespace {

constexpr char kParamPayload[] = "tandem.openai/param";

}  // namespace

absl::Status InvalidField(absl::string_view param, absl::string_view message) {
  return InvalidFieldMessage(param, absl::StrCat(param, ": ", message));
}

absl::Status InvalidFieldMessage(absl::string_view param, absl::string_view message) {
  absl::Status s = absl::InvalidArgumentError(message);
  s.SetPayload(kParamPayload, absl::Cord(param));
  return s;
}

std::string ParamOf(const absl::Status& status) {
  const auto p = status.GetPayload(kParamPayload);
  return p.has_value() ? std::string(*p) : std::string();
}

int HttpStatusOf(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk: return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition: return 400;
    case absl::StatusCode::kUnauthenticated: return 401;
    case absl::StatusCode::kPermissionDenied: return 403;
    case absl::StatusCode::kNotFound: return 404;
    case absl::StatusCode::kResourceExhausted: return 429;
    case absl::StatusCode::kCancelled: return 499;
    case absl::StatusCode::kUnimplemented: return 501;
    case absl::StatusCode::kUnavailable: return 503;
    case absl::StatusCode::kDeadlineExceeded: return 504;
    default: return 500;
  }
}

absl::string_view ErrorTypeOf(int http_status) {
  switch (http_status) {
    case 400: return "invalid_request_error";
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable_error";
    case 504: return "timeout_error";
    default: return "server_error";
  }
}

nlohmann::json ErrorBody(const absl::Status& status) {
  const int http = HttpStatusOf(status);
  const std::string param = ParamOf(status);
  nlohmann::json error = {{"message", std::string(status.message())},
                          {"type", ErrorTypeOf(http)},
                          {"param", param.empty() ? nlohmann::json() : nlohmann::json(param)},
                          {"code", http}};
  return {{"error", std::move(error)}};
}

}  // namespace tandem::openai
