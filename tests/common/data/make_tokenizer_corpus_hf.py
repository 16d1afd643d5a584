#!/usr/bin/env python3
"""Writes tokenizer_corpus_hf.txt: the lines tokenizer_hf_test adds to tokenizer_corpus.txt when
it compares our tokenizer.json reader with Hugging Face's tokenizers: more scripts, code, digit
runs, emoji sequences, control characters, special tokens of the tested families inside text,
and bytes that are not UTF-8. Hand-picked lines first, then seeded mixtures of them and of
tokenizer_corpus.txt's generator; the output is the same on every run.
Usage: make_tokenizer_corpus_hf.py > tokenizer_corpus_hf.txt"""
import random
import sys

import make_tokenizer_corpus as base

# Text lines (no '\n'); '\r' only mid-line.
HAND = [
    # Scripts.
    "\u0627\u0644\u0633\u0644\u0627\u0645 \u0639\u0644\u064a\u0643\u0645 \u0648\u0631\u062d\u0645\u0629 \u0627\u0644\u0644\u0647",
    "\u0627\u0644\u0639\u0631\u0628\u064a\u0629: \u0661\u0662\u0663 \u0648 123",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd, \u05de\u05d4 \u05e9\u05dc\u05d5\u05de\u05da?",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e, \u0906\u092a \u0915\u0948\u0938\u0947 \u0939\u0948\u0902?",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a \u0e22\u0e34\u0e19\u0e14\u0e35\u0e15\u0e49\u0e2d\u0e19\u0e23\u0e31\u0e1a",
    "\u0bb5\u0ba3\u0b95\u0bcd\u0b95\u0bae\u0bcd \u0b89\u0bb2\u0b95\u0bae\u0bcd",
    "\u10d2\u10d0\u10db\u10d0\u10e0\u10ef\u10dd\u10d1\u10d0 \u10e1\u10d0\u10e5\u10d0\u10e0\u10d7\u10d5\u10d4\u10da\u10dd",
    "\u0532\u0561\u0580\u0565\u0582 \u0561\u0577\u056d\u0561\u0580\u0570",
    "\u1230\u120b\u121d \u12a0\u1208\u121d",
    "\u179f\u17bd\u179f\u17d2\u178f\u17b8 \u1796\u17b7\u1797\u1796\u179b\u17c4\u1780",
    "\u1019\u1004\u103a\u1039\u1002\u101c\u102c\u1015\u102b",
    "\u0f56\u0f40\u0fb2\u0f0b\u0f64\u0f72\u0f66\u0f0b\u0f56\u0f51\u0f7a\u0f0b\u0f63\u0f7a\u0f42\u0f66\u0f0d",
    "\u0421\u044a\u0435\u0448\u044c \u0436\u0435 \u0435\u0449\u0451 \u044d\u0442\u0438\u0445 \u043c\u044f\u0433\u043a\u0438\u0445 \u0444\u0440\u0430\u043d\u0446\u0443\u0437\u0441\u043a\u0438\u0445 \u0431\u0443\u043b\u043e\u043a",
    "\u0396\u03b5\u03cd\u03b3\u03bf\u03c2 \u03bc\u03c0\u03b1\u03c1\u03bc\u03c0\u03bf\u03cd\u03bd\u03b9\u03b1 \u039f\u0394\u03a5\u03a3\u03a3\u0395\u03a5\u03a3",
    "Vi\u1ec7t Nam \u0111\u1eb9p l\u1eafm, ti\u1ebfng Vi\u1ec7t c\u00f3 d\u1ea5u",
    "T\u00fcrk\u00e7e \u0131\u015f\u0131k \u0130STANBUL \u011f\u00fc\u015f",
    "\u4eca\u65e5\u306f\u3044\u3044\u5929\u6c17\u3067\u3059\u306d\u3002\u660e\u65e5\u3082\u6674\u308c\u308b\u3067\u3057\u3087\u3046\u304b\uff1f",
    "\u6211\u7231\u5317\u4eac\u5929\u5b89\u95e8\uff0c\u5929\u5b89\u95e8\u4e0a\u592a\u9633\u5347\u3002",
    "\ud55c\uad6d\uc5b4\ub294 \uc870\uc0ac\uac00 \ub9ce\uc2b5\ub2c8\ub2e4. \uadf8\ub798\uc694?",
    "\U00020000\U0002a6d6 CJK extension B",
    "\u1100\u1161\u11a8 conjoining jamo",
    # Emoji.
    "\U0001f600\U0001f603\U0001f604 smileys",
    "family \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 and \U0001f9d1\U0001f3fd\u200d\U0001f4bb",
    "flags \U0001f1fa\U0001f1f8\U0001f1ef\U0001f1f5\U0001f1e9\U0001f1ea keycap 1\ufe0f\u20e3",
    "\u2764\ufe0f\u2728\U0001f525\U0001f44d\U0001f3fb\U0001f44d\U0001f3ff",
    "\U0001f3f3\ufe0f\u200d\U0001f308 rainbow flag",
    # Code.
    "def f(x: int) -> int:\treturn x ** 2 + 3 * x - 1  # comment",
    "    if (a && b || !c) { return a->b[i++]; }",
    "for (int i = 0; i < n; ++i) sum += v[i] * w[i];",
    "#include <vector>  // std::vector<std::pair<int, float>>",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC;",
    "<div class=\"main\"><a href=\"https://example.com/?q=1&r=2\">link</a></div>",
    "{\"key\": [1, 2.5, -3e10, true, null], \"nested\": {\"a\": \"b\"}}",
    "git commit -m 'fix: handle   spaces' && ./build.sh --jobs=2 2>&1 | tee log.txt",
    "lambda x: [y for y in range(10) if y % 2 == 0]",
    "x=1;y=2;z=x+y;print(f\"{z:08.3f}\")",
    "        deeply    indented\t\ttabs",
    "fn main() { println!(\"Hello, {}!\", name); }",
    "$ echo $HOME ~/.bashrc /usr/local/bin:$PATH",
    "a_b_c __dunder__ camelCaseName snake_case_name SCREAMING_CASE",
    # Digits.
    "1", "12", "123", "1234", "12345", "123456", "1234567", "12345678901234567890",
    "(hello", "((((nested))))", "3.14159 2.71828 1.41421", "0.000001 1e-12 6.02e+23",
    "10,000,000 and 1.000.000,00", "2024/12/31 23:59:59.999", "v1.2.3-beta.4+build.5",
    "\uff10\uff11\uff12\uff13 fullwidth", "\u2070\u00b9\u00b2\u00b3 superscript \u2080\u2081\u2082 subscript",
    # Whitespace runs and line ends mid-line.
    "a  b   c    d     e", "tab\t\t\ttab", "cr\rcr\r\rcr", "mixed \t \r \t end",
    "        ", "\t\t\t\t", " \u00a0 \u2003 \u3000 ", "trailing\t \t",
    "nbsp\u00a0\u00a0\u00a0run", "em\u2003space and en\u2002space",
    # Control characters (C0 except LF, DEL, C1) and format characters.
    "nul\x00byte", "bell\x07 backspace\x08 escape\x1b[31mred\x1b[0m", "unit\x1fsep record\x1esep",
    "del\x7fchar", "c1 \x80\x85\x9f controls", "soft\u00adhyphen", "zero\u200cwidth\u200dnon-joiner",
    "lrm\u200e rlm\u200f bidi \u202aembed\u202c", "bom\ufeff at \ufeffstart", "\ufeff",
    "replacement \ufffd char", "private \ue000\uf8ff use", "noncharacter \ufdd0 \uffff",
    # Contractions and case.
    "I'M YOU'RE WE'VE THEY'LL HE'D IT'S DON'T", "She'S He'Ll We'Ve", "it\u2019S curly",
    "\u017fs long s and 's", "Ma\u00dfe STRASSE \u1e9e",
]

# Special tokens of the families under test, and near misses, placed inside text.
SPECIALS = [
    "<|endoftext|>", "<s>", "</s>", "<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>",
    "<think>", "</think>", "<tool_call>", "<|reserved_special_token_5|>", "<|vision_pad|>",
    "<|endoftext", "<s >", "< s>", "<|im_start", "|>", "<<s>>", "<|<|endoftext|>|>",
]

TEMPLATES = [
    "{t}", "{t}{t}", "Hello {t} world", "Hello{t}world", "text {t}", "{t} text", " {t} ",
    "  {t}  ", "a\t{t}\tb", "{t}\u00e9t\u00e9", "\u4f60\u597d{t}\u4e16\u754c", "1{t}2", "x {t}{t} y",
]

# Byte strings that are not UTF-8 (each is put inside text): stray continuation bytes, bytes
# never used, overlong forms, surrogates, beyond U+10FFFF, truncated sequences.
INVALID = [
    b"\x80", b"\xbf", b"\xff", b"\xfe", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80",
    b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xc3",
    b"\xe2\x82", b"\xf0\x9f\x98", b"\xe2\x82\xe2\x82\xac", b"\xf0\x9f\x98\x80\x80",
]


def main():
    rng = random.Random(20251124)
    lines = [line.encode("utf-8") for line in HAND]
    for t in SPECIALS:
        for tmpl in rng.sample(TEMPLATES, 5):
            lines.append(tmpl.format(t=t).encode("utf-8"))
    for bad in INVALID:
        for tmpl in ["{b}", "a{b}b", "caf\u00e9{b}", "{b}{b} x", "\u4e2d{b}\u6587", "  {b}  ", "12{b}34"]:
            lines.append(bad.join(part.encode("utf-8") for part in tmpl.split("{b}")))
    pool = HAND + base.HAND
    for _ in range(2000):
        parts = []
        for _ in range(rng.randint(2, 6)):
            r = rng.random()
            if r < 0.45:
                parts.append(rng.choice(pool))
            elif r < 0.75:
                parts.append(base.sentence(rng))
            elif r < 0.9:
                parts.append(rng.choice(SPECIALS))
            else:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 15))))
        sep = rng.choice(base.SEPARATORS + ["", "\t", "\r", "  \t"])
        line = sep.join(parts).encode("utf-8")
        if rng.random() < 0.05:
            bad = rng.choice(INVALID)
            at = rng.randrange(len(line) + 1)
            line = line[:at] + bad + line[at:]
        lines.append(line)
    # Long runs: one repeated letter, digits, spaces, and a long word of mixed scripts.
    lines += [b"a" * 300, b"9" * 301, b" " * 257 + b"x", ("\u00e9" * 150).encode("utf-8"),
              ("ab\u4e2d1 " * 60).encode("utf-8")]
    for line in lines:
        assert b"\n" not in line and not line.endswith(b"\r"), repr(line)
    sys.stdout.buffer.write(b"".join(line + b"\n" for line in lines))


if __name__ == "__main__":
    main()
