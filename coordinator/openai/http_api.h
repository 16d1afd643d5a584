// Starting the OpenAI-compatible HTTP API the way the coordinator's config asks: its address,
// its event threads and bounds, the model's name, and the model's chat template.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "common/security/credentials.h"
#include "coordinator/coordinator.h"
#include "coordinator/openai/http_server.h"

namespace tandem::openai {

// The model's id in the API: served_model_name, else the last part of model_dir.
std::string ServedModelName(const CoordinatorConfig& config);

// Serves config().http_listen. A model without a usable chat template is logged and served
// without chat (chat requests get 400 saying so; completions work). Tool calls are read in the
// format config().tool_call_parser names, else the one the chat template's markers show.
// `api_key`: what callers present as `Authorization: Bearer <key>` (empty: no key needed). `tls`:
// with a certificate and key, HTTPS (clients are not asked for certificates).
absl::StatusOr<std::unique_ptr<HttpServer>> StartHttpApi(Coordinator& c,
                                                         const std::string& api_key = "",
                                                         const TlsFiles& tls = {});

}  // namespace tandem::openai
