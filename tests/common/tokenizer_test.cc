// Tests for common/tokenizer on small hand-made vocabularies: merge order, GPT-2's pre-token
// boundaries, added tokens, round trips, decode errors and every kind of malformed file.
#include "common/tokenizer.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

using Merge = std::pair<std::string, std::string>;  // raw bytes, not GPT-2's spelling

// A fresh, empty folder per test.
fs::path TestDir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path dir = fs::path(TANDEM_TEST_TMPDIR) / "tokenizer_test_files" /
                 (std::string(info->test_suite_name()) + "." + info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void WriteText(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

// GPT-2's bytes_to_unicode, spelled out independently of the code under test: bytes '!'..'~',
// 0xA1..0xAC, 0xAE..0xFF are themselves, the rest are U+0100.. in byte order.
std::string Spell(std::string_view bytes) {
  std::string out;
  for (unsigned char b : bytes) {
    char32_t cp = b;
    if (!((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)) {
      cp = 0x100;
      for (int x = 0; x < b; ++x) {
        if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE)) ++cp;
      }
    }
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else {
      out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }
  return out;
}

// A vocabulary of the 256 bytes (id = byte value) plus every token the merges name or make, in
// order of first appearance.
struct Vocab {
  std::map<std::string, int> ids;  // spelled token -> id
  int next = 0;
  int Add(const std::string& bytes) {
    auto [it, inserted] = ids.emplace(Spell(bytes), next);
    if (inserted) ++next;
    return it->second;
  }
};

Vocab MakeVocab(const std::vector<Merge>& merges) {
  Vocab v;
  for (int b = 0; b < 256; ++b) v.Add(std::string(1, static_cast<char>(b)));
  for (const auto& [l, r] : merges) {
    v.Add(l);
    v.Add(r);
    v.Add(l + r);
  }
  return v;
}

nlohmann::json TokenizerJson(const std::vector<Merge>& merges) {
  Vocab v = MakeVocab(merges);
  nlohmann::json vocab = nlohmann::json::object();
  for (const auto& [text, id] : v.ids) vocab[text] = id;
  nlohmann::json merge_list = nlohmann::json::array();
  for (const auto& [l, r] : merges) merge_list.push_back(Spell(l) + " " + Spell(r));
  // GPT-2's tokenizer.json sections: byte-level pre-tokenizer with GPT-2's pattern and decoder.
  const nlohmann::json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  return {{"version", "1.0"},
          {"added_tokens", nlohmann::json::array()},
          {"pre_tokenizer", byte_level},
          {"decoder", byte_level},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}}}};
}

std::unique_ptr<Tokenizer> LoadJson(const nlohmann::json& json) {
  const fs::path path = TestDir() / "tokenizer.json";
  WriteText(path, json.dump());
  auto tok = Tokenizer::FromTokenizerJson(path);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? std::move(tok).value() : nullptr;
}

// GPT-2's own files (vocab.json + merges.txt) for `merges`: GPT-2's encoder's semantics.
std::unique_ptr<Tokenizer> Load(const std::vector<Merge>& merges) {
  const fs::path dir = TestDir();
  WriteText(dir / "vocab.json", nlohmann::json(MakeVocab(merges).ids).dump());
  std::string merges_txt = "#version: 0.2\n";
  for (const auto& [l, r] : merges) merges_txt += Spell(l) + " " + Spell(r) + "\n";
  WriteText(dir / "merges.txt", merges_txt);
  auto tok = Tokenizer::FromVocabAndMerges(dir / "vocab.json", dir / "merges.txt");
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? std::move(tok).value() : nullptr;
}

// The bytes of each token Encode produces, to show where tokens begin and end.
std::vector<std::string> Pieces(const Tokenizer& tok, std::string_view text) {
  std::vector<std::string> out;
  const std::vector<int32_t> ids = tok.Encode(text).value();
  for (int32_t id : ids) {
    auto piece = tok.Decode(std::span<const int32_t>(&id, 1));
    EXPECT_TRUE(piece.ok()) << piece.status();
    out.push_back(piece.ok() ? *piece : "<error>");
  }
  return out;
}

// Merges that build `s` left to right into a single token: s0+s1, then (s0s1)+s2, ...
void AddChain(const std::string& s, std::vector<Merge>& merges, std::set<Merge>& seen) {
  for (size_t i = 1; i < s.size(); ++i) {
    Merge m{s.substr(0, i), s.substr(i, 1)};
    if (seen.insert(m).second) merges.push_back(m);
  }
}

// Shows that GPT-2's pre-tokenization splits `text` into exactly `pieces`: merges that would join
// each pair of neighbouring pieces into one token come first (so a missing boundary shows), then
// merges that make each piece one token (so an extra boundary shows).
void ExpectPreTokens(const std::string& text, const std::vector<std::string>& pieces) {
  std::vector<Merge> merges;
  std::set<Merge> seen;
  for (size_t i = 0; i + 1 < pieces.size(); ++i) AddChain(pieces[i] + pieces[i + 1], merges, seen);
  for (const auto& p : pieces) AddChain(p, merges, seen);
  auto tok = Load(merges);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Pieces(*tok, text), ElementsAreArray(pieces)) << "text: " << text;
}

TEST(TokenizerMerges, LowerRankMergesFirstWhateverItsPosition) {
  EXPECT_THAT(Pieces(*Load({{"b", "c"}, {"a", "b"}}), "abc"), ElementsAre("a", "bc"));
  EXPECT_THAT(Pieces(*Load({{"a", "b"}, {"b", "c"}}), "abc"), ElementsAre("ab", "c"));
}

TEST(TokenizerMerges, RepeatedPairMergesLeftToRightWithoutOverlap) {
  auto tok = Load({{"a", "a"}});
  EXPECT_THAT(Pieces(*tok, "aaa"), ElementsAre("aa", "a"));
  EXPECT_THAT(Pieces(*tok, "aaaaa"), ElementsAre("aa", "aa", "a"));
}

TEST(TokenizerMerges, MergesBuildOnEarlierMerges) {
  auto tok = Load({{"l", "o"}, {"lo", "w"}, {"e", "r"}, {"low", "er"}});
  EXPECT_THAT(Pieces(*tok, "lower"), ElementsAre("lower"));
  EXPECT_THAT(Pieces(*tok, "lowest"), ElementsAre("low", "e", "s", "t"));
}

// GPT-2 merges every occurrence of the best pair before looking at the pairs those merges form;
// here ("ab","a") ranks above ("a","b") but only appears once "ab" exists, after all "a b" merged.
TEST(TokenizerMerges, AllOccurrencesOfTheBestPairMergeBeforeNewPairs) {
  auto tok = Load({{"ab", "a"}, {"a", "b"}});
  EXPECT_THAT(Pieces(*tok, "abab"), ElementsAre("ab", "ab"));
  EXPECT_THAT(Pieces(*tok, "aba"), ElementsAre("aba"));
}

TEST(TokenizerMerges, RepeatedMergeTakesItsLastRank) {
  // Ranks: ("b","c") = 1, ("a","b") = 2, as in GPT-2's dict(zip(merges, range(n))).
  EXPECT_THAT(Pieces(*Load({{"a", "b"}, {"b", "c"}, {"a", "b"}}), "abc"), ElementsAre("a", "bc"));
}

TEST(TokenizerMerges, LongWordMergesCompletely) {
  auto tok = Load({{"a", "a"}, {"aa", "aa"}, {"aaaa", "aaaa"}});
  const std::string text(100003, 'a');
  const std::vector<int32_t> ids = tok->Encode(text).value();
  ASSERT_EQ(ids.size(), 100000u / 8 + 2);  // 12500 x "aaaaaaaa", then "aa", "a"
  EXPECT_THAT(Pieces(*tok, "aaaaaaaaaaa"), ElementsAre("aaaaaaaa", "aa", "a"));
  EXPECT_EQ(*tok->Decode(ids), text);
}

TEST(TokenizerPreTokens, WordsTakeTheirLeadingSpace) {
  ExpectPreTokens("Hello world", {"Hello", " world"});
  ExpectPreTokens(" a b", {" a", " b"});
}

TEST(TokenizerPreTokens, SpaceRunGivesItsLastSpaceToTheNextWord) {
  ExpectPreTokens("a  b", {"a", " ", " b"});
  ExpectPreTokens("a    b", {"a", "   ", " b"});
  ExpectPreTokens("a   ", {"a", "   "});
  ExpectPreTokens("   ", {"   "});
  ExpectPreTokens("  !", {" ", " !"});
}

TEST(TokenizerPreTokens, OtherWhitespaceNeverJoinsTheNextWord) {
  ExpectPreTokens("a\t\tb", {"a", "\t", "\t", "b"});
  ExpectPreTokens("a\tb", {"a", "\t", "b"});
  ExpectPreTokens("x \tb", {"x", " ", "\t", "b"});
  ExpectPreTokens("x \n\ny", {"x", " \n", "\n", "y"});
  ExpectPreTokens("a\r\n", {"a", "\r\n"});
  ExpectPreTokens("a\v\fb", {"a", "\v", "\f", "b"});
}

TEST(TokenizerPreTokens, ContractionsAreLowercaseOnly) {
  ExpectPreTokens("it's", {"it", "'s"});
  ExpectPreTokens("we'll've", {"we", "'ll", "'ve"});
  ExpectPreTokens("I'm they're you'd", {"I", "'m", " they", "'re", " you", "'d"});
  ExpectPreTokens("IT'S", {"IT", "'", "S"});
  ExpectPreTokens("'sup", {"'s", "up"});
  ExpectPreTokens("''s", {"''", "s"});
  ExpectPreTokens(" 's", {" '", "s"});
  ExpectPreTokens("don\xE2\x80\x99t", {"don", "\xE2\x80\x99", "t"});  // U+2019 is no apostrophe
}

TEST(TokenizerPreTokens, LettersNumbersAndOtherCharactersSeparate) {
  ExpectPreTokens("abc123def", {"abc", "123", "def"});
  ExpectPreTokens("x = 42+7;", {"x", " =", " 42", "+", "7", ";"});
  ExpectPreTokens("a?!b", {"a", "?!", "b"});
  ExpectPreTokens(" ?!", {" ?!"});
}

TEST(TokenizerPreTokens, UnicodeCategoriesDecideLettersAndNumbers) {
  ExpectPreTokens("na\xC3\xAFve caf\xC3\xA9", {"na\xC3\xAFve", " caf\xC3\xA9"});  // naïve café
  ExpectPreTokens("\xE4\xB8\xAD\xE6\x96\x87 \xE5\xAD\x97",                        // 中文 字
                  {"\xE4\xB8\xAD\xE6\x96\x87", " \xE5\xAD\x97"});
  ExpectPreTokens("e\xCC\x81x", {"e", "\xCC\x81", "x"});  // U+0301 is a mark, not a letter
  ExpectPreTokens(
      "p\xCA\xB0"
      "a",
      {"p\xCA\xB0"
       "a"});  // U+02B0 is a modifier letter
  ExpectPreTokens("\xE4\xBA\xBA\xE3\x80\x85 ",
                  {"\xE4\xBA\xBA\xE3\x80\x85", " "});  // 人々: U+3005 too
  ExpectPreTokens(
      "\xC7\x85"
      "a",
      {"\xC7\x85"
       "a"});                                                       // U+01C5 is titlecase
  ExpectPreTokens("a\xE2\x85\xAB", {"a", "\xE2\x85\xAB"});          // U+216B Roman twelve: a number
  ExpectPreTokens("x\xC2\xBD\xC2\xB2", {"x", "\xC2\xBD\xC2\xB2"});  // ½² are numbers
  ExpectPreTokens(" \xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD!",             // emoji + skin tone + '!'
                  {" \xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD!"});
}

TEST(TokenizerPreTokens, WhitespaceIsJavaScriptsSet) {
  ExpectPreTokens(
      "a\xC2\xA0"
      "b",
      {"a", "\xC2\xA0", "b"});  // U+00A0 is space
  ExpectPreTokens("a\xC2\xA0 b", {"a", "\xC2\xA0", " b"});
  // A space before a character that is not whitespace would join it: " ?[^\s\p{L}\p{N}]+".
  ExpectPreTokens(
      " \xC2\xA0"
      "b",
      {" ", "\xC2\xA0", "b"});
  ExpectPreTokens(
      " \xEF\xBB\xBF"
      "b",
      {" ", "\xEF\xBB\xBF", "b"});  // U+FEFF
  ExpectPreTokens(
      " \xE2\x80\xA8"
      "b",
      {" ", "\xE2\x80\xA8", "b"});  // U+2028
  ExpectPreTokens(
      " \xE1\x9A\x80"
      "b",
      {" ", "\xE1\x9A\x80", "b"});  // U+1680
  ExpectPreTokens(
      "a\xE3\x80\x80"
      "b",
      {"a", "\xE3\x80\x80", "b"});  // U+3000 is space
  ExpectPreTokens("x\xEF\xBB\xBF\xEF\xBB\xBFy",
                  {"x", "\xEF\xBB\xBF", "\xEF\xBB\xBF", "y"});  // U+FEFF
  ExpectPreTokens(
      "a\xE2\x80\x8B"
      "b",
      {"a", "\xE2\x80\x8B", "b"});  // U+200B is not
  ExpectPreTokens(" \xE2\x80\x8B", {" \xE2\x80\x8B"});
  ExpectPreTokens(" \xC2\x85", {" \xC2\x85"});  // U+0085 is not
}

TEST(TokenizerPreTokens, MalformedUtf8BytesAreOtherCharacters) {
  ExpectPreTokens(
      "a\xFF\xFE"
      "b",
      {"a", "\xFF\xFE", "b"});
  ExpectPreTokens(" \xFF", {" \xFF"});
  ExpectPreTokens("\xE4\xB8x", {"\xE4\xB8", "x"});            // truncated 3-byte sequence
  ExpectPreTokens("a\xC0\xAF", {"a", "\xC0\xAF"});            // overlong '/'
  ExpectPreTokens("a\xED\xA0\x80!", {"a", "\xED\xA0\x80!"});  // encoded surrogate
  ExpectPreTokens(
      "a\x80"
      "b",
      {"a", "\x80", "b"});  // stray continuation byte
}

TEST(TokenizerRoundTrip, AnyBytesDecodeToThemselves) {
  auto tok = Load({{" ", "t"}, {"t", "h"}, {" t", "h"}, {"\xC3", "\xA9"}, {"\xFF", "\xFF"}});
  uint32_t state = 12345;
  for (int trial = 0; trial < 500; ++trial) {
    std::string text(trial % 97, '\0');
    for (char& c : text) {
      state = state * 1664525u + 1013904223u;
      // Mostly a few interesting bytes, sometimes any byte.
      static constexpr char kCommon[] = {' ', 't', 'h', '\xC3', '\xA9', '\xFF', '\'', 's', '\n'};
      c = (state >> 28) < 12 ? kCommon[(state >> 8) % sizeof(kCommon)]
                             : static_cast<char>(state >> 16);
    }
    auto decoded = tok->Decode(tok->Encode(text).value());
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    ASSERT_EQ(*decoded, text) << "trial " << trial;
  }
  EXPECT_TRUE(tok->Encode("").value().empty());
}

TEST(TokenizerRoundTrip, ConcurrentEncodesAgree) {
  auto tok = Load({{" ", "t"}, {"t", "h"}, {" t", "h"}, {"e", "r"}});
  std::vector<std::string> texts;
  for (int i = 0; i < 200; ++i) texts.push_back("the other " + std::to_string(i) + " there");
  std::vector<std::vector<int32_t>> expected;
  for (const auto& t : texts) expected.push_back(tok->Encode(t).value());
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 20; ++rep) {
        for (size_t i = 0; i < texts.size(); ++i) {
          if (tok->Encode(texts[(i + t) % texts.size()]).value() !=
              expected[(i + t) % texts.size()]) {
            ++mismatches[t];
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_THAT(mismatches, ElementsAre(0, 0, 0, 0));
}

nlohmann::json WithAddedTokens(nlohmann::json json,
                               const std::vector<std::pair<std::string, int>>& added,
                               bool also_in_vocab) {
  for (const auto& [content, id] : added) {
    json["added_tokens"].push_back({{"id", id}, {"content", content}, {"special", true}});
    if (also_in_vocab) json["model"]["vocab"][content] = id;
  }
  return json;
}

TEST(TokenizerAddedTokens, AreMatchedWholeAndSplitTheText) {
  for (bool in_vocab : {true, false}) {
    auto tok =
        LoadJson(WithAddedTokens(TokenizerJson({{" ", "b"}}), {{"<|endoftext|>", 300}}, in_vocab));
    ASSERT_NE(tok, nullptr);
    EXPECT_THAT(tok->Encode("a<|endoftext|> b").value(),
                ElementsAre('a', 300, tok->Encode(" b").value()[0]));
    EXPECT_THAT(tok->Encode("<|endoftext|><|endoftext|>").value(), ElementsAre(300, 300));
    EXPECT_THAT(Pieces(*tok, "a <|endoftext|>"), ElementsAre("a", " ", "<|endoftext|>"));
    // A partial match is ordinary text.
    EXPECT_THAT(Pieces(*tok, "<|endoftext"),
                ElementsAre("<", "|", "e", "n", "d", "o", "f", "t", "e", "x", "t"));
    EXPECT_EQ(*tok->Decode(tok->Encode("x<|endoftext|>y").value()), "x<|endoftext|>y");
    EXPECT_EQ(tok->vocab_size(), 301);
  }
}

TEST(TokenizerAddedTokens, LongestMatchWins) {
  auto tok = LoadJson(WithAddedTokens(TokenizerJson({}), {{"<a>", 400}, {"<a><b>", 401}}, false));
  EXPECT_THAT(tok->Encode("<a><b><a>").value(), ElementsAre(401, 400));
}

TEST(TokenizerAddedTokens, GptTwoFilesTreatEndOfTextAsText) {
  const fs::path dir = TestDir();
  Vocab v = MakeVocab({});
  v.ids["<|endoftext|>"] = 256;
  WriteText(dir / "vocab.json", nlohmann::json(v.ids).dump());
  WriteText(dir / "merges.txt", "#version: 0.2\n");
  auto tok = Tokenizer::FromVocabAndMerges(dir / "vocab.json", dir / "merges.txt");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->Encode("<|endoftext|>").value().size(), 13u);
  const int32_t eot = 256;
  EXPECT_EQ(*(*tok)->Decode(std::span<const int32_t>(&eot, 1)), "<|endoftext|>");
}

TEST(TokenizerDecode, IdOutsideTheVocabularyIsAnErrorNamingIt) {
  // Ids 0..255 are bytes, 256 is "ab"; 300 is an added token, so 257..299 are unused.
  auto tok = LoadJson(WithAddedTokens(TokenizerJson({{"a", "b"}}), {{"<s>", 300}}, false));
  ASSERT_EQ(tok->vocab_size(), 301);
  for (int32_t bad : {-1, 301, 1 << 30, 257, 299}) {
    std::vector<int32_t> ids = {'a', bad};
    auto decoded = tok->Decode(ids);
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(decoded.status().message(), HasSubstr("token id " + std::to_string(bad)));
  }
  std::vector<int32_t> ok = {256, 300, 'c'};
  EXPECT_EQ(*tok->Decode(ok), "ab<s>c");
}

TEST(TokenizerFiles, MergesMayBeStringsOrPairs) {
  nlohmann::json json = TokenizerJson({{"b", "c"}, {"a", "bc"}});
  auto as_strings = LoadJson(json);
  json["model"]["merges"] = nlohmann::json::array({{"b", "c"}, {"a", "bc"}});
  auto as_pairs = LoadJson(json);
  EXPECT_THAT(Pieces(*as_pairs, "abc"), ElementsAre("abc"));
  EXPECT_EQ(as_pairs->Encode("abcbc a").value(), as_strings->Encode("abcbc a").value());
}

TEST(TokenizerFiles, GptTwoMergesFileFormat) {
  const fs::path dir = TestDir();
  WriteText(dir / "vocab.json", nlohmann::json(MakeVocab({{"b", "c"}, {"a", "bc"}}).ids).dump());
  // Version line, CRLF endings, a blank line, a tab separator, no final newline.
  WriteText(dir / "merges.txt", "#version: 0.2\r\nb c\r\n\r\na\tbc");
  auto tok = Tokenizer::FromVocabAndMerges(dir / "vocab.json", dir / "merges.txt");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT(Pieces(**tok, "abc"), ElementsAre("abc"));
  EXPECT_EQ((*tok)->vocab_size(), 258);
}

TEST(TokenizerFiles, FromDirPrefersTokenizerJson) {
  const fs::path dir = TestDir();
  WriteText(dir / "vocab.json", nlohmann::json(MakeVocab({}).ids).dump());
  WriteText(dir / "merges.txt", "#version: 0.2\n");
  auto from_gpt2 = Tokenizer::FromDir(dir);
  ASSERT_TRUE(from_gpt2.ok()) << from_gpt2.status();
  EXPECT_THAT(Pieces(**from_gpt2, "ab"), ElementsAre("a", "b"));
  WriteText(dir / "tokenizer.json", TokenizerJson({{"a", "b"}}).dump());
  auto from_json = Tokenizer::FromDir(dir);
  ASSERT_TRUE(from_json.ok()) << from_json.status();
  EXPECT_THAT(Pieces(**from_json, "ab"), ElementsAre("ab"));
}

TEST(TokenizerFiles, FromDirWithoutTokenizerFilesIsNotFound) {
  const fs::path dir = TestDir();
  WriteText(dir / "vocab.json", "{}");  // merges.txt missing
  auto tok = Tokenizer::FromDir(dir);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(tok.status().message(), HasSubstr(dir.string()));
}

// Loads `json_text` as tokenizer.json and expects INVALID_ARGUMENT naming the file and `what`.
void ExpectBadTokenizerJson(const std::string& json_text, const std::string& what) {
  const fs::path path = TestDir() / "tokenizer.json";
  WriteText(path, json_text);
  auto tok = Tokenizer::FromTokenizerJson(path);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument) << tok.status();
  EXPECT_THAT(tok.status().message(), AllOf(HasSubstr(path.string()), HasSubstr(what)));
}

void ExpectBadTokenizerJson(const nlohmann::json& json, const std::string& what) {
  ExpectBadTokenizerJson(json.dump(), what);
}

TEST(TokenizerBadFiles, MissingFileIsNotFound) {
  const fs::path path = TestDir() / "tokenizer.json";
  auto tok = Tokenizer::FromTokenizerJson(path);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(tok.status().message(), HasSubstr(path.string()));
}

TEST(TokenizerBadFiles, NotJson) {
  ExpectBadTokenizerJson(std::string("{\"model\": {\"vocab\": "), "not valid JSON");
  ExpectBadTokenizerJson(std::string("\x89PNG\r\n"), "not valid JSON");
}

TEST(TokenizerBadFiles, TopLevelNotAnObject) {
  ExpectBadTokenizerJson(std::string("[1, 2]"), "top level must be an object");
}

TEST(TokenizerBadFiles, MissingModel) {
  nlohmann::json json = TokenizerJson({});
  json.erase("model");
  ExpectBadTokenizerJson(json, "no \"model\" object");
  json["model"] = "BPE";
  ExpectBadTokenizerJson(json, "no \"model\" object");
}

TEST(TokenizerBadFiles, ModelNotBpeIsRefusedByName) {
  nlohmann::json json = TokenizerJson({});
  json["model"]["type"] = "WordPiece";
  const fs::path path = TestDir() / "tokenizer.json";
  WriteText(path, json.dump());
  auto tok = Tokenizer::FromTokenizerJson(path);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kUnimplemented) << tok.status();
  EXPECT_THAT(tok.status().message(), HasSubstr("model type \"WordPiece\" is not supported"));
}

TEST(TokenizerBadFiles, MissingOrMistypedVocab) {
  nlohmann::json json = TokenizerJson({});
  json["model"].erase("vocab");
  ExpectBadTokenizerJson(json, "no model.vocab");
  json["model"]["vocab"] = {"a", "b"};
  ExpectBadTokenizerJson(json, "model.vocab must be an object");
}

TEST(TokenizerBadFiles, MissingMerges) {
  nlohmann::json json = TokenizerJson({});
  json["model"].erase("merges");
  ExpectBadTokenizerJson(json, "no model.merges array");
  json["model"]["merges"] = "a b";
  ExpectBadTokenizerJson(json, "no model.merges array");
}

TEST(TokenizerBadFiles, MalformedMergeEntries) {
  nlohmann::json json = TokenizerJson({});
  for (const nlohmann::json& bad : {nlohmann::json("ab"), nlohmann::json("a b c"),
                                    nlohmann::json(" a"), nlohmann::json("a ")}) {
    json["model"]["merges"] = nlohmann::json::array({bad});  // {bad} alone is a copy with clang
    ExpectBadTokenizerJson(json, "model.merges[0]");
  }
  for (const nlohmann::json& bad : {nlohmann::json({"a", "b", "c"}), nlohmann::json({"a", 1}),
                                    nlohmann::json({"a", ""}), nlohmann::json(7)}) {
    json["model"]["merges"] = {"a b", bad};
    ExpectBadTokenizerJson(json, "model.merges[1]");
  }
}

TEST(TokenizerBadFiles, MergeNamingATokenNotInTheVocabulary) {
  nlohmann::json json = TokenizerJson({{"a", "b"}});
  json["model"]["merges"].push_back("ab zz");
  ExpectBadTokenizerJson(json, "model.merges[1]: merge 'ab zz' names 'zz', which is not in");
}

TEST(TokenizerBadFiles, MergeMakingATokenNotInTheVocabulary) {
  nlohmann::json json = TokenizerJson({{"a", "b"}});
  json["model"]["merges"].push_back("b a");
  ExpectBadTokenizerJson(json, "merge 'b a' makes 'ba', which is not in the vocabulary");
}

TEST(TokenizerBadFiles, DuplicateIds) {
  nlohmann::json json = TokenizerJson({{"a", "b"}});
  json["model"]["vocab"]["ab"] = 97;  // the id of "a"
  ExpectBadTokenizerJson(json, "share id 97");
}

TEST(TokenizerBadFiles, IdsThatAreNotNonNegativeIntegers) {
  for (const nlohmann::json& bad :
       {nlohmann::json("5"), nlohmann::json(1.5), nlohmann::json(-1), nlohmann::json(1e12),
        nlohmann::json(int64_t{1} << 40), nlohmann::json(nullptr)}) {
    nlohmann::json json = TokenizerJson({{"a", "b"}});
    json["model"]["vocab"]["ab"] = bad;
    ExpectBadTokenizerJson(json, "token 'ab' has id " + bad.dump());
  }
}

// GPT-2's own files hold every byte and spell every token in the byte alphabet (a tokenizer.json
// need not: Hugging Face's BPE takes any vocabulary).
void ExpectBadGptTwoVocab(const std::map<std::string, int>& vocab, const std::string& what) {
  const fs::path dir = TestDir();
  WriteText(dir / "vocab.json", nlohmann::json(vocab).dump());
  WriteText(dir / "merges.txt", "#version: 0.2\n");
  auto tok = Tokenizer::FromVocabAndMerges(dir / "vocab.json", dir / "merges.txt");
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument) << tok.status();
  EXPECT_THAT(tok.status().message(), AllOf(HasSubstr("vocab.json"), HasSubstr(what)));
}

TEST(TokenizerBadFiles, MissingByteToken) {
  Vocab v = MakeVocab({});
  v.ids.erase(Spell("\n"));
  ExpectBadGptTwoVocab(v.ids, "no token for byte 0x0A");
}

TEST(TokenizerBadFiles, TokenOutsideTheByteAlphabet) {
  Vocab v = MakeVocab({});
  v.ids["\xE2\x96\x81the"] = 256;  // SentencePiece's "▁the"
  ExpectBadGptTwoVocab(v.ids, "has character U+2581, which is not in GPT-2's byte alphabet");
}

TEST(TokenizerBadFiles, MalformedAddedTokens) {
  const nlohmann::json base = TokenizerJson({{"a", "b"}});
  nlohmann::json json = base;
  json["added_tokens"] = {{{"content", "<s>"}}};
  ExpectBadTokenizerJson(json, "added_tokens[0]: no \"id\" integer");
  json["added_tokens"] = {{{"id", "x"}, {"content", "<s>"}}};
  ExpectBadTokenizerJson(json, "added_tokens[0].id must be an integer, got \"x\"");
  json["added_tokens"] = {{{"id", 300}, {"content", ""}}};
  ExpectBadTokenizerJson(json, "added_tokens[0] has empty content");
  json["added_tokens"] = {{{"id", 300}, {"content", "<s>"}}, {{"id", 300}, {"content", "</s>"}}};
  ExpectBadTokenizerJson(json, "added_tokens[1]");
  json["added_tokens"] = "<s>";
  ExpectBadTokenizerJson(json, "added_tokens must be an array");
  // The vocabulary and added_tokens disagree about an id.
  json = WithAddedTokens(base, {{"<s>", 256}}, false);  // 256 is "ab"
  ExpectBadTokenizerJson(json, "id 256 is token 'ab' in the vocabulary but added token '<s>'");
  json = WithAddedTokens(base, {{"ab", 300}}, false);
  ExpectBadTokenizerJson(json, "added token 'ab' has id 300 but the vocabulary gives it id 256");
}

TEST(TokenizerBadFiles, GptTwoVocabNotAnObject) {
  const fs::path dir = TestDir();
  WriteText(dir / "vocab.json", "[\"a\"]");
  WriteText(dir / "merges.txt", "#version: 0.2\n");
  auto tok = Tokenizer::FromVocabAndMerges(dir / "vocab.json", dir / "merges.txt");
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(),
              AllOf(HasSubstr((dir / "vocab.json").string()), HasSubstr("must be an object")));
}

TEST(TokenizerBadFiles, GptTwoVocabNotJson) {
  const fs::path dir = TestDir();
  WriteText(dir / "vocab.json", "{\"a\": 1,");
  WriteText(dir / "merges.txt", "#version: 0.2\n");
  auto tok = Tokenizer::FromVocabAndMerges(dir / "vocab.json", dir / "merges.txt");
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(),
              AllOf(HasSubstr((dir / "vocab.json").string()), HasSubstr("not valid JSON")));
}

TEST(TokenizerBadFiles, GptTwoMergesLines) {
  const fs::path dir = TestDir();
  WriteText(dir / "vocab.json", nlohmann::json(MakeVocab({{"a", "b"}}).ids).dump());
  for (const auto& [merges, what] : std::vector<std::pair<std::string, std::string>>{
           {"#version: 0.2\na b\nabc\n", "line 3 is 'abc', not two tokens"},
           {"#version: 0.2\na b c\n", "line 2 is 'a b c', not two tokens"},
           {"#version: 0.2\na b\nab zz\n", "line 3: merge 'ab zz' names 'zz', which is not in"},
           {"a b\n#version: 0.2\n", "line 2: merge '#version: 0.2' names '#version:'"}}) {
    WriteText(dir / "merges.txt", merges);
    auto tok = Tokenizer::FromVocabAndMerges(dir / "vocab.json", dir / "merges.txt");
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument) << merges;
    EXPECT_THAT(tok.status().message(),
                AllOf(HasSubstr((dir / "merges.txt").string()), HasSubstr(what)));
  }
  fs::remove(dir / "merges.txt");
  auto tok = Tokenizer::FromVocabAndMerges(dir / "vocab.json", dir / "merges.txt");
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(tok.status().message(), HasSubstr((dir / "merges.txt").string()));
}

// A tokenizer.json whose pre-tokenizer is a Split on `pattern` (isolated) over GPT-2's byte-level
// BPE of no merges.
nlohmann::json SplitTokenizerJson(const std::string& pattern) {
  nlohmann::json json = TokenizerJson({});
  json["pre_tokenizer"] = {{"type", "Sequence"},
                           {"pretokenizers",
                            {{{"type", "Split"},
                              {"pattern", {{"Regex", pattern}}},
                              {"behavior", "Isolated"},
                              {"invert", false}},
                             {{"type", "ByteLevel"},
                              {"add_prefix_space", false},
                              {"trim_offsets", true},
                              {"use_regex", false}}}}};
  return json;
}

TEST(TokenizerRegexBudget, CatastrophicBacktrackingFailsNamingTheTokenizerAndPattern) {
  const fs::path path = TestDir() / "tokenizer.json";
  WriteText(path, SplitTokenizerJson("(a+)+$").dump());
  auto tok = Tokenizer::FromTokenizerJson(path);
  ASSERT_TRUE(tok.ok()) << tok.status();
  // 2^40 ways to split the a's before the final 'b' refutes `$`: without a budget this never ends.
  absl::StatusOr<std::vector<int32_t>> ids = (*tok)->Encode(std::string(40, 'a') + "b");
  ASSERT_FALSE(ids.ok());
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ids.status().message(),
              AllOf(HasSubstr(path.string()), HasSubstr("pre_tokenizer.pretokenizers[0]"),
                    HasSubstr("(a+)+$"), HasSubstr("time limit")));
  // The tokenizer still serves: a text the pattern handles at once encodes as before.
  absl::StatusOr<std::vector<int32_t>> fine = (*tok)->Encode("aaab");
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_THAT(*fine, ElementsAre('a', 'a', 'a', 'b'));
}

TEST(TokenizerRegexBudget, LongOrdinaryTextStaysWithinTheBudget) {
  // GPT-2's pattern over 4 MB of text with long runs of spaces (its `\s+(?!\S)` backtracks over
  // each run): far inside the budget that grows with the text.
  auto tok = LoadJson(TokenizerJson({}));
  ASSERT_NE(tok, nullptr);
  std::string text;
  while (text.size() < (4u << 20))
    text += "The bread is done when it sounds hollow." + std::string(4000, ' ') + "\n";
  absl::StatusOr<std::vector<int32_t>> ids = tok->Encode(text);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_GT(ids->size(), text.size() / 100);
}

TEST(TokenizerBadFiles, NormalizerNestedAHundredThousandDeepIsRefusedAtLoad) {
  const fs::path path = TestDir() / "tokenizer.json";
  std::string normalizer;
  for (int i = 0; i < 100000; ++i) normalizer += R"({"type": "Sequence", "normalizers": [)";
  normalizer += R"({"type": "NFC"})";
  for (int i = 0; i < 100000; ++i) normalizer += "]}";
  std::string text = TokenizerJson({}).dump();
  text.insert(1, "\"normalizer\": " + normalizer + ", ");
  WriteText(path, text);
  auto tok = Tokenizer::FromTokenizerJson(path);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(),
              AllOf(HasSubstr(path.string()), HasSubstr("normalizer.normalizers[0]"),
                    HasSubstr("deeper than 128 levels")));
}

TEST(TokenizerBadFiles, NormalizersNestedJustUnderTheBoundLoad) {
  // 60 Sequences inside each other: 120 levels of arrays and objects, under the bound of 128.
  nlohmann::json normalizer = {{"type", "NFC"}};
  for (int i = 0; i < 60; ++i) {
    normalizer = {{"type", "Sequence"}, {"normalizers", nlohmann::json::array({normalizer})}};
  }
  nlohmann::json json = TokenizerJson({});
  json["normalizer"] = normalizer;
  auto tok = LoadJson(json);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(tok->Encode("ab").value(), ElementsAre('a', 'b'));
}

}  // namespace
}  // namespace tandem
