// The HTTP API's settings from the coordinator's config.
#include "coordinator/openai/http_api.h"

#include "coordinator/openai/chat_prompt.h"
#include "coordinator/openai/reasoning_parser.h"
#include "spdlog/spdlog.h"

namespace tandem::openai {

std::string ServedModelName(const CoordinatorConfig& config) {
  if (!config.served_model_name.empty()) return config.served_model_name;
  std::filesystem::path dir = config.model_dir;
  if (!dir.has_filename()) dir = dir.parent_path();  // "models/gpt2/"
  return dir.filename().string();
}

absl::StatusOr<std::unique_ptr<HttpServer>> StartHttpApi(Coordinator& c,
                                                         const std::string& api_key,
                                                         const TlsFiles& tls) {
  const CoordinatorConfig& config = c.config();
  if (absl::StatusOr<ReasoningParser> parser = ParseReasoningParserName(config.reasoning_parser);
      !parser.ok()) {
    return parser.status();
  }
  HttpServerOptions options{.listen = config.http_listen,
                            .model_name = ServedModelName(config),
                            .threads = config.http_threads > 0 ? config.http_threads : 4,
                            .max_connections = config.http_max_connections,
                            .header_timeout_s = config.http_header_timeout_s,
                            .body_timeout_s = config.http_body_timeout_s,
                            .api_key = api_key,
                            .tls_cert = tls.cert,
                            .tls_key = tls.key};
  if (!config.tool_call_parser.empty()) {
    absl::StatusOr<ToolCallFormat> format = ToolCallFormatNamed(config.tool_call_parser);
    if (!format.ok()) return format.status();
    options.tool_format = *format;
  } else {
    options.tool_format = ToolCallFormatOfTemplate(c.text_config().chat_template);
  }
  ChatRenderer render_chat;
  if (c.tokenizer() != nullptr) {
    absl::Status chat_status;
    render_chat = MakeChatRenderer(c.text_config(), &chat_status);
    if (!chat_status.ok()) spdlog::warn("http: chat requests refused: {}", chat_status.ToString());
  }
  spdlog::info("http: serving {} as '{}' (tool calls: {})", config.model_dir.string(),
               options.model_name, ToolCallFormatName(options.tool_format));
  return HttpServer::Start(c, options, std::move(render_chat));
}

}  // namespace tandem::openai
