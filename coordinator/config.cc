// YAML config parsing (yaml-cpp throws: every call into it is inside one try block).
#include "coordinator/config.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <type_traits>

#include "absl/strings/str_format.h"
#include "common/model_config.h"
#include "coordinator/scheduler.h"
#include "yaml-cpp/yaml.h"

namespace tandem {

namespace {

// A setting's value from its YAML node (yaml-cpp throws YAML::Exception on a wrong type).
template <typename T>
T FromYaml(const YAML::Node& v) {
  if constexpr (std::is_same_v<T, std::filesystem::path>) {
    return v.as<std::string>();
  } else if constexpr (std::is_same_v<T, std::optional<int>>) {
    return v.as<int>();
  } else {
    return v.as<T>();
  }
}

}  // namespace

absl::StatusOr<CoordinatorConfig> ParseCoordinatorConfig(std::string_view yaml_text,
                                                         std::string_view source) {
  CoordinatorConfig c;
  std::string key;
  try {
    const YAML::Node root = YAML::Load(std::string(yaml_text));
    if (root.IsNull()) return c;
    if (!root.IsMap()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: the top level must be a mapping of settings", source));
    }
    for (const auto& kv : root) {
      key = kv.first.as<std::string>();
      bool known = false;
      ForEachCoordinatorSetting(c, [&](std::string_view name, auto& field, double) {
        if (name != key) return;
        field = FromYaml<std::remove_reference_t<decltype(field)>>(kv.second);
        known = true;
      });
      if (!known) {
        return absl::InvalidArgumentError(absl::StrFormat("%s: unknown setting '%s'", source, key));
      }
    }
  } catch (const YAML::Exception& e) {
    if (key.empty()) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: %s", source, e.what()));
    }
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: setting '%s': %s", source, key, e.what()));
  }
  return c;
}

absl::StatusOr<CoordinatorConfig> LoadCoordinatorConfig(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrFormat("%s: cannot open config file", path.string()));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseCoordinatorConfig(ss.str(), path.string());
}

absl::Status ValidateCoordinatorConfig(const CoordinatorConfig& c) {
  if (c.listen.empty()) return absl::InvalidArgumentError("config: listen is empty");
  if (c.model_dir.empty()) {
    return absl::InvalidArgumentError("config: model_dir is not set (a Hugging Face folder)");
  }
  absl::Status status;
  ForEachCoordinatorSetting(c, [&](std::string_view name, const auto& value, double least) {
    if (status.ok()) status = CheckSettingAtLeast("config: ", name, value, least);
  });
  if (!status.ok()) return status;
  if (c.prefill_replicas > 0 && c.prefill_replicas >= c.replicas) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "config: prefill_replicas (%d) must leave at least one of the %d replicas to decode",
        c.prefill_replicas, c.replicas));
  }
  if (c.kv_pages.has_value() && c.kv_page_size == 0) {
    return absl::InvalidArgumentError(
        "config: kv_pages counts pages of kv_page_size tokens; set kv_page_size too");
  }
  absl::StatusOr<KvCacheDType> kv_dtype =
      ParseKvCacheDType(c.kv_cache_dtype, "config: kv_cache_dtype");
  if (!kv_dtype.ok()) return kv_dtype.status();
  if (*kv_dtype == KvCacheDType::kFp8E4M3 && c.kv_page_size == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "config: kv_cache_dtype %s keeps the KV-cache in pages, and kv_page_size 0 asks for "
        "contiguous slots: give kv_page_size > 0 (or leave it unset) or kv_cache_dtype auto",
        c.kv_cache_dtype));
  }
  if (c.heartbeat_timeout_ms <= c.heartbeat_interval_ms) {
    return absl::InvalidArgumentError(
        absl::StrFormat("config: heartbeat_timeout_ms (%d) must exceed heartbeat_interval_ms (%d)",
                        c.heartbeat_timeout_ms, c.heartbeat_interval_ms));
  }
  return absl::OkStatus();
}

absl::Status CheckModelDir(const std::filesystem::path& dir) {
  constexpr const char* kWhat =
      "give --model_dir the folder of a Hugging Face checkpoint (config.json, *.safetensors, "
      "tokenizer.json), as the workers see it";
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(dir, ec);
  if (!std::filesystem::exists(st)) {
    return absl::NotFoundError(
        absl::StrFormat("model_dir %s: no such folder; %s", dir.string(), kWhat));
  }
  if (!std::filesystem::is_directory(st)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("model_dir %s: is a file, not a folder; %s", dir.string(), kWhat));
  }
  if (!std::filesystem::exists(dir / "config.json", ec)) {
    return absl::NotFoundError(
        absl::StrFormat("model_dir %s: has no config.json, so it is not a checkpoint folder; %s",
                        dir.string(), kWhat));
  }
  return absl::OkStatus();
}

CoordinatorConfig WithModelDefaults(CoordinatorConfig c, int head_dim, int group) {
  if (c.kv_page_size < 0) {
    const bool fp8 = KvCacheDTypeOf(c) == KvCacheDType::kFp8E4M3;
    c.kv_page_size = CudaPagesTakeHeads(head_dim, group) || c.kv_pages.has_value() || fp8 ? 16 : 0;
  }
  return c;
}

KvCacheDType KvCacheDTypeOf(const CoordinatorConfig& c) {
  return ParseKvCacheDType(c.kv_cache_dtype, "kv_cache_dtype").value_or(KvCacheDType::kAuto);
}

int MaxSlots(const CoordinatorConfig& c) {
  if (c.max_slots > 0) return c.max_slots;
  return Paged(c) ? 256 : 16;
}

int MaxBatch(const CoordinatorConfig& c) {
  if (c.max_batch > 0) return c.max_batch;
  return Paged(c) ? MaxSlots(c) : 16;
}

int PrefillBudget(const CoordinatorConfig& c) {
  if (c.prefill_budget.has_value()) return *c.prefill_budget;
  return Paged(c) ? 8192 : 0;
}

int64_t MaxStepRows(const CoordinatorConfig& c) {
  const int64_t chunks = int64_t{MaxBatch(c)} * c.prefill_chunk;
  const int budget = PrefillBudget(c);
  return budget > 0 ? std::min<int64_t>(chunks, int64_t{budget} + MaxBatch(c)) : chunks;
}

int RequestThreads(const CoordinatorConfig& c) {
  const int slots = c.replicas * MaxSlots(c);
  return slots + c.max_waiting.value_or(DefaultMaxWaiting(slots)) + 8;
}

}  // namespace tandem
