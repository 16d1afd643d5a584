// The text a client may see while a generation runs: whole UTF-8 characters, no stop string's
// prefix, and well-formed UTF-8 only.
#include "coordinator/request_stream.h"

#include "gtest/gtest.h"

namespace tandem {
namespace {

TEST(CompleteUtf8Prefix, HoldsBackAnIncompleteCharacter) {
  EXPECT_EQ(CompleteUtf8Prefix("ab"), 2u);
  EXPECT_EQ(CompleteUtf8Prefix("a\xE2\x82"), 1u);       // first two bytes of the euro sign
  EXPECT_EQ(CompleteUtf8Prefix("a\xE2\x82\xAC"), 4u);   // all of it
  EXPECT_EQ(CompleteUtf8Prefix("\xF0\x9F\x98"), 0u);    // three bytes of an emoji
}

TEST(ShowablePrefix, HoldsBackWhatCouldStartAStopString) {
  EXPECT_EQ(ShowablePrefix("hello EN", {"END"}), 6u);
  EXPECT_EQ(ShowablePrefix("hello E", {"END"}), 6u);
  EXPECT_EQ(ShowablePrefix("hello X", {"END"}), 7u);
  EXPECT_EQ(ShowablePrefix("ab\xE2\x82", {"b"}), 2u);
}

TEST(SanitizeUtf8, ReplacesEveryMalformedByte) {
  EXPECT_EQ(SanitizeUtf8("a\xE2\x82\xAC"), "a\xE2\x82\xAC");
  EXPECT_EQ(SanitizeUtf8("a\xFF"), "a\xEF\xBF\xBD");
  EXPECT_EQ(SanitizeUtf8("\xC0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong NUL
  EXPECT_EQ(SanitizeUtf8("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
}

}  // namespace
}  // namespace tandem
