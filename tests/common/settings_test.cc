#include "common/settings.h"

#include <cmath>
#include <filesystem>
#include <optional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

#define TEST_SETTINGS(X)                                         \
  X(int, count, 2, 1, "a bounded number")                        \
  X(std::optional<int>, limit, std::nullopt, 0, "unset or >= 0") \
  X(std::string, name, "n", kAnyValue, "any text")

struct TestConfig {
  TEST_SETTINGS(TANDEM_SETTING_FIELD)
};
TANDEM_DEFINE_SETTING_VISITOR(TEST_SETTINGS, ForEachTestSetting)

TEST(SettingsTest, FieldsTakeTheirDefaultsAndTheVisitorSeesThemInOrder) {
  TestConfig c;
  EXPECT_EQ(c.count, 2);
  EXPECT_FALSE(c.limit.has_value());
  EXPECT_EQ(c.name, "n");
  std::string names;
  ForEachTestSetting(c, [&](std::string_view name, const auto&, double least) {
    names += std::string(name) + (least == kAnyValue ? "(any) " : " ");
  });
  EXPECT_EQ(names, "count limit name(any) ");
}

TEST(SettingsTest, ABoundRefusesLessAndNaNNamingTheSetting) {
  EXPECT_TRUE(CheckSettingAtLeast("--", "count", 1, 1).ok());
  EXPECT_THAT(CheckSettingAtLeast("--", "count", 0, 1).message(),
              HasSubstr("--count must be >= 1, got 0"));
  EXPECT_THAT(CheckSettingAtLeast("config: ", "ms", std::nan(""), 0).message(),
              HasSubstr("config: ms must be >= 0"));
  EXPECT_TRUE(CheckSettingAtLeast("--", "text", std::string(), 1).ok());
}

TEST(SettingsTest, AnUnsetOptionalPassesItsBoundAndASetOneIsChecked) {
  EXPECT_TRUE(CheckSettingAtLeast("--", "limit", std::optional<int>(), 0).ok());
  EXPECT_THAT(CheckSettingAtLeast("--", "limit", std::optional<int>(-1), 0).message(),
              HasSubstr("limit must be >= 0, got -1"));
}

TEST(SettingsTest, AnOptionalIsMinusOneOnTheCommandLineWhenUnset) {
  EXPECT_EQ(SettingFlag<std::optional<int>>::To(std::nullopt), -1);
  EXPECT_EQ(SettingFlag<std::optional<int>>::To(5), 5);
  EXPECT_FALSE(SettingFlag<std::optional<int>>::From(-1).has_value());
  EXPECT_EQ(SettingFlag<std::optional<int>>::From(0), 0);
  EXPECT_EQ(SettingFlag<std::filesystem::path>::From("/a/b"), std::filesystem::path("/a/b"));
}

}  // namespace
}  // namespace tandem
