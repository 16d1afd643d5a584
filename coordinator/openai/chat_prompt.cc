// Chat requests through the model's chat template.
#include "coordinator/openai/chat_prompt.h"

#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/chat_template.h"
#include "coordinator/openai/api_error.h"

namespace tandem::openai {

absl::StatusOr<std::string> OpenFinalMessage(std::string prompt, std::string_view final_text,
                                             size_t final_index) {
  // As Hugging Face's apply_chat_template: the template may trim the message, so the stripped
  // text is looked for, and its trailing whitespace kept only where the template kept it.
  const absl::string_view text(final_text.data(), final_text.size());
  const absl::string_view stripped = absl::StripAsciiWhitespace(text);
  const size_t at = prompt.rfind(stripped.data(), std::string::npos, stripped.size());
  if (at == std::string::npos) {
    return InvalidField(absl::StrCat("messages[", final_index, "].content"),
                        "continue_final_message: the chat template does not write the last "
                        "message's text into the prompt, so it cannot be continued");
  }
  const absl::string_view lstripped = absl::StripLeadingAsciiWhitespace(text);
  const bool kept = std::string_view(prompt).substr(at, lstripped.size()) == final_text;
  prompt.resize(at + (kept ? lstripped.size() : stripped.size()));
  return prompt;
}

ChatRenderer MakeChatRenderer(const TextConfig& text, absl::Status* load_error) {
  absl::Status error;
  if (text.chat_template.empty()) {
    error = absl::NotFoundError(
        "this model has no chat template (its tokenizer_config.json names none); use "
        "/v1/completions");
  } else {
    absl::StatusOr<ChatTemplate> parsed = ChatTemplate::Parse(text.chat_template);
    if (parsed.ok()) {
      auto tmpl = std::make_shared<const ChatTemplate>(*std::move(parsed));
      if (load_error != nullptr) *load_error = absl::OkStatus();
      return [tmpl, bos = text.bos_token,
              eos = text.eos_token](const ApiRequest& r) -> absl::StatusOr<std::string> {
        nlohmann::ordered_json context = r.template_kwargs;
        context["messages"] = r.messages;
        context["add_generation_prompt"] = r.add_generation_prompt;
        context["bos_token"] = bos;
        context["eos_token"] = eos;
        if (!r.tools.is_null()) context["tools"] = r.tools;
        absl::StatusOr<std::string> prompt = tmpl->Render(context);
        if (!prompt.ok()) {
          return InvalidField("messages",
                              absl::StrCat("the model's chat template refused the conversation: ",
                                           prompt.status().message()));
        }
        if (!r.continue_final_message) return prompt;
        return OpenFinalMessage(*std::move(prompt),
                                r.messages.back()["content"].get_ref<const std::string&>(),
                                r.messages.size() - 1);
      };
    }
    error = absl::InvalidArgumentError(absl::StrCat(
        "this model's chat template cannot be used (", parsed.status().message(),
        "); use /v1/completions"));
  }
  if (load_error != nullptr) *load_error = error;
  return [error](const ApiRequest&) -> absl::StatusOr<std::string> {
    return InvalidFieldMessage("messages", absl::StrCat("messages: ", error.message()));
  };
}

}  // namespace tandem::openai
