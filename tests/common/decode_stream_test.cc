#include "common/decode_stream.h"

#include <random>
#include <string>
#include <vector>

#include "common/utf8.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

// A decoder as SentencePiece's and Llama-2's tokenizer.json's work: "▁" is a space, the pieces
// <0xNN> are bytes (ill-formed ones shown as U+FFFD), one leading space of the whole text is
// dropped, and id 0 (a special token) shows nothing. `decoded` counts the ids it is given.
struct PieceDecoder {
  std::vector<std::string> pieces = {"",       "\xE2\x96\x81the", "\xE2\x96\x81" "cat", "s",
                                     "<0xE2>", "<0x82>",          "<0xAC>",          "\xE2\x96\x81",
                                     "!",      "\xE2\x96\x81\xE2\x96\x81", "<0x41>", "sat"};
  mutable size_t decoded = 0;
  absl::StatusOr<std::string> operator()(std::span<const int32_t> ids) const {
    decoded += ids.size();
    std::string bytes;
    for (int32_t id : ids) {
      if (id < 0 || id >= static_cast<int32_t>(pieces.size())) {
        return absl::InvalidArgumentError("id " + std::to_string(id) + " is not in the vocabulary");
      }
      const std::string& p = pieces[id];
      if (p.size() == 6 && p.starts_with("<0x")) {
        bytes += static_cast<char>(std::stoi(p.substr(3, 2), nullptr, 16));
        continue;
      }
      for (size_t i = 0; i < p.size();) {
        if (p.compare(i, 3, "\xE2\x96\x81") == 0) {
          bytes += ' ';
          i += 3;
        } else {
          bytes += p[i++];
        }
      }
    }
    std::string text = ToValidUtf8(bytes);
    if (text.starts_with(' ')) text.erase(0, 1);
    return text;
  }
};

TEST(DecodeStream, TextAtEveryIdIsTheWholeDecodeWhileDecodingFewIdsPerCall) {
  PieceDecoder reference;
  auto counting = std::make_shared<PieceDecoder>();
  DecodeStream stream([counting](std::span<const int32_t> ids) { return (*counting)(ids); });
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(reference.pieces.size()) - 1);
  std::vector<int32_t> ids;
  for (int n = 0; n < 2000; ++n) {
    ids.push_back(pick(rng));
    if (n % 50 == 0) {  // a multi-byte character split over three ids
      ids.insert(ids.end(), {4, 5});
      ASSERT_EQ(*stream.Text(ids), *reference(ids)) << "after " << ids.size() << " ids";
      ids.push_back(6);
    }
    auto text = stream.Text(ids);
    ASSERT_TRUE(text.ok()) << text.status();
    ASSERT_EQ(*text, *reference(ids)) << "after " << ids.size() << " ids";
    ASSERT_LE(stream.stable(), text->size());
  }
  // A few ids per call, where decoding the whole list each time would take ~n^2 / 2 of them.
  EXPECT_LT(counting->decoded, 12 * ids.size());
  // The whole list only while its text had no whole character at its end yet (the first ids
  // begin with a character split over three).
  EXPECT_EQ(stream.full_decodes(), 2);
}

TEST(DecodeStream, BytesOfACharacterStayOutOfTheStableTextUntilItIsWhole) {
  PieceDecoder d;
  DecodeStream stream(d);
  std::vector<int32_t> ids = {1, 2};  // " the cat" -> "the cat"
  EXPECT_EQ(*stream.Text(ids), "the cat");
  EXPECT_EQ(stream.stable(), 7u);
  ids.push_back(4);  // E2
  EXPECT_EQ(*stream.Text(ids), "the cat\xEF\xBF\xBD");
  EXPECT_EQ(stream.stable(), 7u);
  ids.push_back(5);  // 82: still one ill-formed sequence
  EXPECT_EQ(*stream.Text(ids), "the cat\xEF\xBF\xBD");
  EXPECT_EQ(stream.stable(), 7u);
  ids.push_back(6);  // AC: the euro sign
  EXPECT_EQ(*stream.Text(ids), "the cat\xE2\x82\xAC");
  EXPECT_EQ(stream.stable(), 10u);
  ids.push_back(3);
  EXPECT_EQ(*stream.Text(ids), "the cat\xE2\x82\xAC" "s");
}

TEST(DecodeStream, ContextThatShowsNothingKeepsTheLeadingSpaceOfWhatFollows) {
  PieceDecoder d;
  DecodeStream stream(d);
  std::vector<int32_t> ids = {1};
  EXPECT_EQ(*stream.Text(ids), "the");
  for (int32_t id : {0, 0, 7, 2, 0, 9, 11}) {  // special ids, a lone space, two spaces
    ids.push_back(id);
    EXPECT_EQ(*stream.Text(ids), *d(ids)) << "after " << ids.size() << " ids";
  }
  EXPECT_EQ(*stream.Text(ids), "the  cat  sat");
}

TEST(DecodeStream, AWindowThatChangesItsContextsTextFallsBackToTheWholeList) {
  // Hugging Face's clean-up of tokenization spaces: " ." becomes ".", across ids.
  size_t calls = 0;
  auto cleanup = [&calls](std::span<const int32_t> ids) -> absl::StatusOr<std::string> {
    ++calls;
    std::string text;
    for (int32_t id : ids) text += id == 1 ? "a" : id == 2 ? " " : ".";
    for (size_t at; (at = text.find(" .")) != std::string::npos;) text.erase(at, 1);
    return text;
  };
  DecodeStream stream(cleanup);
  std::vector<int32_t> ids = {1};
  EXPECT_EQ(*stream.Text(ids), "a");
  ids.push_back(2);
  EXPECT_EQ(*stream.Text(ids), "a ");
  ids.push_back(1);
  EXPECT_EQ(*stream.Text(ids), "a a");
  ids.push_back(2);
  EXPECT_EQ(*stream.Text(ids), "a a ");
  EXPECT_EQ(stream.full_decodes(), 1);
  ids.push_back(3);
  EXPECT_EQ(*stream.Text(ids), "a a.");
  EXPECT_EQ(stream.full_decodes(), 2);
  ids.push_back(1);
  EXPECT_EQ(*stream.Text(ids), "a a.a");
}

TEST(DecodeStream, DecodeErrorsComeBackAndAShorterListStartsOver) {
  PieceDecoder d;
  DecodeStream stream(d);
  std::vector<int32_t> ids = {1, 2, 3};
  EXPECT_EQ(*stream.Text(ids), "the cats");
  ids.push_back(99);
  EXPECT_THAT(stream.Text(ids).status().message(), ::testing::HasSubstr("id 99"));
  const std::vector<int32_t> other = {11, 8};
  EXPECT_EQ(*stream.Text(other), "sat!");
  EXPECT_EQ(*stream.Text(std::vector<int32_t>{}), "");
}

}  // namespace
}  // namespace tandem
