// What tokenizer_config.json, generation_config.json and config.json say about text: the
// special tokens, when generation stops, the chat template and the length limit.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/tokenizer.h"

namespace tandem {

struct TextConfig {
  std::string bos_token, eos_token;    // "" when none (token strings, for chat templates)
  std::optional<int32_t> bos_token_id;
  std::vector<int32_t> eos_token_ids;  // generation stops at any of them
  bool add_bos_token = false;          // text prompts get BOS first (the tokenizer adds it)
  std::string chat_template;  // "" when none (a string, or the "default" of a list of templates)
  std::optional<int> max_length;  // model_max_length / generation max_length when set sensibly
};

// Reads the files that exist in `dir` (all are optional):
// - bos/eos ids: generation_config.json, else config.json (an id or a list of ids), else the
//   tokenizer's id of tokenizer_config.json's token string.
// - bos/eos strings: tokenizer_config.json (a string or an {"content": ...} object), else the
//   tokenizer's token of the first id.
// - add_bos_token: whether the tokenizer's post-processor puts BOS first (what text prompts
//   get); tokenizer_config.json's flag only when there is no tokenizer.
// - chat_template: tokenizer_config.json's, else chat_template.jinja, else chat_template.json's.
// - max_length: tokenizer_config.json's model_max_length, else generation_config.json's
//   max_length, when 1 .. 16M (Hugging Face writes 1e30 for "no limit").
// Malformed files, fields of the wrong type and ids outside the vocabulary are errors naming the
// file and field. `tokenizer` may be null.
absl::StatusOr<TextConfig> LoadTextConfig(const std::filesystem::path& dir,
                                          const ModelConfig& model, const Tokenizer* tokenizer);

}  // namespace tandem
