// Test values for settings declared with common/settings.h: each one changed from a given value
// (within every bound, which are at most the defaults), and its text on a command line or in YAML.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <type_traits>

#include "absl/flags/marshalling.h"
#include "common/settings.h"

namespace tandem {

template <typename T>
T ChangedSetting(const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return !v;
  } else if constexpr (std::is_same_v<T, std::string>) {
    return v + "x";
  } else if constexpr (std::is_same_v<T, std::filesystem::path>) {
    return v.string() + "/changed";
  } else if constexpr (std::is_same_v<T, std::optional<int>>) {
    return v.value_or(0) + 7;
  } else if constexpr (std::is_floating_point_v<T>) {
    return v + 2.5;
  } else {
    return v + 7;
  }
}

// The value as a flag's text (also a YAML scalar for these values).
template <typename T>
std::string SettingText(const T& v) {
  return absl::UnparseFlag(SettingFlag<T>::To(v));
}

}  // namespace tandem
