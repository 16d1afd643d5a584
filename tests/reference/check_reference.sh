#!/usr/bin/env bash
# Regenerates each reference checkpoint from its preset and seed, checks that it is byte-identical
# to the one Hugging Face transformers was run on (sha256 in the fixture), then checks the CPU
# engine against the fixture's logits and greedy tokens. A model of models.txt whose fixture has not
# been made yet (make_fixtures.sh, on a machine with torch) is skipped, saying so; at least one
# must run.
# usage: check_reference.sh MAKE_MODEL REFERENCE_TEST SOURCE_DIR WORK_DIR
set -euo pipefail
make_model=$1 reference_test=$2 src=$3 work=$4
mkdir -p "$work"
checked=0
while read -r name preset seed flags; do
  fixture="$src/fixtures/hf_${name}.json"
  if [ ! -f "$fixture" ]; then
    echo "$name: no fixture $fixture yet (make it with make_fixtures.sh); skipped"
    continue
  fi
  rm -rf "${work:?}/$name"
  # shellcheck disable=SC2086  # $flags: tandem-make-model overrides, one word each
  "$make_model" --preset "$preset" --seed "$seed" $flags --out "$work/$name" >/dev/null
  want=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["sha256"]["model.safetensors"])' "$fixture")
  got=$(sha256sum "$work/$name/model.safetensors" | cut -d' ' -f1)
  if [ "$want" != "$got" ]; then
    echo "$name: regenerated checkpoint differs from the reference's (sha256 $got, want $want)"
    exit 1
  fi
  echo "$name: checkpoint sha256 matches the reference ($got)"
  TANDEM_REFERENCE_FIXTURE="$fixture" TANDEM_REFERENCE_MODEL="$work/$name" "$reference_test"
  checked=$((checked + 1))
done < <(grep -v '^#' "$src/models.txt")
[ "$checked" -gt 0 ] || { echo "no fixture found in $src/fixtures"; exit 1; }
