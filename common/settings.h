// Settings declared once. A program lists its settings in one X-macro whose every entry is
//   X(type, name, default, least, help)
// (coordinator/config.h, worker/service/worker_config.h), and everything else is made from it:
// the config struct's field (TANDEM_SETTING_FIELD), the command-line flag with that default and
// help (TANDEM_DEFINE_SETTING_FLAGS in common/flags_usage.h, used by the program's main.cc), the
// range check (CheckSettingAtLeast) and, for the coordinator, the YAML key. `least` is the
// smallest value a number may take (kAnyValue: no bound; strings and booleans take kAnyValue).
#pragma once

#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace tandem {

// A setting without a lower bound.
inline constexpr double kAnyValue = -std::numeric_limits<double>::infinity();

// How a setting's type is given on the command line: a path as its text, an optional number as
// the number with -1 for "unset" (a flag has no "unset" that --help could show), the others as
// themselves.
template <typename T>
struct SettingFlag {
  using Type = T;
  static Type To(const T& v) { return v; }
  static T From(const Type& v) { return v; }
};
template <>
struct SettingFlag<std::filesystem::path> {
  using Type = std::string;
  static Type To(const std::filesystem::path& v) { return v.string(); }
  static std::filesystem::path From(const Type& v) { return v; }
};
template <>
struct SettingFlag<std::optional<int>> {
  using Type = int;
  static Type To(const std::optional<int>& v) { return v.value_or(-1); }
  static std::optional<int> From(Type v) { return v < 0 ? std::nullopt : std::optional<int>(v); }
};
template <typename T>
using SettingFlagType = typename SettingFlag<T>::Type;

// That number setting `name` is at least `least` (NaN is not); `prefix` begins the message
// ("config: " or "--"). Strings, booleans and unset optionals pass.
template <typename T>
absl::Status CheckSettingAtLeast(std::string_view prefix, std::string_view name, const T& value,
                                 double least) {
  if constexpr (std::is_same_v<T, std::optional<int>>) {
    if (!value.has_value()) return absl::OkStatus();
    return CheckSettingAtLeast(prefix, name, *value, least);
  } else if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
    const double v = static_cast<double>(value);
    if (!(v >= least)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s%s must be >= %g, got %g", prefix, name, least, v));
    }
    return absl::OkStatus();
  } else {
    return absl::OkStatus();
  }
}

}  // namespace tandem

// A config struct's field: `type name{default};`.
#define TANDEM_SETTING_FIELD(type, name, default_value, least, help) type name{default_value};

#define TANDEM_SETTING_VISIT_(type, name, default_value, least, help) \
  visit(std::string_view(#name), config.name, double(least));

// `template <typename C, typename F> void function(C& config, F&& visit)`: calls
// visit(name, field, least) for each setting of LIST, in the list's order (C: the config, or a
// const one).
#define TANDEM_DEFINE_SETTING_VISITOR(LIST, function) \
  template <typename C, typename F>                   \
  void function(C& config, F&& visit) {               \
    LIST(TANDEM_SETTING_VISIT_)                       \
  }
