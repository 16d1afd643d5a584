#!/usr/bin/env bash
# The Qwen3 family against Hugging Face transformers, on one nvidia-h200, from the repository root,
# with the binaries that `BINS="tandem-bench tandem-make-model" PACK=.carry-pack-q3
# scripts/gpu-check build` packs:
# 1. the CPU reference fixtures of tiny-qwen3 and tiny-qwen3-tied (tests/reference/models.txt;
#    HF in fp32 on the CPU), written to $OUT for tests/reference/fixtures/;
# 2. the qwen3-8b shape cut to 4 layers (bf16 as published, random weights), tandem's CUDA stage
#    against HF in fp16 through tests/reference/compare_gpu.py (the families-h100 recipe).
set -u
cd "$(dirname "$0")/../../.."
export PACK=${PACK:-.carry-pack-q3}
out=${OUT:-/tmp/tandem-qwen3-out}
mkdir -p "$out"
source scripts/carry-unpack
bin=$PWD/.carry/bin
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$out/device.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' | tee -a "$out/device.txt"
bash tests/reference/make_fixtures.sh "$bin/tandem-make-model" "$out" tiny-qwen3 tiny-qwen3-tied 2>&1 | tail -3
for m in ${FAMILIES-qwen3-8b}; do
  dir=/tmp/tandem-models/fam-$m
  [ -f "$dir/config.json" ] || "$bin/tandem-make-model" --preset="$m" --num_layers=4 \
      --max_positions=4096 --dtype=bf16 --seed=1 --out="$dir" > /dev/null
  timeout 300 python3 tests/reference/compare_gpu.py --model "$dir" --bench "$bin/tandem-bench" \
    --dtype float16 --json "$out/$m.json" > "$out/$m.log" 2>&1
  echo "$m exit $?: $(tail -3 "$out/$m.log" | tr '\n' ' ')" | tee -a "$out/device.txt"
done
