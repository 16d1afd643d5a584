#include "common/structured/token_mask.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::structured {
namespace {

// A small vocabulary: id -> bytes; ids 0 and 1 are special (1 is eos).
Vocabulary SmallVocab() {
  Vocabulary v;
  v.token_bytes = {"", "", "{", "}", "\"", "a", "\":", "{\"", "1", "12", "\xC3", "\xA9",
                   "\xC3\xA9", "\"}", " ", "true", "x\"", ",\""};
  v.special.assign(v.token_bytes.size(), false);
  v.special[0] = v.special[1] = true;
  v.eos_ids = {1};
  return v;
}

std::vector<int32_t> AllowedIds(const TokenMasker& masker, const Matcher& m) {
  const TokenBitmask mask = masker.Mask(m);
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < masker.vocab().size(); ++id) {
    if (Allowed(mask, id)) ids.push_back(id);
  }
  return ids;
}

TEST(TokenMaskTest, StartOfObjectAllowsOnlyOpeners) {
  TokenMasker masker(SmallVocab());
  Matcher m(JsonObjectGrammar());
  EXPECT_EQ(AllowedIds(masker, m), (std::vector<int32_t>{2, 7}));
}

TEST(TokenMaskTest, InsideStringAllowsWholeAndPartialUtf8) {
  TokenMasker masker(SmallVocab());
  auto g = CompileJsonSchema(R"({"type":"object","properties":{"a":{"type":"string"}},"required":["a"]})");
  ASSERT_TRUE(g.ok());
  Matcher m(*g);
  ASSERT_TRUE(masker.Accept(m, 7));  // {"
  EXPECT_EQ(AllowedIds(masker, m), (std::vector<int32_t>{5}));  // only the key's letter
  ASSERT_TRUE(masker.Accept(m, 5));
  ASSERT_TRUE(masker.Accept(m, 6));  // ":
  ASSERT_TRUE(masker.Accept(m, 4));  // "
  // In the string every text token but a lone continuation byte: braces are plain characters
  // there, the lead byte alone may start a character, and tokens that close the string fit.
  EXPECT_EQ(AllowedIds(masker, m),
            (std::vector<int32_t>{2, 3, 4, 5, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17}));
  ASSERT_TRUE(masker.Accept(m, 10));  // a lone lead byte: only its continuation may follow
  EXPECT_EQ(AllowedIds(masker, m), (std::vector<int32_t>{11}));
  ASSERT_TRUE(masker.Accept(m, 11));
  EXPECT_FALSE(masker.Accept(m, 11));  // a continuation byte with no lead
}

TEST(TokenMaskTest, EosOnlyWhenComplete) {
  TokenMasker masker(SmallVocab());
  Matcher m(JsonObjectGrammar());
  ASSERT_TRUE(masker.Accept(m, 7));
  EXPECT_FALSE(Allowed(masker.Mask(m), 1));
  ASSERT_TRUE(masker.Accept(m, 5));
  ASSERT_TRUE(masker.Accept(m, 6));
  ASSERT_TRUE(masker.Accept(m, 9));
  EXPECT_FALSE(Allowed(masker.Mask(m), 1));
  ASSERT_TRUE(masker.Accept(m, 3));
  // The object is closed: only eos, never the other special token.
  EXPECT_EQ(AllowedIds(masker, m), (std::vector<int32_t>{1}));
}

TEST(TokenMaskTest, SpecialTokensAreNeverAccepted) {
  TokenMasker masker(SmallVocab());
  Matcher m(JsonObjectGrammar());
  EXPECT_FALSE(masker.Accept(m, 0));
  EXPECT_FALSE(masker.Accept(m, 1));
}

// A state met again is answered from the cache with the mask a walk gives, and a different state
// (or the same stacks in another grammar) is never answered with another state's mask.
TEST(TokenMaskTest, RepeatedStatesReuseTheirMask) {
  TokenMasker masker(SmallVocab());
  TokenMasker fresh(SmallVocab());
  auto g = CompileJsonSchema(R"({"type":"object","properties":{"a":{"type":"string"}},"required":["a"]})");
  ASSERT_TRUE(g.ok());
  Matcher m(*g);
  for (int32_t token : {7, 5, 6, 4}) ASSERT_TRUE(masker.Accept(m, token));  // {"a":"
  const int64_t before = masker.walks();
  const std::vector<int32_t> in_string = AllowedIds(masker, m);
  EXPECT_EQ(masker.walks(), before + 1);
  // Letters inside a free string leave the state as it was: no new walk, the same mask.
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(masker.Accept(m, 5));
    EXPECT_EQ(AllowedIds(masker, m), in_string);
  }
  EXPECT_EQ(masker.walks(), before + 1);
  ASSERT_TRUE(masker.Accept(m, 4));  // the string closes: a new state, a new walk
  EXPECT_EQ(AllowedIds(masker, m), AllowedIds(fresh, m));
  EXPECT_EQ(masker.walks(), before + 2);
  // Two grammars whose states look alike are told apart by the grammar.
  auto one = CompileChoice({"a"});
  auto other = CompileChoice({"12"});
  ASSERT_TRUE(one.ok() && other.ok());
  Matcher m_one(*one), m_other(*other);
  EXPECT_EQ(AllowedIds(masker, m_one), (std::vector<int32_t>{5}));
  EXPECT_EQ(AllowedIds(masker, m_other), (std::vector<int32_t>{8, 9}));
}

// A string with maxLength counts its code points in the state: at the bound only the quote fits.
TEST(TokenMaskTest, BoundedStringsKeepTheirCount) {
  TokenMasker masker(SmallVocab());
  auto g = CompileJsonSchema(
      R"({"type":"object","properties":{"a":{"type":"string","maxLength":2}},"required":["a"]})");
  ASSERT_TRUE(g.ok());
  Matcher m(*g);
  for (int32_t token : {7, 5, 6, 4}) ASSERT_TRUE(masker.Accept(m, token));  // {"a":"
  const std::vector<int32_t> empty = AllowedIds(masker, m);
  ASSERT_TRUE(masker.Accept(m, 5));
  ASSERT_TRUE(masker.Accept(m, 5));
  EXPECT_NE(AllowedIds(masker, m), empty);
  EXPECT_EQ(AllowedIds(masker, m), (std::vector<int32_t>{4, 13}));  // " and "}
}

}  // namespace
}  // namespace tandem::structured

namespace tandem::structured {
namespace {

// A vocabulary of every string of one to three characters over 30 of JSON's characters (28,830
// tokens): large enough that a walk inside a string is split over threads.
Vocabulary ThreeCharVocab() {
  const std::string alphabet = "{}[]\":, \\abceflnrstu0123456789";
  Vocabulary v;
  v.token_bytes.push_back("");  // the eos id
  for (char a : alphabet) v.token_bytes.push_back(std::string(1, a));
  for (char a : alphabet) {
    for (char b : alphabet) v.token_bytes.push_back(std::string{a, b});
  }
  for (char a : alphabet) {
    for (char b : alphabet) {
      for (char c : alphabet) v.token_bytes.push_back(std::string{a, b, c});
    }
  }
  v.special.assign(v.token_bytes.size(), false);
  v.special[0] = true;
  v.eos_ids = {0};
  return v;
}

// Walked by four threads or by one, every state of seeded random generations under several
// grammars gets the same mask; the walks inside strings are large enough to be split.
TEST(TokenMaskTest, AWalkSplitOverThreadsGivesTheMaskOfOneThread) {
  const TokenMasker serial(ThreeCharVocab(), 1);
  const TokenMasker parallel(ThreeCharVocab(), 4);
  const char* schemas[] = {
      R"({"type":"object","properties":{"name":{"type":"string"},"tags":{"type":"array","items":{"type":"string","maxLength":5}},"n":{"type":"integer"}},"required":["name","tags","n"]})",
      R"({"type":"array","items":{"enum":["a b","c:d","{x}"]}})",
      R"({"type":"object","properties":{"s":{"type":"string","pattern":"^[a-c]{2,6}$"},"f":{"type":"number"},"b":{"type":"boolean"}},"required":["s","f","b"]})",
  };
  std::vector<std::shared_ptr<const Grammar>> grammars = {JsonObjectGrammar()};
  for (const char* schema : schemas) {
    auto g = CompileJsonSchema(schema);
    ASSERT_TRUE(g.ok()) << g.status();
    grammars.push_back(*g);
  }
  uint64_t rng = 7;
  int states = 0, large = 0;
  for (const auto& grammar : grammars) {
    for (int run = 0; run < 3; ++run) {
      Matcher m(grammar);
      for (int step = 0; step < 40 && !m.Finished(); ++step) {
        const TokenBitmask want = serial.Mask(m);
        ASSERT_EQ(parallel.Mask(m), want) << "grammar " << &grammar - grammars.data() << " run "
                                          << run << " step " << step;
        ++states;
        std::vector<int32_t> ids;
        for (int32_t id = 1; id < serial.vocab().size(); ++id) {
          if (Allowed(want, id)) ids.push_back(id);
        }
        large += ids.size() > 10000;
        if (ids.empty()) break;
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        ASSERT_TRUE(serial.Accept(m, ids[(rng >> 33) % ids.size()]));
      }
    }
  }
  EXPECT_GT(states, 100);
  EXPECT_GT(large, 10) << "too few states inside strings to split a walk";
}

}  // namespace
}  // namespace tandem::structured
