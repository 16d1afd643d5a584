#!/usr/bin/env bash
# Makes the Hugging Face reference fixtures of models.txt, on a machine with torch and
# transformers (the GPU machine): regenerates each checkpoint with tandem-make-model from its
# preset, seed and overrides, and runs hf_reference.py on it in fp32 on the CPU with prompts.json.
# usage: make_fixtures.sh MAKE_MODEL OUT_DIR [NAME...]   (default: every model of models.txt)
# Writes OUT_DIR/hf_NAME.json, to be copied into tests/reference/fixtures/.
set -euo pipefail
make_model=$1 out=$2
shift 2
src=$(cd "$(dirname "$0")" && pwd)
work=${TMPDIR:-/tmp}/tandem-fixture-models
mkdir -p "$out" "$work"
grep -v '^#' "$src/models.txt" | while read -r name preset seed flags; do
  if [ $# -gt 0 ] && [[ " $* " != *" $name "* ]]; then continue; fi
  rm -rf "${work:?}/$name"
  # shellcheck disable=SC2086  # $flags: tandem-make-model overrides, one word each
  "$make_model" --preset "$preset" --seed "$seed" $flags --out "$work/$name" >/dev/null
  python3 "$src/hf_reference.py" --model "$work/$name" --prompts "$src/prompts.json" \
    --out "$out/hf_$name.json" --dtype float32 --device cpu
  echo "$name: $out/hf_$name.json"
done
