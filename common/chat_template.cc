#include "common/chat_template.h"

#include "common/jinja/ast.h"
#include "common/jinja/parser.h"
#include "common/jinja/render.h"
#include "common/jinja/value.h"
#include "common/status_macros.h"

namespace tandem {

namespace jinja {
// The parsed template, shared by copies of a ChatTemplate (it is never changed after parsing).
struct Program {
  Body body;
};
}  // namespace jinja

namespace {

std::tm LocalNow() {
  std::time_t t = std::time(nullptr);
  std::tm now{};
  localtime_r(&t, &now);
  return now;
}

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplate::Parse(std::string_view source) {
  ASSIGN_OR_RETURN(jinja::Body body, jinja::ParseTemplate(source));
  ChatTemplate chat_template;
  chat_template.program_ = std::make_shared<jinja::Program>(jinja::Program{std::move(body)});
  chat_template.now_ = LocalNow;
  return chat_template;
}

absl::StatusOr<std::string> ChatTemplate::Render(const nlohmann::json& context) const {
  // nlohmann::json keeps object keys sorted; the ordered copy keeps that order.
  return Render(nlohmann::ordered_json::parse(
      context.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)));
}

absl::StatusOr<std::string> ChatTemplate::Render(const nlohmann::ordered_json& context) const {
  if (!context.is_object()) {
    return absl::InvalidArgumentError("chat template context must be a JSON object");
  }
  return jinja::Render(program_->body, jinja::Value::FromJson(context), now_);
}

}  // namespace tandem
