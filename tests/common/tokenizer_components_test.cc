// Tests for the parts of common/tokenizer/ one by one (normalizer, pre-tokenizer, BPE model,
// added tokens, post-processor, decoder), each against what Hugging Face's tokenizers does with
// the same tokenizer.json section, and the refusal of what is not implemented.
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "common/tokenizer/added_tokens.h"
#include "common/tokenizer/bpe.h"
#include "common/tokenizer/decoder.h"
#include "common/tokenizer/normalizer.h"
#include "common/tokenizer/post_processor.h"
#include "common/tokenizer/pre_tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::tokenizer {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using json = nlohmann::json;

std::string Normalize(const json& j, std::string text) {
  auto n = Normalizer::FromJson(j, "normalizer");
  EXPECT_TRUE(n.ok()) << n.status();
  RegexBudget budget = RegexBudget::ForText(text.size());
  if (n.ok()) {
    EXPECT_TRUE((*n)->Apply(text, budget).ok());
  }
  return text;
}

std::vector<std::string> PreTokenize(const json& j, const std::string& text) {
  auto p = PreTokenizer::FromJson(j, "pre_tokenizer");
  EXPECT_TRUE(p.ok()) << p.status();
  std::vector<Piece> pieces = {{text, true}};
  RegexBudget budget = RegexBudget::ForText(text.size());
  if (p.ok()) {
    EXPECT_TRUE((*p)->Apply(pieces, budget).ok());
  }
  std::vector<std::string> out;
  for (const Piece& piece : pieces) out.push_back(piece.text);
  return out;
}

std::string DecodeTokens(const json& j, std::vector<std::string> tokens) {
  auto d = Decoder::FromJson(j, "decoder");
  EXPECT_TRUE(d.ok()) << d.status();
  if (!d.ok()) return "";
  absl::StatusOr<std::string> text = (*d)->Decode(std::move(tokens));
  EXPECT_TRUE(text.ok()) << text.status();
  return text.ok() ? *text : "";
}

std::vector<int32_t> Bpe(const json& model, const std::string& piece) {
  auto m = BpeModel::FromJson(model, "tokenizer.json");
  EXPECT_TRUE(m.ok()) << m.status();
  std::vector<int32_t> ids;
  if (m.ok()) (*m)->Tokenize(piece, ids);
  return ids;
}

json Model(json vocab, json merges = json::array()) {
  return {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}};
}

// Expects `status` to be UNIMPLEMENTED with a message holding every one of `names`.
template <typename T>
void ExpectRefused(const absl::StatusOr<T>& result, std::vector<std::string> names) {
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kUnimplemented) << result.status();
  for (const std::string& name : names) {
    EXPECT_THAT(result.status().message(), HasSubstr(name));
  }
}

// Normalizers.

TEST(TokenizerNormalizer, UnicodeFormsLowercaseStripPrependReplace) {
  EXPECT_EQ(Normalize({{"type", "NFC"}}, "e\xCC\x81"), "\xC3\xA9");
  EXPECT_EQ(Normalize({{"type", "NFD"}}, "\xC3\xA9"), "e\xCC\x81");
  EXPECT_EQ(Normalize({{"type", "NFKC"}}, "\xEF\xAC\x81 \xE2\x91\xA0"), "fi 1");  // ﬁ ①
  // Each character on its own: İ -> i + combining dot, a final Σ -> σ.
  EXPECT_EQ(Normalize({{"type", "Lowercase"}}, "AB\xC4\xB0 \xCE\xA3"), "abi\xCC\x87 \xCF\x83");
  EXPECT_EQ(Normalize({{"type", "Strip"}, {"strip_left", true}, {"strip_right", false}},
                      " \t\xE3\x80\x80x "),
            "x ");
  EXPECT_EQ(Normalize({{"type", "Prepend"}, {"prepend", "\xE2\x96\x81"}}, "a"), "\xE2\x96\x81" "a");
  EXPECT_EQ(Normalize({{"type", "Prepend"}, {"prepend", "\xE2\x96\x81"}}, ""), "");
  EXPECT_EQ(Normalize({{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "_"}},
                      "a b  c"),
            "a_b__c");
  EXPECT_EQ(Normalize({{"type", "Replace"}, {"pattern", {{"Regex", "\\s+"}}}, {"content", " "}},
                      "a \t\xC2\x85 b"),
            "a b");
  EXPECT_EQ(Normalize({{"type", "Sequence"},
                       {"normalizers",
                        {{{"type", "Prepend"}, {"prepend", "_"}},
                         {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "_"}}}}},
                      "a b"),
            "_a_b");
}

// Pre-tokenizers.

TEST(TokenizerPreTokenizer, SplitBehaviors) {
  auto split = [](const char* behavior) {
    return PreTokenize({{"type", "Split"},
                        {"pattern", {{"String", "-"}}},
                        {"behavior", behavior},
                        {"invert", false}},
                       "a-b--c");
  };
  EXPECT_THAT(split("Removed"), ElementsAre("a", "b", "c"));
  EXPECT_THAT(split("Isolated"), ElementsAre("a", "-", "b", "-", "-", "c"));
  EXPECT_THAT(split("MergedWithPrevious"), ElementsAre("a-", "b-", "-", "c"));
  EXPECT_THAT(split("MergedWithNext"), ElementsAre("a", "-b", "-", "-c"));
  EXPECT_THAT(split("Contiguous"), ElementsAre("a", "-", "b", "--", "c"));
  // invert: the non-matching parts are what gets removed.
  EXPECT_THAT(PreTokenize({{"type", "Split"},
                           {"pattern", {{"Regex", "[a-z]+"}}},
                           {"behavior", "Removed"},
                           {"invert", true}},
                          "ab, cd!"),
              ElementsAre("ab", "cd"));
}

TEST(TokenizerPreTokenizer, Llama3PatternMatchesOniguruma) {
  const json llama3 = {
      {"type", "Split"},
      {"pattern",
       {{"Regex",
         "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
         "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}}},
      {"behavior", "Isolated"},
      {"invert", false}};
  EXPECT_THAT(PreTokenize(llama3, "12345 (hello"), ElementsAre("123", "45", " (", "hello"));
  EXPECT_THAT(PreTokenize(llama3, "IT'S it's"), ElementsAre("IT", "'S", " it", "'s"));
  // \s is White_Space: U+0085 is a space here, as in Oniguruma.
  EXPECT_THAT(PreTokenize(llama3, "a\xC2\x85\xC2\x85" "b"), ElementsAre("a", "\xC2\x85", "\xC2\x85" "b"));
  EXPECT_THAT(PreTokenize(llama3, "x   y\n\n z"), ElementsAre("x", "  ", " y", "\n\n", " z"));
}

TEST(TokenizerPreTokenizer, ByteLevelMetaspaceDigitsWhitespacePunctuation) {
  // ByteLevel: GPT-2's pattern, then bytes in GPT-2's alphabet (space is U+0120).
  EXPECT_THAT(PreTokenize({{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}},
                          "Hi you"),
              ElementsAre("\xC4\xA0Hi", "\xC4\xA0you"));
  EXPECT_THAT(PreTokenize({{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}},
                          "Hi you"),
              ElementsAre("Hi\xC4\xA0you"));
  const std::string m = "\xE2\x96\x81";
  EXPECT_THAT(PreTokenize({{"type", "Metaspace"}, {"replacement", m}, {"prepend_scheme", "always"}},
                          "a b"),
              ElementsAre(m + "a", m + "b"));
  EXPECT_THAT(PreTokenize({{"type", "Metaspace"}, {"replacement", m}, {"prepend_scheme", "never"},
                           {"split", false}},
                          "a b"),
              ElementsAre("a" + m + "b"));
  EXPECT_THAT(PreTokenize({{"type", "Digits"}, {"individual_digits", true}}, "a123"),
              ElementsAre("a", "1", "2", "3"));
  EXPECT_THAT(PreTokenize({{"type", "Digits"}, {"individual_digits", false}}, "a123b"),
              ElementsAre("a", "123", "b"));
  EXPECT_THAT(PreTokenize({{"type", "Whitespace"}}, "Hey,  you!"), ElementsAre("Hey", ",", "you", "!"));
  EXPECT_THAT(PreTokenize({{"type", "WhitespaceSplit"}}, "Hey,  you!"), ElementsAre("Hey,", "you!"));
  EXPECT_THAT(PreTokenize({{"type", "Punctuation"}}, "a,b"), ElementsAre("a", ",", "b"));
}

// The BPE model.

TEST(TokenizerBpe, ByteFallbackSpellsUnknownCharactersAsBytes) {
  const json model = {{"type", "BPE"},
                      {"byte_fallback", true},
                      {"unk_token", "<unk>"},
                      {"vocab", {{"<unk>", 0}, {"a", 1}, {"<0xC3>", 2}, {"<0xA9>", 3}}},
                      {"merges", json::array()}};
  EXPECT_THAT(Bpe(model, "a\xC3\xA9"), ElementsAre(1, 2, 3));    // é: both bytes have tokens
  EXPECT_THAT(Bpe(model, "a\xC3\x9F"), ElementsAre(1, 0));       // ß: <0x9F> missing -> unk
}

TEST(TokenizerBpe, UnknownCharactersFuseOrNotOrVanish) {
  json model = Model({{"<unk>", 0}, {"a", 1}});
  model["unk_token"] = "<unk>";
  model["fuse_unk"] = true;
  EXPECT_THAT(Bpe(model, "xya"), ElementsAre(0, 1));
  model["fuse_unk"] = false;
  EXPECT_THAT(Bpe(model, "xya"), ElementsAre(0, 0, 1));
  model.erase("unk_token");
  EXPECT_THAT(Bpe(model, "xya"), ElementsAre(1));
}

TEST(TokenizerBpe, IgnoreMergesTakesAWholeTokenFirst) {
  json model = Model({{"a", 0}, {"b", 1}, {"c", 2}, {"ab", 3}, {"abc", 4}}, {"a b"});
  EXPECT_THAT(Bpe(model, "abc"), ElementsAre(3, 2));
  model["ignore_merges"] = true;
  EXPECT_THAT(Bpe(model, "abc"), ElementsAre(4));
  EXPECT_THAT(Bpe(model, "abcc"), ElementsAre(3, 2, 2));
}

TEST(TokenizerBpe, MergesOneAtATimeByRankThenPosition) {
  // "aaa": the leftmost pair merges first; "aab" with b-merge ranked first merges the right pair.
  EXPECT_THAT(Bpe(Model({{"a", 0}, {"aa", 1}}, {"a a"}), "aaa"), ElementsAre(1, 0));
  EXPECT_THAT(Bpe(Model({{"a", 0}, {"b", 1}, {"aa", 2}, {"ab", 3}}, {"a b", "a a"}), "aab"),
              ElementsAre(0, 3));
}

TEST(TokenizerBpe, SubwordPrefixAndWordSuffix) {
  json prefixed = Model({{"a", 0}, {"##b", 1}, {"ab", 2}}, json::array());
  prefixed["continuing_subword_prefix"] = "##";
  EXPECT_THAT(Bpe(prefixed, "ab"), ElementsAre(0, 1));
  prefixed["merges"] = {"a ##b"};
  EXPECT_THAT(Bpe(prefixed, "ab"), ElementsAre(2));
  json suffixed = Model({{"a", 0}, {"b</w>", 1}});
  suffixed["end_of_word_suffix"] = "</w>";
  EXPECT_THAT(Bpe(suffixed, "ab"), ElementsAre(0, 1));
}

// Added tokens.

// The tokens as a list: an initializer list, since a braced single json would be copied, not
// wrapped in an array, by some compilers (clang).
AddedVocabulary Added(std::initializer_list<json> tokens, const Normalizer* normalizer = nullptr) {
  json list = json::array();
  for (const json& token : tokens) list.push_back(token);
  auto v = AddedVocabulary::FromJson(list, "tokenizer.json", normalizer);
  EXPECT_TRUE(v.ok()) << v.status();
  return v.ok() ? std::move(*v) : AddedVocabulary();
}

json Token(const std::string& content, int id, bool lstrip, bool rstrip, bool single_word,
           bool normalized = false) {
  return {{"id", id},         {"content", content},       {"special", true},
          {"lstrip", lstrip}, {"rstrip", rstrip},         {"single_word", single_word},
          {"normalized", normalized}};
}

// "text|<id>|text" for the segments of a split.
std::string Segments(const AddedVocabulary& v, const std::string& text, bool normalized = false) {
  std::string out;
  for (const Segment& s : v.Split(text, normalized)) {
    if (!out.empty()) out += "|";
    out += s.id ? "<" + std::to_string(*s.id) + ">" : std::string(s.text);
  }
  return out;
}

TEST(TokenizerAddedTokens, LstripRstripTakeTheWhitespaceNextToThem) {
  EXPECT_EQ(Segments(Added({Token("<m>", 9, false, false, false)}), "x  <m>  y"), "x  |<9>|  y");
  EXPECT_EQ(Segments(Added({Token("<m>", 9, true, false, false)}), "x \t<m>  y"), "x|<9>|  y");
  EXPECT_EQ(Segments(Added({Token("<m>", 9, false, true, false)}), "x  <m> \n y"), "x  |<9>|y");
  // Whitespace an earlier match took stays with it.
  EXPECT_EQ(Segments(Added({Token("<m>", 9, true, true, false)}), "<m>  <m>"), "<9>|<9>");
}

TEST(TokenizerAddedTokens, SingleWordMatchesOnlyBetweenNonWordCharacters) {
  const AddedVocabulary v = Added({Token("ab", 7, false, false, true)});
  EXPECT_EQ(Segments(v, "ab cab ab! _ab \xC3\xA9" "ab"), "<7>| cab |<7>|! _ab \xC3\xA9" "ab");
}

TEST(TokenizerAddedTokens, LeftmostLongestAndNormalizedForms) {
  const AddedVocabulary v =
      Added({Token("<a>", 1, false, false, false), Token("<a><b>", 2, false, false, false)});
  EXPECT_EQ(Segments(v, "x<a><b><a>"), "x|<2>|<1>");
  // A normalized token is matched by its normalized form in normalized text only.
  auto lower = Normalizer::FromJson({{"type", "Lowercase"}}, "normalizer");
  ASSERT_TRUE(lower.ok());
  const AddedVocabulary n = Added({Token("<M>", 3, false, false, false, true)}, lower->get());
  EXPECT_EQ(Segments(n, "a<m>b", true), "a|<3>|b");
  EXPECT_EQ(Segments(n, "a<M>b", false), "a<M>b");
  EXPECT_EQ(*n.IdToText(3), "<m>");
}

// Post-processors and decoders.

TEST(TokenizerPostProcessor, TemplateAndSequenceWrapTheText) {
  const json bos_template = {
      {"type", "TemplateProcessing"},
      {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                  {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                  {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}}},
      {"pair", json::array()},
      {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}},
                          {"</s>", {{"id", "</s>"}, {"ids", {2}}, {"tokens", {"</s>"}}}}}}};
  auto p = PostProcessor::FromJson(
      {{"type", "Sequence"},
       {"processors", {{{"type", "ByteLevel"}, {"add_prefix_space", true}}, bos_template}}},
      "post_processor");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(p->prefix, ElementsAre(1));
  EXPECT_THAT(p->suffix, ElementsAre(2));
  auto roberta = PostProcessor::FromJson(
      {{"type", "RobertaProcessing"}, {"cls", {"<s>", 0}}, {"sep", {"</s>", 2}}}, "post_processor");
  ASSERT_TRUE(roberta.ok()) << roberta.status();
  EXPECT_THAT(roberta->prefix, ElementsAre(0));
  EXPECT_THAT(roberta->suffix, ElementsAre(2));
}

// A template's special token whose entry in special_tokens has no "ids" array (or is not an
// object) is refused by name; looking the key up unchecked read past the entry.
TEST(TokenizerPostProcessor, SpecialTokenEntryWithoutIdsIsRefused) {
  for (const json& entry : {json{{"id", "<s>"}, {"idS", {1}}, {"tokens", {"<s>"}}},
                            json{{"id", "<s>"}, {"ids", 1}}, json(7), json::array()}) {
    SCOPED_TRACE(entry.dump());
    auto p = PostProcessor::FromJson(
        {{"type", "TemplateProcessing"},
         {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                     {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
         {"pair", json::array()},
         {"special_tokens", {{"<s>", entry}}}},
        "post_processor");
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
    EXPECT_THAT(p.status().message(), HasSubstr(".special_tokens.<s>.ids must be an array"));
  }
}

TEST(TokenizerDecoder, Llama2ChainByteLevelAndMetaspace) {
  const std::string m = "\xE2\x96\x81";
  const json llama2 = {
      {"type", "Sequence"},
      {"decoders",
       {{{"type", "Replace"}, {"pattern", {{"String", m}}}, {"content", " "}},
        {{"type", "ByteFallback"}},
        {{"type", "Fuse"}},
        {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  EXPECT_EQ(DecodeTokens(llama2, {m + "Hello", m + "w", "<0xC3>", "<0xA9>", "!"}), "Hello w\xC3\xA9!");
  // Bytes that are not UTF-8 give one U+FFFD each.
  EXPECT_EQ(DecodeTokens(llama2, {"a", "<0xC3>", "<0x41>"}), "a\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(DecodeTokens({{"type", "Metaspace"}, {"replacement", m}, {"prepend_scheme", "always"}},
                         {m + "a", m + "b"}),
            "a b");
  // ByteLevel: U+0120 is a space; a lone lead byte becomes U+FFFD.
  EXPECT_EQ(DecodeTokens({{"type", "ByteLevel"}}, {"Hi", "\xC4\xA0you", "\xC3\x83"}),
            "Hi you\xEF\xBF\xBD");
}

// What is not implemented is refused with its name.

TEST(TokenizerRefusal, UnknownComponentsAndOptionsAreNamed) {
  ExpectRefused(Normalizer::FromJson({{"type", "BertNormalizer"}}, "normalizer"),
                {"normalizer", "BertNormalizer"});
  ExpectRefused(Normalizer::FromJson({{"type", "Sequence"},
                                      {"normalizers", {{{"type", "NFC"}}, {{"type", "Precompiled"}}}}},
                                     "normalizer"),
                {"normalizer.normalizers[1]", "Precompiled"});
  ExpectRefused(PreTokenizer::FromJson({{"type", "CharDelimiterSplit"}}, "pre_tokenizer"),
                {"CharDelimiterSplit"});
  ExpectRefused(PreTokenizer::FromJson({{"type", "Metaspace"},
                                        {"replacement", "_"},
                                        {"prepend_scheme", "sometimes"}},
                                       "pre_tokenizer"),
                {"prepend_scheme \"sometimes\""});
  ExpectRefused(PreTokenizer::FromJson({{"type", "ByteLevel"}, {"add_prefix_space", true}, {"frobnicate", 1}},
                                       "pre_tokenizer"),
                {"field \"frobnicate\""});
  ExpectRefused(Decoder::FromJson({{"type", "WordPiece"}}, "decoder"), {"WordPiece"});
  ExpectRefused(PostProcessor::FromJson({{"type", "Custom"}}, "post_processor"), {"Custom"});
  json dropout = Model({{"a", 0}});
  dropout["dropout"] = 0.1;
  ExpectRefused(BpeModel::FromJson(dropout, "tokenizer.json"), {"dropout"});
  json unigram = Model({{"a", 0}});
  unigram["type"] = "Unigram";
  ExpectRefused(BpeModel::FromJson(unigram, "tokenizer.json"), {"Unigram"});
  // A regex escape whose meaning differs between Oniguruma and ICU (\h: hex digit vs. space).
  auto hex = PreTokenizer::FromJson(
      {{"type", "Split"}, {"pattern", {{"Regex", "\\h+"}}}, {"behavior", "Isolated"}, {"invert", false}},
      "pre_tokenizer");
  ASSERT_FALSE(hex.ok());
  EXPECT_THAT(hex.status().message(), AllOf(HasSubstr("\\h"), HasSubstr("pre_tokenizer")));
}

}  // namespace
}  // namespace tandem::tokenizer
