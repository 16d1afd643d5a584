#!/usr/bin/env python3
"""Writes tokenizer_corpus.txt: the lines tokenizer_gpt2_test encodes with GPT-2's JavaScript
encoder and with ours. Hand-picked lines first, then seeded mixtures of them; the output is the
same on every run. Usage: make_tokenizer_corpus.py > tokenizer_corpus.txt"""
import random
import sys

# Each entry is one line of text (no '\n'); '\r' only mid-line so that no tool reads CRLF.
HAND = [
    # Whitespace runs, tabs and the Unicode spaces JavaScript's \s does and does not include.
    "two  spaces", "three   spaces   here", "trailing spaces   ", "   leading spaces",
    "\tleading tab", "tab\tseparated\tvalues", "tabs\t\t\tand spaces \t \t mixed",
    "space before tab \tx", "tab before space\t x", "only\u00a0no-break\u00a0spaces",
    "no-break\u00a0 then space", "ideographic\u3000space", "thin\u2009space and hair\u200aspace",
    "zero\u200bwidth\u200bspace is not a space", "byte order mark \ufeffinside",
    "next line \u0085 is not a space in JavaScript", "vertical\vtab and form\ffeed",
    "carriage\rreturn mid-line", "line\u2028separator and paragraph\u2029separator",
    "ogham\u1680space mark", "narrow\u202fno-break and medium\u205fmath space", " ", "  ", "\t",
    "a \u00a0b", "x\u3000\u3000y", "end with tab\t", "end with nbsp\u00a0",
    # Digits and numbers.
    "1234567890", "3.14159265358979", "1,000,000 dollars", "2024-01-15T08:30:00Z", "0x1F 0b1010",
    "1e-9 and 6.022e23", "version 2.10.3-rc1", "phone: +1 (555) 012-3456", "ISBN 978-3-16-148410-0",
    "Arabic-Indic digits \u0663\u0664\u0665", "Devanagari digits \u0967\u0968\u0969",
    "fractions \u00bd \u00bc \u00be and superscripts x\u00b2 y\u00b3", "Roman \u216b and \u2167",
    "circled \u2460\u2461\u2462", "fullwidth \uff11\uff12\uff13", "99 bottles, 98 bottles, 97...",
    "a1b2c3d4", "H2O and CO2", "1st 2nd 3rd 4th", "100%", "$4.99", "\u20ac12,50", "-42", "+7",
    # Punctuation.
    "Hello, world!", "Wait... what?!", "No!!! Yes???", "em\u2014dash and en\u2013dash",
    "\u00abguillemets\u00bb", "\u201ccurly quotes\u201d and \u2018single\u2019", "(parens) [brackets] {braces}",
    "@#$%^&*", "~`|\\", "a/b\\c", "semi;colon:colon", "!!!", "???", "...", "--", "__init__",
    "#hashtag @mention", "C++ and C# and F#", "<angle> brackets", "key=value&other=thing",
    "\"double\" 'single' `back`", "\u00bfQu\u00e9? \u00a1S\u00ed!", "\u3002\u3001\u300c\u300d",
    # Contractions, upper and lower case.
    "It's a test.", "I'm here, you're there, we've been, they'll come, he'd know.",
    "IT'S LOUD. I'M HERE. YOU'RE THERE. WE'VE GONE. THEY'LL SEE. HE'D GO.",
    "She'S mixed Case'Ll", "don't can't won't shouldn't", "DON'T CAN'T WON'T",
    "'tis the season", "'s at the start", "rock 'n' roll", "the '90s", "O'Neil's pub",
    "students' books", "''quoted''", "it\u2019s a curly apostrophe", "y'all'd've",
    " 's leading space", "'S capital", "x's y'S z'll w'LL", "'re're", "'''s",
    # Accents and decomposed characters.
    "caf\u00e9 na\u00efve Z\u00fcrich S\u00e3o Paulo", "\u00c5ngstr\u00f6m fa\u00e7ade pi\u00f1ata",
    "Dvo\u0159\u00e1k \u0141\u00f3d\u017a cr\u00e8me br\u00fbl\u00e9e", "decomposed e\u0301 and a\u0308",
    "\u00c9COLE \u00c0 PARIS", "modifier letters p\u02b0 \u02c8stress \u1d43 \u02bcokina",
    "titlecase \u01c5 \u01c8 \u01cb and ligature \ufb01le", "\u30b9\u30fc\u30d1\u30fc\u30de\u30fc\u30b1\u30c3\u30c8",
    "\u4eba\u3005 \u6642\u3005", "circled letters \u24b6\u24b7 and \u00aa\u00ba ordinals", "stra\u00dfe STRASSE", "Ha\u010dek \u0161\u010d\u017e", "\u0131stanbul \u0130zmir",
    # CJK and other scripts.
    "\u4e2d\u6587\u5b57\u7b26", "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8", "\u6f22\u5b57\u3068\u3072\u3089\u304c\u306a",
    "\u30ab\u30bf\u30ab\u30ca", "\u4f60\u597d\uff0c\u4e16\u754c\uff01", "\u6771\u4eac 2024\u5e74",
    "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440", "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645", "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e", "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35",
    "\u1230\u120b\u121d", "Ti\u1ebfng Vi\u1ec7t", "\u10e5\u10d0\u10e0\u10d7\u10e3\u10da\u10d8",
    "\u0540\u0561\u0575\u0565\u0580\u0565\u0576", "\u0ba4\u0bae\u0bbf\u0bb4\u0bcd",
    "mixed English\u4e2d\u6587\u0420\u0443\u0441\u0441\u043a\u0438\u0439 and \u0627\u0644\u0639\u0631\u0628\u064a\u0629",
    # Emoji, with modifiers, ZWJ sequences, flags, variation selectors.
    "\U0001F44D", "\U0001F44D\U0001F3FD thumbs", "family \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466",
    "\U0001F3F3\ufe0f\u200d\U0001F308 flag", "\u2764\ufe0f love", "\U0001F1FA\U0001F1F8 \U0001F1EF\U0001F1F5",
    "\U0001F937\u200d\u2640\ufe0f shrug", "\U0001F600\U0001F603\U0001F604", "a\U0001F600b",
    " \U0001F680 rocket", "\U0001F9D1\U0001F3FB\u200d\U0001F4BB coder", "keycap 1\ufe0f\u20e3",
    # Code.
    "def f(x): return x**2", "for (int i = 0; i < n; ++i) {", "    if (a && b) return;",
    "console.log(`hi ${name}`);", "#include <stdio.h>", "SELECT * FROM t WHERE id=42;",
    "{\"a\": [1, 2, {\"b\": null}], \"c\": \"d\"}", "[[1,2],[3,4]]", "x => x + 1",
    "<div class=\"x\">hi</div>", "$ ls -la | grep foo > out.txt 2>&1", "re.compile(r'^\\s+(\\d+)$')",
    "\t\treturn self._cache[key]", "int main(int argc, char** argv) { return 0; }",
    "std::vector<std::pair<int, int>> v;", "fn main() -> Result<(), Box<dyn Error>> {",
    "    \"],\"\"},{\"", "a[i][j] += b[j][i] * 2.5f;", "// comment: TODO(x) fix", "/* block */",
    "if __name__ == '__main__':", "x = {'k': [1, 2, 3], \"v\": (4, 5)}", "</s><s>", "<|endoftext|>",
    "<|endoftext|> is text here", "print(\"<|endoftext|>\")",
    # URLs and addresses.
    "https://example.com/path?q=1&r=two#frag", "http://localhost:8080/", "mailto:someone@example.org",
    "ftp://files.example.org/pub/file.tar.gz", "www.example.co.uk", "https://en.wikipedia.org/wiki/Byte_pair_encoding",
    "git@github.com:user/repo.git", "192.168.0.1:443", "[2001:db8::1]:80", "C:\\Users\\name\\file.txt",
    "/usr/local/bin/python3", "user+tag@example.com",
    # Long runs.
    "a" * 300, "9" * 200, "!" * 150, " " * 40 + "x", "\u4e2d" * 100, "\U0001F600" * 50,
    "ab" * 120, "supercalifragilisticexpialidocious" * 5,
]

WORDS = ("the of and to in is it that was for on are with as I his they be at one have this "
         "from or had by hot word but what some we can out other were all there when up use "
         "your how said an each she which do their time if will way about many then them would "
         "write like so these her long make thing see him two has look more day could go come "
         "did number sound no most people my over know water than call first who may down side "
         "been now find any new work part take get place made live where after back little only "
         "round man year came show every good me give our under name very through just form "
         "sentence great think say help low line differ turn cause much mean before move right "
         "boy old too same tell does set three want air well also play small end put home read "
         "hand port large spell add even land here must big high such follow act why ask men "
         "change went light kind off need house picture try us again animal point mother world "
         "near build self earth father Tokenizer GPT encode decode BPE byte merge rank").split()

SEPARATORS = [" ", " ", " ", "  ", "\t", "", " \t ", "   ", "\u00a0", ", ", " - ", ". ", "; ",
              "\u3000", " \u00a0 ", "...", "/", "_"]


def sentence(rng):
    n = rng.randint(3, 14)
    words = [rng.choice(WORDS) for _ in range(n)]
    if rng.random() < 0.3:
        words[0] = words[0].capitalize()
    if rng.random() < 0.2:
        words[rng.randrange(n)] = rng.choice(["it's", "I'm", "we'll", "they've", "don't",
                                              "IT'S", "She'd", "YOU'RE", "o'clock", "'s"])
    if rng.random() < 0.2:
        words[rng.randrange(n)] = str(rng.randint(0, 10 ** rng.randint(1, 9)))
    return " ".join(words) + rng.choice([".", "!", "?", "", ":", "...", " ;)", "\u2026"])


def mixture(rng):
    parts = []
    for _ in range(rng.randint(2, 6)):
        parts.append(rng.choice(HAND) if rng.random() < 0.6 else sentence(rng))
        parts.append(rng.choice(SEPARATORS))
    line = "".join(parts[:-1])
    if rng.random() < 0.15:
        line = rng.choice([" ", "  ", "\t", "\u00a0"]) + line
    if rng.random() < 0.15:
        line += rng.choice([" ", "   ", "\t", "\u3000"])
    return line


def main():
    rng = random.Random(20240607)
    lines = list(HAND)
    lines += [sentence(rng) for _ in range(300)]
    lines += [mixture(rng) for _ in range(900)]
    for line in lines:
        assert "\n" not in line and not line.endswith("\r"), repr(line)
    sys.stdout.buffer.write("".join(line + "\n" for line in lines).encode("utf-8"))


if __name__ == "__main__":
    main()
