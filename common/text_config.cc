// Reading the text settings of a model folder; see text_config.h for which file wins.
#include "common/text_config.h"

#include <fstream>
#include <sstream>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/bounded_json.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace tandem {
namespace {

constexpr int64_t kMaxSensibleLength = int64_t{1} << 24;

// The file's JSON object, or nullopt when the file does not exist.
absl::StatusOr<std::optional<nlohmann::json>> ReadJsonObject(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::optional<nlohmann::json>();
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot open"));
  std::ostringstream text;
  text << in.rdbuf();
  ASSIGN_OR_RETURN(nlohmann::json json, ParseBoundedJson(text.str(), path.string()));
  if (!json.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": top level must be an object"));
  }
  return std::optional<nlohmann::json>(std::move(json));
}

// An id or a list of ids at json[key]; empty when absent or null.
absl::StatusOr<std::vector<int32_t>> Ids(const std::optional<nlohmann::json>& json,
                                         const char* key, const std::string& file) {
  std::vector<int32_t> ids;
  if (!json.has_value() || !json->contains(key) || (*json)[key].is_null()) return ids;
  const nlohmann::json& value = (*json)[key];
  auto add = [&](const nlohmann::json& v) -> absl::Status {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": ", key, " must be a non-negative id or a list of them, got ",
                       value.dump()));
    }
    ids.push_back(v.get<int32_t>());
    return absl::OkStatus();
  };
  if (value.is_array()) {
    for (const auto& v : value) RETURN_IF_ERROR(add(v));
  } else {
    RETURN_IF_ERROR(add(value));
  }
  return ids;
}

// A token string at json[key]: a string, or an added-token object with "content"; "" for null.
absl::StatusOr<std::string> TokenString(const std::optional<nlohmann::json>& json,
                                        const char* key, const std::string& file) {
  if (!json.has_value() || !json->contains(key) || (*json)[key].is_null()) return std::string();
  const nlohmann::json& value = (*json)[key];
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string()) {
    return value["content"].get<std::string>();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      file, ": ", key, " must be a string or an object with \"content\", got ", value.dump()));
}

// A length limit at json[key] when it is an integer in 1..kMaxSensibleLength.
std::optional<int> SensibleLength(const std::optional<nlohmann::json>& json, const char* key) {
  if (!json.has_value() || !json->contains(key)) return std::nullopt;
  const nlohmann::json& v = (*json)[key];
  if (!v.is_number()) return std::nullopt;
  const double d = v.get<double>();
  if (d < 1 || d > static_cast<double>(kMaxSensibleLength)) return std::nullopt;
  return static_cast<int>(d);
}

absl::StatusOr<std::string> ChatTemplate(const std::filesystem::path& dir,
                                         const std::optional<nlohmann::json>& tokenizer_config) {
  const std::string file = (dir / "tokenizer_config.json").string();
  if (tokenizer_config.has_value() && tokenizer_config->contains("chat_template") &&
      !(*tokenizer_config)["chat_template"].is_null()) {
    const nlohmann::json& t = (*tokenizer_config)["chat_template"];
    if (t.is_string()) return t.get<std::string>();
    if (t.is_array()) {
      for (const auto& entry : t) {
        if (entry.is_object() && entry.value("name", "") == "default" &&
            entry.contains("template") && entry["template"].is_string()) {
          return entry["template"].get<std::string>();
        }
      }
      return std::string();  // named templates only; none is the default
    }
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": chat_template must be a string or a list of {name, template}"));
  }
  std::error_code ec;
  if (std::filesystem::exists(dir / "chat_template.jinja", ec)) {
    std::ifstream in(dir / "chat_template.jinja", std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    return std::move(text).str();
  }
  ASSIGN_OR_RETURN(std::optional<nlohmann::json> json, ReadJsonObject(dir / "chat_template.json"));
  if (json.has_value() && json->contains("chat_template") && (*json)["chat_template"].is_string()) {
    return (*json)["chat_template"].get<std::string>();
  }
  return std::string();
}

}  // namespace

absl::StatusOr<TextConfig> LoadTextConfig(const std::filesystem::path& dir,
                                          const ModelConfig& model, const Tokenizer* tokenizer) {
  const std::string tokenizer_file = (dir / "tokenizer_config.json").string();
  const std::string generation_file = (dir / "generation_config.json").string();
  const std::string config_file = (dir / "config.json").string();
  ASSIGN_OR_RETURN(std::optional<nlohmann::json> tokenizer_config,
                   ReadJsonObject(dir / "tokenizer_config.json"));
  ASSIGN_OR_RETURN(std::optional<nlohmann::json> generation_config,
                   ReadJsonObject(dir / "generation_config.json"));
  ASSIGN_OR_RETURN(std::optional<nlohmann::json> config, ReadJsonObject(dir / "config.json"));

  TextConfig text;
  ASSIGN_OR_RETURN(text.bos_token, TokenString(tokenizer_config, "bos_token", tokenizer_file));
  ASSIGN_OR_RETURN(text.eos_token, TokenString(tokenizer_config, "eos_token", tokenizer_file));

  ASSIGN_OR_RETURN(std::vector<int32_t> bos, Ids(generation_config, "bos_token_id", generation_file));
  if (bos.empty()) {
    ASSIGN_OR_RETURN(bos, Ids(config, "bos_token_id", config_file));
  }
  if (bos.empty() && model.bos_token_id >= 0) bos.push_back(model.bos_token_id);
  if (bos.empty() && tokenizer != nullptr && !text.bos_token.empty()) {
    if (auto id = tokenizer->TokenToId(text.bos_token)) bos.push_back(*id);
  }
  if (!bos.empty()) text.bos_token_id = bos.front();

  ASSIGN_OR_RETURN(text.eos_token_ids, Ids(generation_config, "eos_token_id", generation_file));
  if (text.eos_token_ids.empty()) {
    ASSIGN_OR_RETURN(text.eos_token_ids, Ids(config, "eos_token_id", config_file));
  }
  if (text.eos_token_ids.empty() && model.eos_token_id >= 0) {
    text.eos_token_ids.push_back(model.eos_token_id);
  }
  if (text.eos_token_ids.empty() && tokenizer != nullptr && !text.eos_token.empty()) {
    if (auto id = tokenizer->TokenToId(text.eos_token)) text.eos_token_ids.push_back(*id);
  }

  // Every id must be one the model can embed and the tokenizer can spell.
  const int vocab = tokenizer != nullptr ? std::max(tokenizer->vocab_size(), model.vocab_size)
                                         : model.vocab_size;
  auto check = [&](int32_t id, const char* what) -> absl::Status {
    if (vocab > 0 && id >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(dir.string(), ": ", what, " ", id,
                                                     " is outside the vocabulary of ", vocab));
    }
    return absl::OkStatus();
  };
  if (text.bos_token_id) RETURN_IF_ERROR(check(*text.bos_token_id, "bos_token_id"));
  for (int32_t id : text.eos_token_ids) RETURN_IF_ERROR(check(id, "eos_token_id"));

  if (tokenizer != nullptr) {
    if (text.bos_token.empty() && text.bos_token_id) {
      text.bos_token = tokenizer->IdToToken(*text.bos_token_id).value_or("");
    }
    if (text.eos_token.empty() && !text.eos_token_ids.empty()) {
      text.eos_token = tokenizer->IdToToken(text.eos_token_ids.front()).value_or("");
    }
  }

  // What text prompts get is what the tokenizer's post-processor does; tokenizer_config.json's
  // flag speaks only where there is no tokenizer to ask.
  if (tokenizer != nullptr) {
    ASSIGN_OR_RETURN(const std::vector<int32_t> empty, tokenizer->Encode("", true));
    text.add_bos_token = text.bos_token_id && !empty.empty() && empty.front() == *text.bos_token_id;
  } else if (tokenizer_config.has_value() && tokenizer_config->contains("add_bos_token") &&
             !(*tokenizer_config)["add_bos_token"].is_null()) {
    if (!(*tokenizer_config)["add_bos_token"].is_boolean()) {
      return absl::InvalidArgumentError(
          absl::StrCat(tokenizer_file, ": add_bos_token must be true or false"));
    }
    text.add_bos_token = (*tokenizer_config)["add_bos_token"].get<bool>();
  }

  ASSIGN_OR_RETURN(text.chat_template, ChatTemplate(dir, tokenizer_config));
  text.max_length = SensibleLength(tokenizer_config, "model_max_length");
  if (!text.max_length) text.max_length = SensibleLength(generation_config, "max_length");
  return text;
}

}  // namespace tandem
