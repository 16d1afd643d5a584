// The text a client may see while a generation runs: whole UTF-8 characters and no stop string's
// prefix (the UTF-8 helpers themselves: tests/common/utf8_test.cc).
#include "coordinator/request_stream.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "tools/byte_level_bpe.h"

namespace tandem {
namespace {

TEST(ShowablePrefix, HoldsBackWhatCouldStartAStopString) {
  EXPECT_EQ(ShowablePrefix("hello EN", {"END"}), 6u);
  EXPECT_EQ(ShowablePrefix("hello E", {"END"}), 6u);
  EXPECT_EQ(ShowablePrefix("hello X", {"END"}), 7u);
  EXPECT_EQ(ShowablePrefix("ab\xE2\x82", {"b"}), 2u);
}

TEST(ShowablePrefix, HoldsBackATrailingReplacementCharacter) {
  // "t\xC3" decoded: the incomplete character became U+FFFD; the next token may complete it.
  EXPECT_EQ(ShowablePrefix("t\xEF\xBF\xBD", {}), 1u);
  EXPECT_EQ(ShowablePrefix("t\xEF\xBF\xBD\xEF\xBF\xBD", {}), 1u);
  EXPECT_EQ(ShowablePrefix("t\xEF\xBF\xBDx", {}), 5u);  // followed by more: it stays
}

TEST(ShowablePrefix, HoldsBackAPrefixOfAnyOfSeveralStopStrings) {
  EXPECT_EQ(ShowablePrefix("hello E", {"XYZ", "END"}), 6u);
  EXPECT_EQ(ShowablePrefix("hello X", {"XYZ", "END"}), 6u);
  EXPECT_EQ(ShowablePrefix("hello EX", {"END", "EXIT"}), 6u);  // the longer held-back tail wins
}

// A byte-level BPE tokenizer learned from the generator's corpus, as generated checkpoints have.
std::unique_ptr<Tokenizer> CorpusTokenizer() {
  const std::filesystem::path path = std::filesystem::path(::testing::TempDir()) /
                                     absl::StrFormat("request_stream_test-%d.json", getpid());
  std::ofstream(path) << TokenizerJson(TrainByteLevelBpe(TokenizerCorpus(), 400),
                                       "<|endoftext|>", 400);
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromTokenizerJson(path);
  std::filesystem::remove(path);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

// The pieces a stream hands out for `text` token by token, the last call with `done` and the cut
// the stop rules would set.
std::string Streamed(const Tokenizer& tokenizer, const std::string& text,
                     const std::vector<std::string>& stops, int text_limit) {
  const std::vector<int32_t> ids = tokenizer.Encode(text, false).value();
  TextStream stream(&tokenizer, stops);
  std::string out;
  for (size_t k = 1; k <= ids.size(); ++k) {
    const bool done = k == ids.size();
    out += stream.Next(std::span(ids).first(k), done, done ? text_limit : -1);
  }
  EXPECT_EQ(out, stream.shown());
  return out;
}

TEST(TextStream, StreamedTextEndsRightBeforeTheStopString) {
  std::unique_ptr<Tokenizer> tokenizer = CorpusTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  const std::string text = "The river ran past the old mill END";
  const int cut = static_cast<int>(text.find(" END"));
  EXPECT_EQ(Streamed(*tokenizer, text, {" END"}, cut), "The river ran past the old mill");
}

TEST(TextStream, StreamedTextNeverShowsAPrefixOfTheSecondStopString) {
  std::unique_ptr<Tokenizer> tokenizer = CorpusTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  // The generation ends at "mill" (the second stop string); the first never occurs.
  const std::string text = "The river ran past the old mill";
  const int cut = static_cast<int>(text.find("mill"));
  EXPECT_EQ(Streamed(*tokenizer, text, {"never", "mill"}, cut), "The river ran past the old ");
}

// Characters of several bytes split across byte-level tokens come out whole.
TEST(TextStream, WithoutAStopTheStreamedTextIsTheWholeText) {
  std::unique_ptr<Tokenizer> tokenizer = CorpusTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  const std::string text = "Once upon a time, \xC3\xA9t\xC3\xA9 came";
  EXPECT_EQ(Streamed(*tokenizer, text, {}, -1), text);
}

// An EOS id that ended the generation is no part of its text (a constrained output must be
// exactly what its grammar accepted); one that did not end it, or a generation still going on,
// keeps every token.
TEST(TextTokens, LeaveOutTheEosThatEndedTheGeneration) {
  std::unique_ptr<Tokenizer> tokenizer = CorpusTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  std::vector<int32_t> ids = tokenizer->Encode("{\"a\":1}", false).value();
  ids.push_back(400);  // <|endoftext|>
  const auto text = [&](bool done, v1::FinishReason finish) {
    TextStream stream(tokenizer.get(), {});
    return stream.Next(TextTokens(ids, done, finish), done, -1);
  };
  EXPECT_EQ(text(true, v1::FINISH_REASON_EOS), "{\"a\":1}");
  EXPECT_EQ(text(true, v1::FINISH_REASON_LENGTH), "{\"a\":1}<|endoftext|>");
  EXPECT_EQ(TextTokens(ids, false, v1::FINISH_REASON_UNSPECIFIED).size(), ids.size());
  EXPECT_TRUE(TextTokens({}, true, v1::FINISH_REASON_EOS).empty());
}

}  // namespace
}  // namespace tandem
