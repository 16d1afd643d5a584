// The text a client may see while a generation runs: whole UTF-8 characters and no stop string's
// prefix (the UTF-8 helpers themselves: tests/common/utf8_test.cc).
#include "coordinator/request_stream.h"

#include "gtest/gtest.h"

namespace tandem {
namespace {

TEST(ShowablePrefix, HoldsBackWhatCouldStartAStopString) {
  EXPECT_EQ(ShowablePrefix("hello EN", {"END"}), 6u);
  EXPECT_EQ(ShowablePrefix("hello E", {"END"}), 6u);
  EXPECT_EQ(ShowablePrefix("hello X", {"END"}), 7u);
  EXPECT_EQ(ShowablePrefix("ab\xE2\x82", {"b"}), 2u);
}

}  // namespace
}  // namespace tandem
