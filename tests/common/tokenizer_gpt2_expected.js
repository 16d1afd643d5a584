// Encodes every line of the tokenizer corpus, and blocks of lines as multi-line texts, with GPT-2's
// JavaScript encoder (npm gpt-3-encoder) and writes the token ids as JSON:
//   {"package_version": "...", "lines": [[ids of line 1], ...], "blocks": [[ids], ...]}
// Lines are the file split on "\n", without a final empty line; the file must be UTF-8. Block k is
// lines BLOCK*k .. BLOCK*k+BLOCK-1, each followed by "\n". (Not the whole file at once: the
// package's encode() concatenates arrays per pre-token, quadratic in the length of the text.)
// Usage: node tokenizer_gpt2_expected.js <gpt-3-encoder dir> <corpus.txt> <out.json>
'use strict';
const fs = require('fs');
const path = require('path');

const [pkgDir, corpusPath, outPath] = process.argv.slice(2);
if (!outPath) {
  console.error('usage: node tokenizer_gpt2_expected.js <gpt-3-encoder dir> <corpus> <out.json>');
  process.exit(2);
}
const { encode } = require(path.resolve(pkgDir));
const version = JSON.parse(fs.readFileSync(path.join(pkgDir, 'package.json'), 'utf8')).version;

// fatal: a corpus that is not UTF-8 would be read with U+FFFD replacements, which our tokenizer
// would not see; refuse it instead.
const text = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true }).decode(fs.readFileSync(corpusPath));
const lines = text.split('\n');
if (lines.length > 0 && lines[lines.length - 1] === '') lines.pop();

const BLOCK = 10;
const blocks = [];
for (let i = 0; i < lines.length; i += BLOCK) {
  blocks.push(encode(lines.slice(i, i + BLOCK).map((line) => line + '\n').join('')));
}
const out = { package_version: version, block_lines: BLOCK, lines: lines.map((line) => encode(line)), blocks };
// encode() yields undefined for a token missing from encoder.json; JSON writes it as null and the
// comparison reports it.
fs.writeFileSync(outPath, JSON.stringify(out));
console.log(`gpt-3-encoder ${version}: encoded ${lines.length} lines and ${blocks.length} ` +
            `blocks of ${BLOCK} lines`);
