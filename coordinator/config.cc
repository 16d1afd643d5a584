// YAML config parsing (yaml-cpp throws: every call into it is inside one try block).
#include "coordinator/config.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_format.h"
#include "coordinator/scheduler.h"
#include "yaml-cpp/yaml.h"

namespace tandem {

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
      const YAML::Node& v = kv.second;
      if (key == "listen") c.listen = v.as<std::string>();
      else if (key == "model_dir") c.model_dir = v.as<std::string>();
      else if (key == "stages") c.stages = v.as<int>();
      else if (key == "replicas") c.replicas = v.as<int>();
      else if (key == "max_batch") c.max_batch = v.as<int>();
      else if (key == "max_slots") c.max_slots = v.as<int>();
      else if (key == "max_seq_len") c.max_seq_len = v.as<int>();
      else if (key == "micro_batches") c.micro_batches = v.as<int>();
      else if (key == "max_waiting") c.max_waiting = v.as<int>();
      else if (key == "prefill_chunk") c.prefill_chunk = v.as<int>();
      else if (key == "prefill_budget") c.prefill_budget = v.as<int>();
      else if (key == "decode_ahead") c.decode_ahead = v.as<bool>();
      else if (key == "decode_ahead_ms") c.decode_ahead_ms = v.as<double>();
      else if (key == "max_resumes") c.max_resumes = v.as<int>();
      else if (key == "admission_quiet_ms") c.admission_quiet_ms = v.as<double>();
      else if (key == "admission_wait_ms") c.admission_wait_ms = v.as<double>();
      else if (key == "prefill_replicas") c.prefill_replicas = v.as<int>();
      else if (key == "move_kv") c.move_kv = v.as<bool>();
      else if (key == "heartbeat_interval_ms") c.heartbeat_interval_ms = v.as<int>();
      else if (key == "heartbeat_timeout_ms") c.heartbeat_timeout_ms = v.as<int>();
      else if (key == "drain_timeout_s") c.drain_timeout_s = v.as<double>();
      else if (key == "http_listen") c.http_listen = v.as<std::string>();
      else if (key == "http_threads") c.http_threads = v.as<int>();
      else if (key == "http_max_connections") c.http_max_connections = v.as<int>();
      else if (key == "http_header_timeout_s") c.http_header_timeout_s = v.as<int>();
      else if (key == "http_body_timeout_s") c.http_body_timeout_s = v.as<int>();
      else if (key == "grpc_threads") c.grpc_threads = v.as<int>();
      else if (key == "served_model_name") c.served_model_name = v.as<std::string>();
      else {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: unknown setting '%s'", source, key));
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
  auto at_least = [](std::string_view name, double v, double min) -> absl::Status {
    if (!(v >= min)) {  // NaN too
      return absl::InvalidArgumentError(
          absl::StrFormat("config: %s must be >= %g, got %g", name, min, v));
    }
    return absl::OkStatus();
  };
  if (c.listen.empty()) return absl::InvalidArgumentError("config: listen is empty");
  if (c.model_dir.empty()) {
    return absl::InvalidArgumentError("config: model_dir is not set (a Hugging Face folder)");
  }
  for (auto [name, v, min] : {std::tuple<std::string_view, double, double>{"stages", c.stages, 1},
                              {"replicas", c.replicas, 1},
                              {"max_batch", c.max_batch, 1},
                              {"max_slots", c.max_slots, 1},
                              {"max_seq_len", c.max_seq_len, 0},
                              {"micro_batches", c.micro_batches, 0},
                              {"max_waiting", c.max_waiting.value_or(0), 0},
                              {"prefill_chunk", c.prefill_chunk, 1},
                              {"prefill_budget", c.prefill_budget, 0},
                              {"decode_ahead_ms", c.decode_ahead_ms, 0},
                              {"max_resumes", c.max_resumes, 0},
                              {"admission_quiet_ms", c.admission_quiet_ms, 0},
                              {"admission_wait_ms", c.admission_wait_ms, 0},
                              {"prefill_replicas", c.prefill_replicas, 0},
                              {"heartbeat_interval_ms", c.heartbeat_interval_ms, 10},
                              {"heartbeat_timeout_ms", c.heartbeat_timeout_ms, 50},
                              {"drain_timeout_s", c.drain_timeout_s, 0},
                              {"http_threads", c.http_threads, 0},
                              {"http_max_connections", c.http_max_connections, 1},
                              {"http_header_timeout_s", c.http_header_timeout_s, 1},
                              {"http_body_timeout_s", c.http_body_timeout_s, 1},
                              {"grpc_threads", c.grpc_threads, 0}}) {
    if (absl::Status s = at_least(name, v, min); !s.ok()) return s;
  }
  if (c.prefill_replicas > 0 && c.prefill_replicas >= c.replicas) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "config: prefill_replicas (%d) must leave at least one of the %d replicas to decode",
        c.prefill_replicas, c.replicas));
  }
  if (c.heartbeat_timeout_ms <= c.heartbeat_interval_ms) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "config: heartbeat_timeout_ms (%d) must exceed heartbeat_interval_ms (%d)",
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
    return absl::NotFoundError(absl::StrFormat(
        "model_dir %s: has no config.json, so it is not a checkpoint folder; %s", dir.string(),
        kWhat));
  }
  return absl::OkStatus();
}

int RequestThreads(const CoordinatorConfig& c) {
  const int slots = c.replicas * c.max_slots;
  return slots + c.max_waiting.value_or(DefaultMaxWaiting(slots)) + 8;
}

}  // namespace tandem
