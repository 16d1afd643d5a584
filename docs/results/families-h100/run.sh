#!/usr/bin/env bash
# Made the results in this folder, on an nvidia-h100-x1 machine, from the repository root, with the
# binaries that `PACK=.carry-pack-main scripts/gpu-check build-gpu-main` packs: the CUDA tests
# (gtest summaries), then the model families against HF transformers in fp16 (checkpoints of the
# real widths cut to 4 layers, bf16 as published; Mistral with a window of 32 so that most prompts
# and decode steps attend through it). Writes tests.txt, one JSON and log per model and device.txt
# to $OUT.
# Environment: PACK (default .carry-pack-main); FAMILIES (default: all four); TESTS (default: all).
set -u
cd "$(dirname "$0")/../../.."
export PACK=${PACK:-.carry-pack-main}
out=${OUT:-/tmp/tandem-families-out}
mkdir -p "$out"
source scripts/carry-unpack
bin=$PWD/.carry/bin
export TANDEM_TEST_TMPDIR=/tmp/tandem-gpu-tests && mkdir -p "$TANDEM_TEST_TMPDIR"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$out/device.txt"
t0=$SECONDS
for t in ${TESTS-cuda_kernels_test cuda_stage_test cuda_sampling_test weight_upload_test prefill_attention_test}; do
  "$bin/$t" --gtest_brief=1 > "$out/$t.log" 2>&1
  echo "$t exit $? $(grep -E '^\[  (PASSED|FAILED) ' "$out/$t.log" | tr '\n' ' ')" | tee -a "$out/tests.txt"
done
echo "tests took $((SECONDS - t0)) s" | tee -a "$out/device.txt"
for m in ${FAMILIES-llama3.1-8b llama3.2-1b mistral-7b qwen2.5-7b}; do
  dir=/tmp/tandem-models/fam-$m
  extra=()
  [ "$m" = mistral-7b ] && extra=(--sliding_window=32)
  [ -f "$dir/config.json" ] || "$bin/tandem-make-model" --preset="$m" --num_layers=4 \
      --max_positions=4096 --dtype=bf16 --seed=1 "${extra[@]}" --out="$dir" > /dev/null
  timeout 300 python3 tests/reference/compare_gpu.py --model "$dir" --bench "$bin/tandem-bench" \
    --dtype float16 --json "$out/$m.json" > "$out/$m.log" 2>&1
  echo "$m exit $? after $((SECONDS - t0)) s: $(tail -3 "$out/$m.log" | tr '\n' ' ')" | tee -a "$out/device.txt"
done
