// Chat templates: the Jinja templates that Hugging Face models ship in tokenizer_config.json to
// turn a list of messages into a prompt. Rendered by tandem's own Jinja interpreter
// (common/jinja/), which follows Jinja2 as Hugging Face transformers configures it: trim_blocks and
// lstrip_blocks on, loop controls, the raise_exception and strftime_now globals, and a tojson that
// keeps non-ASCII text as is.
#pragma once

#include <ctime>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem {

namespace jinja {
struct Program;
}

class ChatTemplate {
 public:
  // Parses a Jinja chat template; INVALID_ARGUMENT naming the construct (and line) for anything
  // not implemented.
  static absl::StatusOr<ChatTemplate> Parse(std::string_view source);

  // Renders with `context` (a JSON object) as the template's variables: messages,
  // add_generation_prompt, bos_token, eos_token, tools, documents, ... whatever the caller passes.
  // Errors (raise_exception, type errors, undefined calls) come back as INVALID_ARGUMENT with the
  // message; raise_exception's message exactly as the template gave it.
  absl::StatusOr<std::string> Render(const nlohmann::json& context) const;
  // The same for a context parsed with nlohmann::ordered_json: dicts keep their keys in the
  // caller's order, as Python's do, so `tojson` writes them in that order (nlohmann::json sorts).
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& context) const;

  // The local time that strftime_now formats; the system clock unless set (tests fix it).
  void SetClock(std::function<std::tm()> now) { now_ = std::move(now); }

 private:
  ChatTemplate() = default;

  std::shared_ptr<const jinja::Program> program_;
  std::function<std::tm()> now_;
};

}  // namespace tandem
