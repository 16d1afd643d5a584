// The prompt of a chat request: its messages rendered by the model's chat template (from
// tokenizer_config.json, common/text_config.h) with the context Hugging Face transformers gives
// it: messages, add_generation_prompt, bos_token, eos_token, tools when given, and the request's
// chat_template_kwargs. Objects reach the template with their keys in the client's order.
#pragma once

#include <string>
#include <string_view>

#include "common/text_config.h"
#include "coordinator/openai/generation_handler.h"

namespace tandem::openai {

// A renderer for the model's template. A model without a template, or with one that cannot be
// parsed, still gets a renderer: it refuses every chat request with 400 saying why (and
// /v1/completions works as ever). `load_error`, when not null, receives that reason (OK when the
// template loaded), for the log.
ChatRenderer MakeChatRenderer(const TextConfig& text, absl::Status* load_error);

// continue_final_message (vLLM's, as Hugging Face's apply_chat_template does it): `prompt`, the
// conversation rendered without a generation prompt, cut right after the last occurrence of the
// last message's text `final_text`, so that what the template writes after it (the end of the
// turn) is gone and the model continues the message. A 400 naming messages[final_index].content
// when the template does not write that text.
absl::StatusOr<std::string> OpenFinalMessage(std::string prompt, std::string_view final_text,
                                             size_t final_index);

}  // namespace tandem::openai
