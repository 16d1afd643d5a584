#include "common/structured/grammar.h"

#include <string>

#include "gtest/gtest.h"

namespace tandem::structured {
namespace {

// True when `text` is a whole text of the grammar.
bool Accepts(const std::shared_ptr<const Grammar>& g, std::string_view text) {
  Matcher m(g);
  return m.Advance(text) && m.Accepting();
}
// True when `text` can still be continued into a text of the grammar.
bool Prefix(const std::shared_ptr<const Grammar>& g, std::string_view text) {
  Matcher m(g);
  return m.Advance(text);
}
std::shared_ptr<const Grammar> Schema(std::string_view s) {
  auto g = CompileJsonSchema(s);
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? *g : JsonObjectGrammar();
}

TEST(JsonSchemaTest, RequiredAndOptionalPropertiesInOrder) {
  auto g = Schema(R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string"},
                      "c":{"type":"boolean"}},"required":["a","c"],"additionalProperties":false})");
  EXPECT_TRUE(Accepts(g, R"({"a":1,"b":"x","c":true})"));
  EXPECT_TRUE(Accepts(g, R"({"a":-12,"c":false})"));
  EXPECT_FALSE(Accepts(g, R"({"a":1})"));            // c is required
  EXPECT_FALSE(Prefix(g, R"({"c":true)"));           // a comes first
  EXPECT_FALSE(Prefix(g, R"({"a":1.5)"));            // an integer
  EXPECT_FALSE(Prefix(g, R"({"a":1,"d")"));          // no other keys
  EXPECT_FALSE(Prefix(g, R"({"a":01)"));             // no leading zeros
  EXPECT_FALSE(Prefix(g, R"({ "a")"));               // compact
}

TEST(JsonSchemaTest, NumbersStringsAndEscapes) {
  auto g = Schema(R"({"type":"array","items":{"type":["number","string","null"]}})");
  EXPECT_TRUE(Accepts(g, R"([1.5e-3,-0,"a\"b\\c\u00e9\n","\u00e9",null])"));
  EXPECT_TRUE(Accepts(g, "[\"caf\xC3\xA9\"]"));
  EXPECT_FALSE(Prefix(g, "[\"caf\xC3\x41"));          // broken UTF-8
  EXPECT_FALSE(Prefix(g, "[\"a\x01"));                // raw control character
  EXPECT_FALSE(Prefix(g, R"(["\x")"));                // unknown escape
  EXPECT_FALSE(Prefix(g, "[1.]"));
  EXPECT_TRUE(Accepts(g, "[]"));
}

// Every number generated is a finite double: 1e999 would parse as Infinity.
TEST(JsonSchemaTest, NumbersStayFinite) {
  auto g = Schema(R"({"type":"number"})");
  EXPECT_TRUE(Accepts(g, "9999999999999999.9999999999999999e99"));
  EXPECT_TRUE(Accepts(g, "1E-99"));
  EXPECT_FALSE(Accepts(g, "1e308"));
  EXPECT_FALSE(Accepts(g, "1e-400"));
}

// Only valid UTF-8 in strings: a decoder would show each byte of an overlong form, a surrogate or
// a code point past U+10FFFF as U+FFFD, and the text would break maxLength.
TEST(JsonSchemaTest, StringsAreValidUtf8) {
  auto g = Schema(R"({"type":"string","maxLength":1})");
  EXPECT_TRUE(Accepts(g, "\"\xE0\xA0\x80\""));       // U+0800
  EXPECT_TRUE(Accepts(g, "\"\xED\x9F\xBF\""));       // U+D7FF
  EXPECT_TRUE(Accepts(g, "\"\xF0\x90\x80\x80\""));  // U+10000
  EXPECT_TRUE(Accepts(g, "\"\xF4\x8F\xBF\xBF\""));  // U+10FFFF
  EXPECT_FALSE(Accepts(g, "\"\xE0\x80\x80\""));      // overlong
  EXPECT_FALSE(Accepts(g, "\"\xED\xA0\x80\""));      // a surrogate
  EXPECT_FALSE(Accepts(g, "\"\xF0\x80\x80\x80\""));  // overlong
  EXPECT_FALSE(Accepts(g, "\"\xF4\x90\x80\x80\""));  // past U+10FFFF
  EXPECT_FALSE(Accepts(g, "\"\xC3\""));              // cut short
}

TEST(JsonSchemaTest, StringLengthsCountCodePoints) {
  auto g = Schema(R"({"type":"string","minLength":2,"maxLength":3})");
  EXPECT_FALSE(Accepts(g, R"("a")"));
  EXPECT_TRUE(Accepts(g, "\"\xC3\xA9\xC3\xA9\xC3\xA9\""));
  EXPECT_FALSE(Prefix(g, R"("abcd)"));
}

TEST(JsonSchemaTest, EnumConstAnyOfAndNesting) {
  auto g = Schema(R"({"type":"object","properties":{
      "kind":{"enum":["cat","caterpillar",3,null]},
      "tag":{"const":"x\"y"},
      "v":{"anyOf":[{"type":"integer"},{"type":"array","items":{"type":"boolean"},"minItems":1,"maxItems":2}]}},
      "required":["kind","tag","v"]})");
  EXPECT_TRUE(Accepts(g, R"({"kind":"caterpillar","tag":"x\"y","v":[true,false]})"));
  EXPECT_TRUE(Accepts(g, R"({"kind":null,"tag":"x\"y","v":7})"));
  EXPECT_FALSE(Prefix(g, R"({"kind":"dog")"));
  EXPECT_FALSE(Prefix(g, R"({"kind":3,"tag":"x\"y","v":[])"));          // minItems 1
  EXPECT_FALSE(Prefix(g, R"({"kind":3,"tag":"x\"y","v":[true,true,)"));  // maxItems 2
}

TEST(JsonSchemaTest, LocalRefsAndRecursion) {
  auto g = Schema(R"({"$defs":{"node":{"type":"object","properties":{"name":{"type":"string"},
      "children":{"type":"array","items":{"$ref":"#/$defs/node"}}},"required":["name"]}},
      "$ref":"#/$defs/node"})");
  EXPECT_TRUE(Accepts(g, R"({"name":"a","children":[{"name":"b","children":[]},{"name":"c"}]})"));
  EXPECT_FALSE(Prefix(g, R"({"name":"a","children":[{"children")"));
}

TEST(JsonSchemaTest, MapsAndPatterns) {
  auto g = Schema(R"({"type":"object","additionalProperties":{"type":"string","pattern":"^[a-z]+[0-9]$"}})");
  EXPECT_TRUE(Accepts(g, R"({"k":"ab1","other key":"z9"})"));
  EXPECT_FALSE(Prefix(g, R"({"k":"ab1x)"));
  EXPECT_FALSE(Accepts(g, R"({"k":"ab"})"));
  auto unanchored = Schema(R"({"type":"string","pattern":"ab"})");
  EXPECT_TRUE(Accepts(unanchored, R"("xxabyy")"));
  EXPECT_FALSE(Accepts(unanchored, R"("xxa")"));
}

TEST(JsonSchemaTest, AnyJsonObject) {
  auto g = JsonObjectGrammar();
  EXPECT_TRUE(Accepts(g, R"({"a":[1,{"b":null},"x"],"c":{}})"));
  EXPECT_FALSE(Prefix(g, "["));
  EXPECT_FALSE(Accepts(g, R"({"a":1)"));
}

TEST(JsonSchemaTest, FinishedOnlyWhenNothingCanFollow) {
  Matcher obj(JsonObjectGrammar());
  ASSERT_TRUE(obj.Advance("{}"));
  EXPECT_TRUE(obj.Finished());
  Matcher num(Schema(R"({"type":"integer"})"));
  ASSERT_TRUE(num.Advance("12"));
  EXPECT_TRUE(num.Accepting());
  EXPECT_FALSE(num.Finished());  // more digits may come
}

// Each refusal names the keyword or the problem.
TEST(JsonSchemaTest, RefusesUnsupportedKeywordNamingIt) {
  auto g = CompileJsonSchema(R"({"type":"object","properties":{"n":{"type":"number","minimum":0}}})");
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("'minimum'"), std::string::npos) << g.status();
  EXPECT_NE(g.status().message().find("#/properties/n"), std::string::npos) << g.status();
}
TEST(JsonSchemaTest, RefusesMalformedJson) {
  EXPECT_FALSE(CompileJsonSchema("{").ok());
}
TEST(JsonSchemaTest, RefusesRemoteRef) {
  auto g = CompileJsonSchema(R"({"$ref":"http://x/y.json"})");
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("not local"), std::string::npos);
}
TEST(JsonSchemaTest, RefusesRefToNowhere) {
  EXPECT_FALSE(CompileJsonSchema(R"({"$ref":"#/$defs/missing"})").ok());
}
TEST(JsonSchemaTest, RefusesRequiredNotInProperties) {
  EXPECT_FALSE(CompileJsonSchema(R"({"properties":{"a":{}},"required":["b"]})").ok());
}
TEST(JsonSchemaTest, RefusesUnknownType) {
  EXPECT_FALSE(CompileJsonSchema(R"({"type":"date"})").ok());
}
TEST(JsonSchemaTest, RefusesTooDeepSchema) {
  std::string s;
  for (int i = 0; i < 40; ++i) s += R"({"type":"array","items":)";
  s += "{}";
  for (int i = 0; i < 40; ++i) s += "}";
  auto g = CompileJsonSchema(s);
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("deeper"), std::string::npos);
}
TEST(JsonSchemaTest, RefusesBadPattern) {
  auto g = CompileJsonSchema(R"js({"type":"string","pattern":"(?=a)"})js");
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("lookaround"), std::string::npos);
}

TEST(RegexGrammarTest, WholeTextMatches) {
  auto g = CompileRegex(R"(\d{3}-[A-Z]+(x|yz)?)");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(Accepts(*g, "123-AB"));
  EXPECT_TRUE(Accepts(*g, "123-ABxyz") == false);
  EXPECT_TRUE(Accepts(*g, "123-Ayz"));
  EXPECT_FALSE(Prefix(*g, "12a"));
  EXPECT_FALSE(Accepts(*g, "123-"));
}

TEST(RegexGrammarTest, DotMatchesWholeUtf8Characters) {
  auto g = CompileRegex("a.b");
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE(Accepts(*g, "a\xC3\xA9" "b"));
  EXPECT_FALSE(Prefix(*g, "a\xC3" "b"));
  EXPECT_FALSE(Prefix(*g, "a\n"));
}

TEST(ChoiceGrammarTest, OneOfTheOptionsAndThenFinished) {
  auto g = CompileChoice({"yes", "no", "yes!"});
  ASSERT_TRUE(g.ok());
  Matcher m(*g);
  ASSERT_TRUE(m.Advance("yes"));
  EXPECT_TRUE(m.Accepting());
  EXPECT_FALSE(m.Finished());  // "yes!" may still come
  ASSERT_TRUE(m.Advance("!"));
  EXPECT_TRUE(m.Finished());
  EXPECT_FALSE(Prefix(*g, "ye!"));
}

TEST(RegexGrammarTest, RefusesBackreference) {
  auto g = CompileRegex(R"((a)\1)");
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("backreference"), std::string::npos);
}
TEST(RegexGrammarTest, RefusesUnbalancedGroup) {
  EXPECT_FALSE(CompileRegex("(ab").ok());
  EXPECT_FALSE(CompileRegex("ab)").ok());
}
TEST(ChoiceGrammarTest, RefusesNoOptions) {
  EXPECT_FALSE(CompileChoice({}).ok());
}

}  // namespace
}  // namespace tandem::structured
