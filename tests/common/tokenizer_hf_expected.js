// Encodes and decodes corpus lines with Hugging Face's tokenizers (npm `tokenizers`, the Rust
// library's Node binding) and writes what it got as JSON:
//   {"version": "...", "block_lines": B,
//    "lines":  [{"a": ids with special tokens, "n": ids without,
//                "d": decode(a), "s": decode(a, skip_special_tokens)}, ...],
//    "blocks": [same for blocks of B lines, each line followed by "\n"]}
// Lines are the corpus files' bytes split on "\n" (no final empty line), each made text by
// WHATWG's UTF-8 decoder (ill-formed bytes become U+FFFD), which is what any caller of the
// library hands it.
// Usage: node tokenizer_hf_expected.js <tokenizers dir> <tokenizer.json> <out.json> <corpus>...
'use strict';
const fs = require('fs');
const path = require('path');

const [pkgDir, tokenizerJson, outPath, ...corpora] = process.argv.slice(2);
if (corpora.length === 0) {
  console.error('usage: node tokenizer_hf_expected.js <tokenizers dir> <tokenizer.json> <out.json> <corpus>...');
  process.exit(2);
}
const { Tokenizer } = require(path.resolve(pkgDir));
const version = JSON.parse(fs.readFileSync(path.join(pkgDir, 'package.json'), 'utf8')).version;
const tokenizer = Tokenizer.fromFile(tokenizerJson);

const decoder = new TextDecoder('utf-8', { fatal: false, ignoreBOM: true });
const lines = [];
for (const corpus of corpora) {
  const bytes = fs.readFileSync(corpus);
  let start = 0;
  for (let i = 0; i < bytes.length; ++i) {
    if (bytes[i] === 0x0a) {
      lines.push(decoder.decode(bytes.subarray(start, i)));
      start = i + 1;
    }
  }
  if (start < bytes.length) lines.push(decoder.decode(bytes.subarray(start)));
}
const BLOCK = 10;
const blocks = [];
for (let i = 0; i < lines.length; i += BLOCK) {
  blocks.push(lines.slice(i, i + BLOCK).map((line) => line + '\n').join(''));
}

async function run(texts) {
  const withSpecial = await tokenizer.encodeBatch(texts, { addSpecialTokens: true });
  const without = await tokenizer.encodeBatch(texts, { addSpecialTokens: false });
  const a = withSpecial.map((e) => e.getIds());
  const n = without.map((e) => e.getIds());
  const d = await tokenizer.decodeBatch(a, false);
  const s = await tokenizer.decodeBatch(a, true);
  return a.map((ids, i) => ({ a: ids, n: n[i], d: d[i], s: s[i] }));
}

(async () => {
  const out = { version, block_lines: BLOCK, lines: await run(lines), blocks: await run(blocks) };
  fs.writeFileSync(outPath, JSON.stringify(out));
  console.log(`tokenizers ${version}: ${path.basename(path.dirname(path.dirname(tokenizerJson)))} ` +
              `encoded ${lines.length} lines and ${blocks.length} blocks of ${BLOCK} lines`);
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
