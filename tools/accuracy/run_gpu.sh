#!/usr/bin/env bash
# On the GPU machine, from the repository root: trains the accuracy study's model from the text
# prepare_text.sh made (DATA, default .acc-data) and scores it with Hugging Face transformers
# (fp16 and bf16, sdpa; fp16 eager for the implementations' own drift). Results to $OUT:
# train.log, train.json, hf_*.json; the model stays in MODEL (default /tmp/tandem-acc-model).
set -euo pipefail
cd "$(dirname "$0")/../.."
data=${DATA:-.acc-data}
model=${MODEL:-/tmp/tandem-acc-model}
out=${OUT:-/tmp/tandem-acc}
mkdir -p "$out"
here=tools/accuracy
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/device.txt"
python3 "$here/train.py" --data "$data" --out "$model" --steps "${STEPS:-400}" 2>&1 | tee "$out/train.log"
cp "$model/train.json" "$model/config.json" "$out/"
for run in "float16 sdpa" "bfloat16 sdpa" "float16 eager"; do
  set -- $run
  python3 "$here/perplexity_hf.py" --model "$model" --heldout "$data/heldout.txt" --dtype "$1" \
    --attn "$2" --out "$out/hf_$1_$2.json" 2>&1 | tail -1
done
