// Tests for common/text_config: which of tokenizer_config.json, generation_config.json and
// config.json gives BOS/EOS, add_bos_token, the chat template and the length limit, and the
// errors for malformed files.
#include "common/text_config.h"

#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using json = nlohmann::json;

fs::path TestDir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path dir = fs::path(TANDEM_TEST_TMPDIR) / "text_config_test_files" / info->name();
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void Write(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

ModelConfig Model() {
  ModelConfig m;
  m.vocab_size = 1000;
  return m;
}

// A tokenizer with <s> (2) and </s> (3) whose post-processor puts <s> first when `bos_template`.
std::unique_ptr<Tokenizer> SmallTokenizer(const fs::path& dir, bool bos_template) {
  json tok = {{"model", {{"type", "BPE"}, {"vocab", {{"a", 0}, {"b", 1}}}, {"merges", json::array()}}},
              {"added_tokens",
               {{{"id", 2}, {"content", "<s>"}, {"special", true}},
                {{"id", 3}, {"content", "</s>"}, {"special", true}}}}};
  if (bos_template) {
    tok["post_processor"] = {
        {"type", "TemplateProcessing"},
        {"single", {{{"SpecialToken", {{"id", "<s>"}}}}, {{"Sequence", {{"id", "A"}}}}}},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {2}}, {"tokens", {"<s>"}}}}}}};
  }
  Write(dir / "tokenizer.json", tok.dump());
  auto t = Tokenizer::FromTokenizerJson(dir / "tokenizer.json");
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

TEST(TextConfigTest, GenerationConfigListsEveryEosIdAndWins) {
  const fs::path dir = TestDir();
  Write(dir / "config.json", json({{"bos_token_id", 1}, {"eos_token_id", 3}}).dump());
  Write(dir / "generation_config.json",
        json({{"bos_token_id", 2}, {"eos_token_id", {5, 7}}, {"max_length", 4096}}).dump());
  auto text = LoadTextConfig(dir, Model(), nullptr);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(text->bos_token_id, 2);
  EXPECT_THAT(text->eos_token_ids, ElementsAre(5, 7));
  EXPECT_EQ(text->max_length, 4096);
}

TEST(TextConfigTest, ConfigJsonEosListWithoutGenerationConfig) {
  const fs::path dir = TestDir();
  Write(dir / "config.json", json({{"eos_token_id", {3, 4}}}).dump());
  auto text = LoadTextConfig(dir, Model(), nullptr);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_THAT(text->eos_token_ids, ElementsAre(3, 4));
  EXPECT_FALSE(text->bos_token_id.has_value());
  EXPECT_FALSE(text->max_length.has_value());
}

TEST(TextConfigTest, TokenStringsGiveIdsThroughTheTokenizerAndBosFollowsItsTemplate) {
  const fs::path dir = TestDir();
  Write(dir / "tokenizer_config.json",
        json({{"bos_token", "<s>"},
              {"eos_token", {{"content", "</s>"}, {"lstrip", false}}},
              {"model_max_length", 1e30},
              {"add_bos_token", false},
              {"chat_template", "{{ bos_token }}{{ messages }}"}})
            .dump());
  auto with_template = SmallTokenizer(dir, true);
  auto text = LoadTextConfig(dir, Model(), with_template.get());
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(text->bos_token, "<s>");
  EXPECT_EQ(text->eos_token, "</s>");
  EXPECT_EQ(text->bos_token_id, 2);
  EXPECT_THAT(text->eos_token_ids, ElementsAre(3));
  // What the tokenizer does decides, not the config's flag.
  EXPECT_TRUE(text->add_bos_token);
  EXPECT_EQ(text->chat_template, "{{ bos_token }}{{ messages }}");
  EXPECT_FALSE(text->max_length.has_value());  // 1e30 means no limit
  auto without_template = SmallTokenizer(dir, false);
  text = LoadTextConfig(dir, Model(), without_template.get());
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_FALSE(text->add_bos_token);
}

TEST(TextConfigTest, ChatTemplateFromAListOrAFile) {
  const fs::path dir = TestDir();
  Write(dir / "tokenizer_config.json",
        json({{"chat_template",
               {{{"name", "tool_use"}, {"template", "T"}}, {{"name", "default"}, {"template", "D"}}}}})
            .dump());
  auto text = LoadTextConfig(dir, Model(), nullptr);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(text->chat_template, "D");
  Write(dir / "tokenizer_config.json", "{}");
  Write(dir / "chat_template.jinja", "J");
  text = LoadTextConfig(dir, Model(), nullptr);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(text->chat_template, "J");
}

TEST(TextConfigTest, MalformedFilesAndIdsAreNamed) {
  const fs::path dir = TestDir();
  Write(dir / "generation_config.json", "{\"eos_token_id\": ");
  auto text = LoadTextConfig(dir, Model(), nullptr);
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(text.status().message(), HasSubstr("generation_config.json: not valid JSON"));
  Write(dir / "generation_config.json", json({{"eos_token_id", "x"}}).dump());
  text = LoadTextConfig(dir, Model(), nullptr);
  EXPECT_THAT(text.status().message(), HasSubstr("generation_config.json: eos_token_id must be"));
  Write(dir / "generation_config.json", json({{"eos_token_id", {5, 1000}}}).dump());
  text = LoadTextConfig(dir, Model(), nullptr);
  EXPECT_THAT(text.status().message(), HasSubstr("eos_token_id 1000 is outside the vocabulary"));
  Write(dir / "generation_config.json", "{}");
  Write(dir / "tokenizer_config.json", json({{"bos_token", 5}}).dump());
  text = LoadTextConfig(dir, Model(), nullptr);
  EXPECT_THAT(text.status().message(), HasSubstr("tokenizer_config.json: bos_token must be"));
}

}  // namespace
}  // namespace tandem
