// The prompt of a chat request: its messages rendered by the model's chat template (from
// tokenizer_config.json, common/text_config.h) with the context Hugging Face transformers gives
// it: messages, add_generation_prompt, bos_token, eos_token, tools when given, and the request's
// chat_template_kwargs.
#pragma once

#include "common/text_config.h"
#include "coordinator/openai/generation_handler.h"

namespace tandem::openai {

// A renderer for the model's template. A model without a template, or with one that cannot be
// parsed, still gets a renderer: it refuses every chat request with 400 saying why (and
// /v1/completions works as ever). `load_error`, when not null, receives that reason (OK when the
// template loaded), for the log.
ChatRenderer MakeChatRenderer(const TextConfig& text, absl::Status* load_error);

}  // namespace tandem::openai
