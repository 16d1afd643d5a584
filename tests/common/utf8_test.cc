// The UTF-8 helpers (common/utf8.h). Expected repairs are Python's bytes.decode("utf-8",
// errors="replace"), which follows the same Unicode practice (one U+FFFD per maximal ill-formed
// subpart).
#include "common/utf8.h"

#include <string>

#include "gtest/gtest.h"

namespace tandem {
namespace {

const std::string kFffd = "\xEF\xBF\xBD";

TEST(ToValidUtf8, KeepsWellFormedTextAndReplacesEachMaximalIllFormedSubpart) {
  EXPECT_EQ(ToValidUtf8("a\xE2\x82\xAC"), "a\xE2\x82\xAC");
  EXPECT_EQ(ToValidUtf8("a\xFF"), "a" + kFffd);
  EXPECT_EQ(ToValidUtf8("\xC0\x80"), kFffd + kFffd);                  // overlong NUL
  EXPECT_EQ(ToValidUtf8("\xED\xA0\x80"), kFffd + kFffd + kFffd);      // surrogate
  EXPECT_EQ(ToValidUtf8("\xE0\x80\xAF"), kFffd + kFffd + kFffd);      // overlong '/'
  EXPECT_EQ(ToValidUtf8("\xF4\x90\x80\x80"), kFffd + kFffd + kFffd + kFffd);  // past U+10FFFF
  // A truncated character is one subpart, however many of its bytes are there.
  EXPECT_EQ(ToValidUtf8("a\xE2\x82"), "a" + kFffd);
  EXPECT_EQ(ToValidUtf8("\xE2\x82x"), kFffd + "x");
  EXPECT_EQ(ToValidUtf8("\xF0\x9F\x98"), kFffd);
}

TEST(IsValidUtf8, AcceptsOnlyWellFormedText) {
  EXPECT_TRUE(IsValidUtf8(""));
  EXPECT_TRUE(IsValidUtf8("h\xC3\xA9 \xF0\x9F\x98\x80"));
  EXPECT_FALSE(IsValidUtf8("\xC3"));
  EXPECT_FALSE(IsValidUtf8("\xED\xA0\x80"));
}

TEST(FirstInvalidUtf8, PointsAtTheFirstIllFormedByte) {
  EXPECT_EQ(FirstInvalidUtf8(""), 0u);
  EXPECT_EQ(FirstInvalidUtf8("h\xC3\xA9 \xF0\x9F\x98\x80"), 8u);  // well-formed: the size
  EXPECT_EQ(FirstInvalidUtf8("abc\xFF"), 3u);
  EXPECT_EQ(FirstInvalidUtf8("h\xC3\xA9\xC3"), 3u);      // a truncated character at the end
  EXPECT_EQ(FirstInvalidUtf8("ab\xED\xA0\x80z"), 2u);    // a surrogate
  EXPECT_EQ(FirstInvalidUtf8("\xE2\x82\xAC\x80"), 3u);  // a stray continuation byte
}

TEST(CheckUtf8, NamesTheFieldTheOffsetAndTheByte) {
  EXPECT_TRUE(CheckUtf8("prompt", "h\xC3\xA9").ok());
  const absl::Status s = CheckUtf8("stop[1]", "ab\xE2\x82\xAC\x80z");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "stop[1]: not valid UTF-8: byte 5 (0x80) does not begin a well-formed character");
}

TEST(AppendUtf8, EncodesWhatDecodeUtf8Reads) {
  for (char32_t cp : {U'A', U'\u00E9', U'\u20AC', U'\U0001F600', U'\U0010FFFF'}) {
    std::string s;
    AppendUtf8(cp, s);
    const auto [decoded, len] = DecodeUtf8(s);
    EXPECT_EQ(decoded, cp);
    EXPECT_EQ(len, static_cast<int>(s.size()));
  }
  std::string euro;
  AppendUtf8(0x20AC, euro);
  EXPECT_EQ(euro, "\xE2\x82\xAC");
}

TEST(CountCodePoints, CountsCharactersNotBytes) {
  EXPECT_EQ(CountCodePoints(""), 0u);
  EXPECT_EQ(CountCodePoints("h\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80"), 4u);
}

TEST(CompleteUtf8Prefix, HoldsBackAnIncompleteCharacter) {
  EXPECT_EQ(CompleteUtf8Prefix("ab"), 2u);
  EXPECT_EQ(CompleteUtf8Prefix("a\xE2\x82"), 1u);      // first two bytes of the euro sign
  EXPECT_EQ(CompleteUtf8Prefix("a\xE2\x82\xAC"), 4u);  // all of it
  EXPECT_EQ(CompleteUtf8Prefix("\xF0\x9F\x98"), 0u);   // three bytes of an emoji
}

}  // namespace
}  // namespace tandem
