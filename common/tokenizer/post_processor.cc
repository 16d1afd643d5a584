// Post-processors for one sequence: TemplateProcessing's "single" template (its special tokens'
// ids around $A), RobertaProcessing's and BertProcessing's cls ... sep, ByteLevel's none (it only
// moves offsets), and a Sequence applying each in turn, so later ones wrap earlier ones.
#include "common/tokenizer/post_processor.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tokenizer/json_fields.h"

namespace tandem::tokenizer {
namespace {

// One of Roberta's/Bert's ["token", id] pairs.
absl::StatusOr<int32_t> TokenIdPair(const nlohmann::json& obj, const char* key,
                                    const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_array() || it->size() != 2 || !(*it)[0].is_string() ||
      !(*it)[1].is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".", key, " must be [\"token\", id]"));
  }
  return (*it)[1].get<int32_t>();
}

absl::Status Parse(const nlohmann::json& json, const std::string& where, PostProcessor& out) {
  ASSIGN_OR_RETURN(std::string type, ComponentType(json, where));
  const std::string here = absl::StrCat(where, " (", type, ")");
  if (type == "Sequence") {
    RETURN_IF_ERROR(CheckKeys(json, {"type", "processors"}, here));
    auto list = json.find("processors");
    if (list == json.end() || !list->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(here, ": no \"processors\" array"));
    }
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(Parse((*list)[i], absl::StrCat(where, ".processors[", i, "]"), out));
    }
    return absl::OkStatus();
  }
  if (type == "ByteLevel") {
    return CheckKeys(json, {"type", "add_prefix_space", "trim_offsets", "use_regex"}, here);
  }
  std::vector<int32_t> prefix, suffix;
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    RETURN_IF_ERROR(
        CheckKeys(json, {"type", "sep", "cls", "trim_offsets", "add_prefix_space"}, here));
    ASSIGN_OR_RETURN(int32_t cls, TokenIdPair(json, "cls", here));
    ASSIGN_OR_RETURN(int32_t sep, TokenIdPair(json, "sep", here));
    prefix = {cls};
    suffix = {sep};
  } else if (type == "TemplateProcessing") {
    RETURN_IF_ERROR(CheckKeys(json, {"type", "single", "pair", "special_tokens"}, here));
    auto single = json.find("single");
    auto specials = json.find("special_tokens");
    if (single == json.end() || !single->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(here, ": no \"single\" template array"));
    }
    bool seen_a = false;
    for (size_t i = 0; i < single->size(); ++i) {
      const nlohmann::json& item = (*single)[i];
      const std::string at = absl::StrCat(here, ".single[", i, "]");
      if (auto seq = item.find("Sequence"); item.is_object() && seq != item.end()) {
        if (!seq->is_object() || seq->value("id", "") != "A" || seen_a) {
          return Unsupported(at, absl::StrCat("sequence ", seq->dump(),
                                              " (a single template holds $A once)"));
        }
        seen_a = true;
      } else if (auto sp = item.find("SpecialToken"); item.is_object() && sp != item.end()) {
        if (!sp->is_object() || !sp->contains("id") || !(*sp)["id"].is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(at, ": SpecialToken without an id"));
        }
        const std::string name = (*sp)["id"].get<std::string>();
        if (specials == json.end() || !specials->is_object() || !specials->contains(name)) {
          return absl::InvalidArgumentError(
              absl::StrCat(at, ": special token \"", name, "\" is not in special_tokens"));
        }
        const nlohmann::json& special = (*specials)[name];
        const auto ids_at = special.find("ids");  // end() for a value that is not an object
        if (ids_at == special.end() || !ids_at->is_array()) {
          return absl::InvalidArgumentError(
              absl::StrCat(here, ".special_tokens.", name, ".ids must be an array"));
        }
        for (const auto& id : *ids_at) {
          if (!id.is_number_integer() || id.get<int64_t>() < 0) {
            return absl::InvalidArgumentError(
                absl::StrCat(here, ".special_tokens.", name, ".ids holds ", id.dump()));
          }
          (seen_a ? suffix : prefix).push_back(id.get<int32_t>());
        }
      } else {
        return Unsupported(at, absl::StrCat("template item ", item.dump()));
      }
    }
    if (!seen_a) {
      return Unsupported(here, "a single template without $A");
    }
  } else {
    return Unsupported(where, absl::StrCat("post_processor type \"", type, "\""));
  }
  out.prefix.insert(out.prefix.begin(), prefix.begin(), prefix.end());
  out.suffix.insert(out.suffix.end(), suffix.begin(), suffix.end());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PostProcessor> PostProcessor::FromJson(const nlohmann::json& json,
                                                      const std::string& where) {
  PostProcessor p;
  RETURN_IF_ERROR(Parse(json, where, p));
  return p;
}

}  // namespace tandem::tokenizer
