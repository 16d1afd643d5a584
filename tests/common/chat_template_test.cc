// Unit tests of the chat-template interpreter, construct by construct. Expected strings are what
// Jinja2 3.1 writes with trim_blocks, lstrip_blocks and loop controls on (as Hugging Face
// configures it); chat_template_test.sh compares whole real templates with Jinja2 itself.
#include "common/chat_template.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tandem {
namespace {

using ::testing::HasSubstr;

std::string Render(std::string_view source, const std::string& context = "{}") {
  absl::StatusOr<ChatTemplate> parsed = ChatTemplate::Parse(source);
  if (!parsed.ok()) return "PARSE ERROR: " + std::string(parsed.status().message());
  absl::StatusOr<std::string> text = parsed->Render(nlohmann::ordered_json::parse(context));
  if (!text.ok()) return "RENDER ERROR: " + std::string(text.status().message());
  return *text;
}

absl::Status ParseStatus(std::string_view source) { return ChatTemplate::Parse(source).status(); }

absl::Status RenderStatus(std::string_view source, const std::string& context = "{}") {
  absl::StatusOr<ChatTemplate> parsed = ChatTemplate::Parse(source);
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  if (!parsed.ok()) return parsed.status();
  return parsed->Render(nlohmann::ordered_json::parse(context)).status();
}

TEST(ChatTemplateTest, TextAndExpressions) {
  EXPECT_EQ(Render("Hello {{ name }}!", R"({"name": "world"})"), "Hello world!");
  EXPECT_EQ(Render("{# a comment #}x"), "x");
  EXPECT_EQ(Render("{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }}"),
            "7 9 3 -4 2");
  EXPECT_EQ(Render("{{ 7 / 2 }} {{ 4 / 2 }} {{ 2 ** 10 }} {{ 1.5 + 1 }}"), "3.5 2.0 1024 2.5");
  EXPECT_EQ(Render("{{ 'a' ~ 1 ~ none ~ true }}"), "a1NoneTrue");
  EXPECT_EQ(Render("{{ 'a' + 'b' }}{{ [1] + [2] }}"), "ab[1, 2]");
  EXPECT_EQ(Render("{{ 'ab' * 3 }}"), "ababab");
  EXPECT_EQ(Render("{{ 1 if x else 2 }}{{ 3 if not x }}", R"({"x": false})"), "23");
  EXPECT_EQ(Render("{{ x or 'fallback' }} {{ x and 'no' }}", R"({"x": ""})"), "fallback ");
}

TEST(ChatTemplateTest, LiteralsPrintAsPython) {
  EXPECT_EQ(Render("{{ true }} {{ False }} {{ none }} {{ None }}"), "True False None None");
  EXPECT_EQ(Render("{{ [1, 'a', none, true, 1.0] }}"), "[1, 'a', None, True, 1.0]");
  EXPECT_EQ(Render("{{ {'k': 'v', 'n': [1]} }}"), "{'k': 'v', 'n': [1]}");
  EXPECT_EQ(Render("{{ (1, 2) }} {{ (1,) }}"), "(1, 2) (1,)");
  EXPECT_EQ(Render("{{ [\"it's\", 'say \"x\"', 'both \\' \"'] }}"),
            R"(["it's", 'say "x"', 'both \' "'])");
  EXPECT_EQ(Render("{{ 'tab\\there\\nnewline \\u00e9 \\x41' }}"), "tab\there\nnewline é A");
  EXPECT_EQ(Render("{{ ['a\\nb'] }}"), R"(['a\nb'])");
  EXPECT_EQ(Render("{{ 1e-5 }} {{ 1e16 }} {{ 0.1 }} {{ 123456.0 }} {{ 1_000 }}"),
            "1e-05 1e+16 0.1 123456.0 1000");
  EXPECT_EQ(Render("{{ x }}", R"({"x": {"b": 2, "a": [true, null, 2.5]}})"),
            "{'b': 2, 'a': [True, None, 2.5]}");
}

TEST(ChatTemplateTest, WhitespaceControl) {
  EXPECT_EQ(Render("a  {{- 'b' -}}  c"), "abc");
  EXPECT_EQ(Render("a\n  {%- if true %}b{% endif -%}\n  c"), "abc");
  EXPECT_EQ(Render("a {#- x -#} b"), "ab");
  // trim_blocks: the newline after a block tag goes, not after an expression.
  EXPECT_EQ(Render("{% if true %}\nx\n{% endif %}\ny"), "x\ny");
  EXPECT_EQ(Render("{{ 'v' }}\nz"), "v\nz");
  // lstrip_blocks: indentation before a block tag on its own line goes; `+` keeps it.
  EXPECT_EQ(Render("line\n    {% if true %}\n    x\n    {% endif %}\n"), "line\n    x\n");
  EXPECT_EQ(Render("  {%+ if true %}x{% endif %}"), "  x");
  EXPECT_EQ(Render("{% if true +%}\nx{% endif %}"), "\nx");
  // Text before the tag on the same line keeps its spaces.
  EXPECT_EQ(Render("a  {% if true %}b{% endif %}"), "a  b");
  EXPECT_EQ(Render("  {# c #}\nx"), "x");
  // One trailing newline of the template is dropped, as Jinja2 does; CRLF reads as LF.
  EXPECT_EQ(Render("x\n"), "x");
  EXPECT_EQ(Render("x\r\ny"), "x\ny");
}

TEST(ChatTemplateTest, IfElifElse) {
  const char* source = "{% if n == 1 %}one{% elif n == 2 %}two{% else %}many{% endif %}";
  EXPECT_EQ(Render(source, R"({"n": 1})"), "one");
  EXPECT_EQ(Render(source, R"({"n": 2})"), "two");
  EXPECT_EQ(Render(source, R"({"n": 3})"), "many");
  EXPECT_EQ(Render("{% if missing %}x{% else %}y{% endif %}"), "y");
}

TEST(ChatTemplateTest, ForLoopVariables) {
  EXPECT_EQ(Render("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}"
                   "{{ loop.last }}{{ loop.length }}{{ loop.revindex }},{% endfor %}",
                   R"({"xs": ["a", "b"]})"),
            "10TrueFalse22,21FalseTrue21,");
  EXPECT_EQ(Render("{% for x in xs %}{{ loop.previtem }}>{{ x }}>{{ loop.nextitem }};{% endfor %}",
                   R"({"xs": [1, 2, 3]})"),
            ">1>2;1>2>3;2>3>;");
  EXPECT_EQ(Render("{% for x in xs if x is odd %}{{ x }}{{ loop.index }} {% endfor %}",
                   R"({"xs": [1, 2, 3, 4, 5]})"),
            "11 32 53 ");
  EXPECT_EQ(Render("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(Render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
                   R"({"d": {"b": 1, "a": 2}})"),
            "b=1;a=2;");
  EXPECT_EQ(Render("{% for k in d %}{{ k }}{% endfor %}", R"({"d": {"x": 1, "y": 2}})"), "xy");
  EXPECT_EQ(Render("{% for c in 'héé' %}[{{ c }}]{% endfor %}"), "[h][é][é]");
  EXPECT_EQ(
      Render("{% for x in xs %}{{ loop.cycle('a', 'b') }}{% endfor %}", R"({"xs": [1, 2, 3]})"),
      "aba");
  EXPECT_EQ(Render("{% for i in range(3) %}{{ i }}{% endfor %}{% for i in range(5, 1, -2) %}"
                   "{{ i }}{% endfor %}"),
            "01253");
}

TEST(ChatTemplateTest, BreakAndContinue) {
  EXPECT_EQ(Render("{% for x in range(10) %}{% if x == 4 %}{% break %}{% endif %}"
                   "{% if x is even %}{% continue %}{% endif %}{{ x }}{% endfor %}"),
            "13");
}

TEST(ChatTemplateTest, SetScopingAndNamespace) {
  // A for loop has its own scope; a namespace carries values out of it.
  EXPECT_EQ(Render("{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{% endfor %}{{ x }}"), "1");
  EXPECT_EQ(Render("{% set ns = namespace(x=1, y='a') %}{% for i in [1, 2] %}"
                   "{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}{{ ns.y }}"),
            "4a");
  EXPECT_EQ(Render("{% if true %}{% set x = 5 %}{% endif %}{{ x }}"), "5");
  EXPECT_EQ(Render("{% set block %}in {{ 'side' }}{% endset %}[{{ block }}]"), "[in side]");
  EXPECT_EQ(Render("{% set t | upper %}  shout {% endset %}[{{ t }}]"), "[  SHOUT ]");
  EXPECT_EQ(Render("{% set a = 1, 2 %}{{ a }}"), "(1, 2)");
  EXPECT_EQ(Render("{% set s = 'x' %}{% set s.y = 1 %}"),
            "RENDER ERROR: line 1: cannot assign attribute on non-namespace object");
}

TEST(ChatTemplateTest, Macros) {
  EXPECT_EQ(Render("{% macro greet(name, greeting='Hi') %}{{ greeting }}, {{ name }}!{% endmacro %}"
                   "{{ greet('Ann') }} {{ greet('Bob', greeting='Yo') }} {{ greet(name='Cy') }}"),
            "Hi, Ann! Yo, Bob! Hi, Cy!");
  EXPECT_EQ(Render("{% set g = 'outer' %}{% macro m() %}{{ g }}{% endmacro %}{{ m() }}"), "outer");
  EXPECT_THAT(Render("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}"),
              HasSubstr("takes not more than 1 argument"));
}

TEST(ChatTemplateTest, FilterBlocksAndGeneration) {
  EXPECT_EQ(Render("{% filter upper %}abc {{ 'd' }}{% endfilter %}"), "ABC D");
  EXPECT_EQ(Render("{% generation %}kept{% set hidden = 1 %}{% endgeneration %}{{ hidden }}"),
            "kept");
}

TEST(ChatTemplateTest, AttributesSubscriptsAndSlices) {
  const std::string context =
      R"({"m": {"role": "user", "content": "hello", "items": 3}, "xs": [1, 2, 3, 4]})";
  EXPECT_EQ(Render("{{ m.role }} {{ m['content'] }} {{ m.missing }}|", context), "user hello |");
  EXPECT_EQ(
      Render("{{ xs[0] }} {{ xs[-1] }} {{ xs[1:3] }} {{ xs[::-1] }} {{ xs[::2] }} {{ xs[9] }}|",
             context),
      "1 4 [2, 3] [4, 3, 2, 1] [1, 3] |");
  EXPECT_EQ(Render("{{ m.content[1:] }} {{ m.content[::-1] }} {{ m.content[-2:] }}", context),
            "ello olleh lo");
  EXPECT_EQ(Render("{{ 'héllo'[1] }}{{ 'héllo'[:2] }}"), "éhé");
  // Dict methods come before keys with `.`, keys before methods with [].
  EXPECT_EQ(Render("{{ m['items'] }}", context), "3");
  EXPECT_EQ(Render("{{ m.get('role') }} {{ m.get('nope', 'dflt') }} {{ m.get('nope') }}", context),
            "user dflt None");
  EXPECT_EQ(Render("{{ m.keys() | list }} {{ m.values() | list | length }}", context),
            "['role', 'content', 'items'] 3");
}

TEST(ChatTemplateTest, Comparisons) {
  EXPECT_EQ(
      Render("{{ 1 < 2 < 3 }} {{ 1 == 1.0 }} {{ 'a' != 'b' }} {{ 'b' >= 'a' }} {{ true == 1 }}"),
      "True True True True True");
  EXPECT_EQ(Render("{{ 'ell' in 'hello' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} "
                   "{{ 3 not in [1] }} {{ not 'x' in 'y' }}"),
            "True True True True True");
  EXPECT_EQ(
      Render("{{ [1, 2] == [1, 2] }} {{ {'a': 1} == {'a': 1} }} {{ x == none }}", R"({"x": null})"),
      "True True True");
}

TEST(ChatTemplateTest, Tests) {
  const std::string context =
      R"({"s": "x", "n": null, "d": {}, "l": [], "i": 3, "f": 1.5, "b": true})";
  EXPECT_EQ(Render("{{ s is defined }}{{ u is defined }}{{ u is undefined }}{{ n is none }}"
                   "{{ s is string }}{{ d is mapping }}{{ l is mapping }}",
                   context),
            "TrueFalseTrueTrueTrueTrueFalse");
  EXPECT_EQ(Render("{{ l is iterable }}{{ s is iterable }}{{ i is iterable }}{{ l is sequence }}"
                   "{{ d is sequence }}{{ u is iterable }}",
                   context),
            "TrueTrueFalseTrueTrueTrue");
  EXPECT_EQ(Render("{{ i is number }}{{ f is number }}{{ b is number }}{{ s is number }}"
                   "{{ i is integer }}{{ f is float }}{{ b is boolean }}{{ i is boolean }}",
                   context),
            "TrueTrueTrueFalseTrueTrueTrueFalse");
  EXPECT_EQ(Render("{{ b is true }}{{ b is false }}{{ i is true }}{{ i is odd }}{{ i is even }}"
                   "{{ 9 is divisibleby 3 }}{{ 9 is divisibleby(2) }}{{ n is not none }}",
                   context),
            "TrueFalseFalseTrueFalseTrueFalseFalse");
  EXPECT_EQ(Render("{{ i is eq 3 }}{{ i is ge 4 }}{{ 2 is in [1, 2] }}", context), "TrueFalseTrue");
}

TEST(ChatTemplateTest, StringMethods) {
  EXPECT_EQ(Render("[{{ '  a b  '.strip() }}][{{ 'xxaxx'.strip('x') }}][{{ '\\n a'.lstrip() }}]"
                   "[{{ 'a \\n'.rstrip() }}][{{ 'a\\n\\n'.rstrip('\\n') }}]"),
            "[a b][a][a][a][a]");
  EXPECT_EQ(Render("{{ 'a b  c'.split() }} {{ 'a,b,,c'.split(',') }} {{ 'a,b,c'.split(',', 1) }} "
                   "{{ 'a,b,c'.rsplit(',', 1) }}"),
            "['a', 'b', 'c'] ['a', 'b', '', 'c'] ['a', 'b,c'] ['a,b', 'c']");
  EXPECT_EQ(Render("{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith('bc') }}{{ "
                   "'abc'.startswith(('x', 'a')) }}"),
            "TrueTrueTrue");
  EXPECT_EQ(Render("{{ 'aBc'.upper() }} {{ 'aBc'.lower() }} {{ 'hello wORLD'.title() }} "
                   "{{ 'hello World'.capitalize() }} {{ 'a-a'.replace('a', 'b') }}"),
            "ABC abc Hello World Hello world b-b");
  EXPECT_EQ(Render("{{ '{} and {name}'.format(1, name='x') }} {{ ', '.join(['a', 'b']) }}"),
            "1 and x a, b");
  EXPECT_EQ(Render("{{ 'x' .split('</think>')[-1] }}"), "x");
}

TEST(ChatTemplateTest, Filters) {
  EXPECT_EQ(
      Render("[{{ '  x  ' | trim }}][{{ 'xx' | length }}][{{ [1, 2] | count }}][{{ 'aB' | upper }}]"
             "[{{ 'aB' | lower }}][{{ 'hello wORLD' | title }}][{{ 'hELLO' | capitalize }}]"),
      "[x][2][2][AB][ab][Hello World][Hello]");
  EXPECT_EQ(
      Render("{{ 'a-b-c' | replace('-', '+') }} {{ ['a', 'b'] | join(', ') }} {{ [1, 2] | join }}"),
      "a+b+c a, b 12");
  EXPECT_EQ(
      Render(
          "{{ [3, 1, 2] | first }}{{ [3, 1, 2] | last }}{{ [3, 1, 2] | sort }}"
          "{{ [3, 1, 2] | sort(reverse=true) }}{{ [1, 2] | reverse | list }}{{ 'ab' | reverse }}"),
      "32[1, 2, 3][3, 2, 1][2, 1]ba");
  EXPECT_EQ(Render("{{ u | default('d') }} {{ '' | default('d') }} {{ '' | d('d', true) }}"),
            "d  d");
  EXPECT_EQ(Render("{{ 'ab' | list }} {{ {'a': 1} | items | list }} {{ [1, 1, 2, 'A', 'a'] | "
                   "unique | list }}"),
            "['a', 'b'] [('a', 1)] [1, 2, 'A']");
  const std::string people =
      R"({"p": [{"name": "a", "age": 3, "ok": true}, {"name": "b", "age": 1, "ok": false}]})";
  EXPECT_EQ(
      Render(
          "{{ p | map(attribute='name') | join(',') }} {{ p | selectattr('ok') | list | length }} "
          "{{ p | rejectattr('ok') | map(attribute='name') | first }} "
          "{{ p | selectattr('age', 'equalto', 1) | map(attribute='name') | list }} "
          "{{ p | sort(attribute='age') | map(attribute='name') | join }} {{ p | "
          "sum(attribute='age') }}",
          people),
      "a,b 1 b ['b'] ba 4");
  EXPECT_EQ(Render("{{ [1, 2, 3] | select('odd') | list }} {{ [1, 2, 3] | reject('odd') | list }} "
                   "{{ ['1', '2'] | map('int') | sum }}"),
            "[1, 3] [2] 3");
  EXPECT_EQ(
      Render("{{ 1 | string }}{{ '42' | int }}{{ 'x' | int }}{{ '2.5' | float }}{{ 3 | float }}"
             "{{ -3 | abs }}{{ 2.5 | round }}{{ 3.14159 | round(2) }}{{ 7 | round }}"),
      "14202.53.032.03.147");
  EXPECT_EQ(Render("{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(2, true) }}"),
            "a\n  b\n\n  c|  a\n  b");
  EXPECT_EQ(Render("{{ '<a>' | safe }} {{ '<a & \"b\">' | e }}"),
            "<a> &lt;a &amp; &#34;b&#34;&gt;");
  EXPECT_EQ(Render("{{ {'b': 1, 'a': 2} | dictsort }} {{ [1, 2, 3] | batch(2) | list }} "
                   "{{ 'one two, three' | wordcount }}"),
            "[('a', 2), ('b', 1)] [[1, 2], [3]] 3");
}

TEST(ChatTemplateTest, ToJsonAsTransformersDefinesIt) {
  const std::string context =
      R"({"t": {"name": "f", "desc": "héllo \"q\" <b>", "n": [1, 2.5, 1e-07, true, null], "e": {}}})";
  EXPECT_EQ(
      Render("{{ t | tojson }}", context),
      R"({"name": "f", "desc": "héllo \"q\" <b>", "n": [1, 2.5, 1e-07, true, null], "e": {}})");
  EXPECT_EQ(Render("{{ t | tojson(indent=2) }}", R"({"t": {"a": [1, {}], "b": []}})"),
            "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": []\n}");
  EXPECT_EQ(Render("{{ t | tojson(separators=(',', ':')) }}", R"({"t": {"a": [1, 2]}})"),
            R"({"a":[1,2]})");
  EXPECT_EQ(Render("{{ t | tojson(sort_keys=true) }}", R"({"t": {"b": 1, "a": "\n\u0001"}})"),
            R"({"a": "\n\u0001", "b": 1})");
  // Positional arguments in transformers' order: ensure_ascii, indent, separators, sort_keys.
  EXPECT_EQ(Render("{{ t | tojson(ensure_ascii=true) }}|{{ t | tojson(false, 1) }}",
                   R"({"t": {"k": "é😀\u007f"}})"),
            "{\"k\": \"\\u00e9\\ud83d\\ude00\\u007f\"}|{\n \"k\": \"é😀\x7f\"\n}");
}

TEST(ChatTemplateTest, UndefinedFollowsJinja2) {
  EXPECT_EQ(Render("[{{ missing }}][{{ missing | length }}][{{ missing | trim }}]"
                   "[{% for x in missing %}x{% endfor %}][{{ missing ~ 'a' }}]"),
            "[][0][][][a]");
  EXPECT_EQ(Render("{{ m.nope is defined }}{{ n.nope is defined }}", R"({"m": {}, "n": null})"),
            "FalseFalse");
  EXPECT_EQ(Render("{{ missing.attr }}"), "RENDER ERROR: line 1: 'missing' is undefined");
  EXPECT_EQ(Render("{{ m.a.b }}", R"({"m": {}})"),
            "RENDER ERROR: line 1: 'dict object' has no attribute 'a'");
  EXPECT_THAT(Render("{{ missing + 1 }}"), HasSubstr("'missing' is undefined"));
  EXPECT_THAT(Render("{{ nothing() }}"), HasSubstr("'nothing' is undefined"));
}

TEST(ChatTemplateTest, RaiseExceptionMessageComesBackAsIs) {
  absl::Status status = RenderStatus(
      "{% if messages[0].role != 'user' %}{{ raise_exception('Roles must alternate!') }}{% endif "
      "%}",
      R"({"messages": [{"role": "assistant"}]})");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "Roles must alternate!");
}

TEST(ChatTemplateTest, TypeErrorsAreInvalidArgument) {
  absl::Status status = RenderStatus("\n{{ 'a' + 1 }}");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "line 2: can only concatenate str (not \"int\") to str");
  EXPECT_THAT(RenderStatus("{% for x in n %}{% endfor %}", R"({"n": null})").message(),
              HasSubstr("'NoneType' object is not iterable"));
  EXPECT_THAT(RenderStatus("{{ 1 // 0 }}").message(), HasSubstr("division or modulo by zero"));
  EXPECT_THAT(RenderStatus("{{ [1] < 'a' }}").message(), HasSubstr("'<' not supported"));
  EXPECT_THAT(RenderStatus("{{ xs.append(1) }}", R"({"xs": []})").message(), HasSubstr("unsafe"));
}

TEST(ChatTemplateTest, StrftimeNowUsesTheClock) {
  absl::StatusOr<ChatTemplate> parsed = ChatTemplate::Parse("{{ strftime_now('%d %b %Y') }}");
  ASSERT_TRUE(parsed.ok());
  parsed->SetClock([] {
    std::tm t{};
    t.tm_year = 124;
    t.tm_mon = 6;
    t.tm_mday = 26;
    return t;
  });
  EXPECT_EQ(*parsed->Render(nlohmann::json::object()), "26 Jul 2024");
}

TEST(ChatTemplateTest, UnsupportedConstructsAreRefusedAtParse) {
  struct Case {
    const char* source;
    const char* message;
  };
  const Case cases[] = {
      {"{% extends 'base' %}", "line 1: the '{% extends %}' statement is not supported"},
      {"x\n{% include 'other' %}", "line 2: the '{% include %}' statement is not supported"},
      {"{% call m() %}{% endcall %}", "the '{% call %}' statement is not supported"},
      {"{% for x in y recursive %}{% endfor %}", "recursive for loops are not supported"},
      {"{{ x | nosuchfilter }}", "line 1: the filter 'nosuchfilter' is not supported"},
      {"{% if x is nosuchtest %}{% endif %}", "the test 'nosuchtest' is not supported"},
      {"{{ f(*args) }}", "'*' and '**' arguments are not supported"},
      {"{% if x %}", "unexpected end of template; expected '{% endif %}'"},
      {"{{ x ", "line 1: '{{' without '}}'"},
      {"{{ 'open }}", "unterminated string literal"},
      {"{% break %}", "'break' outside a for loop"},
      {"{{ x y }}", "expected '}}', found 'y'"},
  };
  for (const Case& c : cases) {
    absl::Status status = ParseStatus(c.source);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.source;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message)) << c.source;
  }
}

TEST(ChatTemplateTest, ContextMustBeAnObject) {
  absl::StatusOr<ChatTemplate> parsed = ChatTemplate::Parse("x");
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed->Render(nlohmann::json::array()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplateTest, SortedJsonContextRendersLikeOrdered) {
  absl::StatusOr<ChatTemplate> parsed = ChatTemplate::Parse("{{ d | tojson }}");
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(*parsed->Render(nlohmann::json::parse(R"({"d": {"b": 1, "a": 2}})")),
            R"({"a": 2, "b": 1})");
}

TEST(ChatTemplateTest, ChatMlTemplate) {
  const char* source =
      "{%- for message in messages %}\n"
      "    {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' "
      "}}\n"
      "{%- endfor %}\n"
      "{%- if add_generation_prompt %}\n"
      "    {{- '<|im_start|>assistant\\n' }}\n"
      "{%- endif %}\n";
  EXPECT_EQ(Render(source, R"({"messages": [{"role": "user", "content": " hi "}],
                               "add_generation_prompt": true})"),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
}

std::string Repeat(std::string_view piece, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += piece;
  return out;
}

TEST(ChatTemplateDepthTest, ParenthesesNestedPastTheBoundFailAtParse) {
  // Four levels of the parser's recursion a pair: 60 pairs fit under 256, 100,000 do not.
  EXPECT_EQ(Render("{{ " + Repeat("(", 60) + "1" + Repeat(")", 60) + " }}"), "1");
  const absl::Status deep =
      ParseStatus("{{ " + Repeat("(", 100000) + "1" + Repeat(")", 100000) + " }}");
  EXPECT_EQ(deep.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(deep.message(), HasSubstr("deeper than 256 levels"));
  EXPECT_FALSE(ParseStatus("{{ " + Repeat("[", 100000) + Repeat("]", 100000) + " }}").ok());
  EXPECT_FALSE(ParseStatus("{{ " + Repeat("not ", 100000) + "x }}").ok());
  EXPECT_FALSE(ParseStatus("{{ " + Repeat("-", 100000) + "1 }}").ok());
}

TEST(ChatTemplateDepthTest, BlocksNestedPastTheBoundFailAtParse) {
  EXPECT_EQ(Render(Repeat("{% if true %}", 100) + "x" + Repeat("{% endif %}", 100)), "x");
  const absl::Status deep =
      ParseStatus(Repeat("{% if true %}", 100000) + "x" + Repeat("{% endif %}", 100000));
  EXPECT_THAT(deep.message(), HasSubstr("deeper than 256 levels"));
}

TEST(ChatTemplateDepthTest, LongChainsFailAtParseWithoutOverflowingTheStack) {
  // A chain deepens the tree without deepening the parser's recursion; it is refused after the
  // parse and destroyed without recursion.
  EXPECT_EQ(Render("{{ 1" + Repeat(" + 1", 200) + " }}"), "201");
  for (const std::string& chain :
       {"{{ 1" + Repeat(" + 1", 100000) + " }}", "{{ x" + Repeat("|string", 100000) + " }}",
        "{{ x" + Repeat(".a", 100000) + " }}", "{{ x" + Repeat("[0]", 100000) + " }}"}) {
    const absl::Status deep = ParseStatus(chain);
    EXPECT_EQ(deep.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(deep.message(), HasSubstr("an expression nests deeper than 256 levels"));
  }
}

TEST(ChatTemplateDepthTest, MacroRecursingWithoutEndFailsNamingIt) {
  const std::string tmpl = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
  EXPECT_THAT(RenderStatus(tmpl).message(),
              HasSubstr("macro 'f': macro calls nest deeper than 128 levels"));
  // Recursion that ends within the bound renders.
  EXPECT_EQ(Render("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}{{ n }}{% endmacro %}"
                   "{{ f(100) | length }}"),
            "193");
}

TEST(ChatTemplateDepthTest, NestedLoopsThatWouldRunMillionsOfStatementsFailNamingTheBound) {
  std::string tmpl;
  for (int i = 0; i < 20; ++i) tmpl += "{% for i in [1, 2] %}";
  tmpl += "{{ i }}";
  for (int i = 0; i < 20; ++i) tmpl += "{% endfor %}";
  EXPECT_THAT(RenderStatus(tmpl).message(), HasSubstr("more than 200000 statements"));
  // 2^12 iterations are far within it.
  std::string small;
  for (int i = 0; i < 12; ++i) small += "{% for i in [1, 2] %}";
  small += "{{ i }}";
  for (int i = 0; i < 12; ++i) small += "{% endfor %}";
  EXPECT_EQ(Render(small).size(), 4096u);
}

TEST(ChatTemplateDepthTest, AValueBuiltDeeperThanTojsonWalksFailsInsteadOfOverflowing) {
  const std::string deep_json =
      "{% set ns = namespace(v=0) %}{% for i in range(1000) %}{% set ns.v = [ns.v] %}{% endfor %}"
      "{{ ns.v | tojson }}";
  EXPECT_THAT(Render(deep_json), HasSubstr("tojson: the value nests deeper than 256 levels"));
}

}  // namespace
}  // namespace tandem
