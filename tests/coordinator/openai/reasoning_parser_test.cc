#include "coordinator/openai/reasoning_parser.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace tandem::openai {
namespace {

using ::testing::HasSubstr;

// Qwen3's generation prompts as its chat template renders them (tokenizer_config.json of
// Qwen/Qwen3-8B; the real template is checked in reasoning_parser_template_test.sh).
constexpr char kQwen3Thinking[] =
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
constexpr char kQwen3NoThinking[] =
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
// DeepSeek-R1's template (and Qwen3's thinking-only models) open the thought in the prompt.
constexpr char kOpened[] = "<｜User｜>Hi<｜Assistant｜><think>\n";
// A conversation whose earlier assistant turn kept its thought: this turn has none yet.
constexpr char kEarlierThought[] =
    "<|im_start|>assistant\n<think>\na\n</think>\n\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n"
    "<|im_start|>assistant\n";

TEST(ReasoningParserTest, NamesAreVllmsAndAnUnknownOneIsRefusedNamingTheFlag) {
  EXPECT_EQ(*ParseReasoningParserName(""), ReasoningParser::kNone);
  EXPECT_EQ(*ParseReasoningParserName("qwen3"), ReasoningParser::kQwen3);
  EXPECT_EQ(*ParseReasoningParserName("deepseek_r1"), ReasoningParser::kDeepSeekR1);
  const absl::Status bad = ParseReasoningParserName("qwen").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("--reasoning_parser 'qwen'"));
  EXPECT_THAT(bad.message(), HasSubstr("deepseek_r1"));
}

TEST(ReasoningParserTest, ThePromptTellsWhereTheOutputStarts) {
  EXPECT_EQ(PromptThoughtOf(kQwen3Thinking), PromptThought::kMayOpen);
  EXPECT_EQ(PromptThoughtOf(kQwen3NoThinking), PromptThought::kClosed);
  EXPECT_EQ(PromptThoughtOf(kOpened), PromptThought::kOpen);
  EXPECT_EQ(PromptThoughtOf(kEarlierThought), PromptThought::kMayOpen);
}

TEST(ReasoningParserTest, Qwen3ThoughtGoesToReasoningAndTheRestToContent) {
  const PromptThought may = PromptThought::kMayOpen;
  ReasoningSplit s =
      SplitReasoning(ReasoningParser::kQwen3, may, "<think>\nLet me see.\n</think>\n\n42");
  EXPECT_EQ(s.reasoning, "\nLet me see.\n");
  EXPECT_EQ(s.content, "\n\n42");
  // No thought opened at the start: all content, a later tag included.
  s = SplitReasoning(ReasoningParser::kQwen3, may, "42 <think>x</think>");
  EXPECT_EQ(s.reasoning, "");
  EXPECT_EQ(s.content, "42 <think>x</think>");
  // Cut short by max_tokens inside the thought: still reasoning.
  s = SplitReasoning(ReasoningParser::kQwen3, may, "<think>\nhmm");
  EXPECT_EQ(s.reasoning, "\nhmm");
  EXPECT_EQ(s.content, "");
  // Only the first closing tag ends the thought.
  s = SplitReasoning(ReasoningParser::kQwen3, may, "<think>a</think>b</think>c");
  EXPECT_EQ(s.reasoning, "a");
  EXPECT_EQ(s.content, "b</think>c");
}

TEST(ReasoningParserTest, WithThinkingOffTheOutputHasNoReasoning) {
  const ReasoningSplit s = SplitReasoning(ReasoningParser::kQwen3, PromptThoughtOf(kQwen3NoThinking),
                                          "<think>x</think>answer");
  EXPECT_EQ(s.reasoning, "");
  EXPECT_EQ(s.content, "<think>x</think>answer");
}

TEST(ReasoningParserTest, DeepSeekR1AndOpenedPromptsStartInsideTheThought) {
  for (auto [parser, prompt] : {std::pair{ReasoningParser::kDeepSeekR1, PromptThought::kMayOpen},
                                {ReasoningParser::kQwen3, PromptThought::kOpen}}) {
    ReasoningSplit s = SplitReasoning(parser, prompt, "a\n</think>\n\nb");
    EXPECT_EQ(s.reasoning, "a\n");
    EXPECT_EQ(s.content, "\n\nb");
    s = SplitReasoning(parser, prompt, "<think>a</think>b");  // an explicit tag is dropped
    EXPECT_EQ(s.reasoning, "a");
    EXPECT_EQ(s.content, "b");
  }
}

TEST(ReasoningParserTest, WithoutAParserEverythingIsContent) {
  const ReasoningSplit s =
      SplitReasoning(ReasoningParser::kNone, PromptThought::kOpen, "<think>a</think>b");
  EXPECT_EQ(s.reasoning, "");
  EXPECT_EQ(s.content, "<think>a</think>b");
}

// Streamed: pieces joined per side equal the whole text's split, for every cut into two pieces
// and for one byte at a time.
TEST(ReasoningParserTest, AStreamCutAtEveryByteSplitsAsTheWholeText) {
  const std::vector<std::string> texts = {
      "<think>\nLet me see: é ≠ e.\n</think>\n\nLa réponse: 42",
      "<think>a </thinking> </thin b</think>c",
      "<thin not a tag",
      "<think",
      "</think>only content after",
      "plain answer",
      "<think>unfinished </thi",
      "",
  };
  const std::vector<std::pair<ReasoningParser, PromptThought>> modes = {
      {ReasoningParser::kQwen3, PromptThought::kMayOpen},
      {ReasoningParser::kQwen3, PromptThought::kOpen},
      {ReasoningParser::kQwen3, PromptThought::kClosed},
      {ReasoningParser::kDeepSeekR1, PromptThought::kMayOpen},
  };
  for (const auto& mode : modes) {
    const ReasoningParser parser = mode.first;
    const PromptThought prompt = mode.second;
    for (const std::string& text : texts) {
      const ReasoningSplit whole = SplitReasoning(parser, prompt, text);
      auto run = [&](const std::vector<std::string>& pieces) {
        ReasoningSplitter splitter(parser, prompt);
        ReasoningSplit joined;
        for (size_t i = 0; i < pieces.size(); ++i) {
          const ReasoningSplit part = splitter.Next(pieces[i], i + 1 == pieces.size());
          joined.reasoning += part.reasoning;
          joined.content += part.content;
        }
        return joined;
      };
      for (size_t cut = 0; cut <= text.size(); ++cut) {
        const ReasoningSplit two = run({text.substr(0, cut), text.substr(cut)});
        EXPECT_EQ(two.reasoning, whole.reasoning) << text << " cut at " << cut;
        EXPECT_EQ(two.content, whole.content) << text << " cut at " << cut;
      }
      std::vector<std::string> bytes;
      for (char ch : text) bytes.emplace_back(1, ch);
      bytes.emplace_back();  // the end comes as an empty last piece, as a stream's may
      const ReasoningSplit each = run(bytes);
      EXPECT_EQ(each.reasoning, whole.reasoning) << text;
      EXPECT_EQ(each.content, whole.content) << text;
    }
  }
}

TEST(ReasoningParserTest, StreamedDeltasCarryWhatEachPieceHas) {
  EXPECT_EQ(ReasoningDelta({"r", ""}), nlohmann::json({{"reasoning_content", "r"}}));
  EXPECT_EQ(ReasoningDelta({"", "c"}), nlohmann::json({{"content", "c"}}));
  EXPECT_EQ(ReasoningDelta({"r", "c"}), nlohmann::json({{"reasoning_content", "r"}, {"content", "c"}}));
  EXPECT_EQ(ReasoningDelta({"", ""}), nlohmann::json({{"content", ""}}));
}

}  // namespace
}  // namespace tandem::openai
