// Chat requests through the model's chat template.
#include "coordinator/openai/chat_prompt.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "common/chat_template.h"
#include "coordinator/openai/api_error.h"

namespace tandem::openai {

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
        nlohmann::json context = r.template_kwargs;
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
        return prompt;
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
