// worker/model_root.cc: only folders inside --model_root are loaded, and a refusal reads the same
// whether or not the path outside exists.
#include "worker/model_root.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;

class ModelRootTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::path(TANDEM_TEST_TMPDIR) / ("model_root-" + std::to_string(getpid()));
    fs::remove_all(base_);
    fs::create_directories(base_ / "models" / "gpt2");
    fs::create_directories(base_ / "models-old" / "gpt2");
    fs::create_directories(base_ / "outside" / "secret");
    fs::create_directory_symlink(base_ / "outside", base_ / "models" / "escape");
  }
  void TearDown() override { fs::remove_all(base_); }

  // The message of a refusal with the requested path itself replaced, for comparing two.
  static std::string Shape(const absl::StatusOr<fs::path>& r, const std::string& requested) {
    return absl::StrReplaceAll(r.status().message(), {{requested, "<path>"}});
  }

  fs::path root() const { return base_ / "models"; }
  fs::path base_;
};

TEST_F(ModelRootTest, NoRootAllowsAnyPathAsGiven) {
  absl::StatusOr<fs::path> r = ResolveModelDir("", "relative/dir");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, fs::path("relative/dir"));
}

TEST_F(ModelRootTest, AcceptsAFolderInsideTheRoot) {
  absl::StatusOr<fs::path> r = ResolveModelDir(root(), (root() / "gpt2").string());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, fs::canonical(root() / "gpt2"));
  // With a trailing slash on the root, and "." inside the path.
  r = ResolveModelDir(root().string() + "/", (root() / "." / "gpt2").string());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, fs::canonical(root() / "gpt2"));
}

TEST_F(ModelRootTest, RefusesAnExistingFolderOutsideLikeAMissingOne) {
  const std::string outside = (base_ / "outside" / "secret").string();
  const std::string missing = (base_ / "outside" / "nothing-here").string();
  const std::string missing_inside = (root() / "nothing-here").string();
  absl::StatusOr<fs::path> a = ResolveModelDir(root(), outside);
  absl::StatusOr<fs::path> b = ResolveModelDir(root(), missing);
  absl::StatusOr<fs::path> c = ResolveModelDir(root(), missing_inside);
  ASSERT_FALSE(a.ok());
  ASSERT_FALSE(b.ok());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(b.status().code(), a.status().code());
  EXPECT_EQ(c.status().code(), a.status().code());
  EXPECT_EQ(Shape(a, outside), Shape(b, missing));
  EXPECT_EQ(Shape(a, outside), Shape(c, missing_inside));
  EXPECT_THAT(std::string(a.status().message()), ::testing::HasSubstr("--model_root"));
}

TEST_F(ModelRootTest, RefusesEscapesThroughDotDotAndSymlinks) {
  EXPECT_FALSE(ResolveModelDir(root(), (root() / ".." / "outside" / "secret").string()).ok());
  EXPECT_FALSE(ResolveModelDir(root(), (root() / "escape" / "secret").string()).ok());
  EXPECT_FALSE(ResolveModelDir(root(), "/").ok());
  EXPECT_FALSE(ResolveModelDir(root(), "").ok());
}

TEST_F(ModelRootTest, ASiblingWithTheRootAsPrefixIsOutside) {
  // "/x/models-old/gpt2" starts with the characters of "/x/models" but is not under it.
  EXPECT_FALSE(ResolveModelDir(root(), (base_ / "models-old" / "gpt2").string()).ok());
}

TEST_F(ModelRootTest, RefusesAFileInsideTheRoot) {
  const fs::path file = root() / "gpt2" / "config.json";
  { std::ofstream(file) << "{}"; }
  EXPECT_FALSE(ResolveModelDir(root(), file.string()).ok());
}

}  // namespace
}  // namespace tandem
