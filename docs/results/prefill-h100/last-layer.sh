#!/usr/bin/env bash
# Runs on the GPU machine (one H100), from the repository root, after
# `PACK=... scripts/gpu-check` packed the binaries: a prompt pass's last layer for the sampled rows
# only against every row through it (the option that chose between them,
# CudaOptions::last_layer_sampled_rows_only, has since been removed with the every-row pass, so
# the A/B below now needs the tree of the recorded run; see git log). cuda_stage_test;
# tandem's prefill against HF transformers (scripts/prefill-vs-hf) at 1 x 8192 on the llama3.1-8b
# shape and at the openllama-3b shapes; tandem-bench with the option off and on, alternated, at
# the same shapes; prefill logits against HF at 8,191 and 2,047 tokens (compare_gpu.py); decode
# of openllama-3b at batch 1 and 64 (must not move). Output in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-/tmp/tandem-gpu-out}
mkdir -p "$out"
source scripts/carry-unpack
bin=$PWD/.carry/bin
rc=0
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv | tee "$out/gpu.txt"
TANDEM_TEST_TMPDIR=/tmp "$bin/cuda_stage_test" > "$out/cuda_stage_test.txt" 2>&1 || rc=1
grep -E '^\[  (PASSED|FAILED) |FAILED  \]' "$out/cuda_stage_test.txt"
MAX_POSITIONS=16384 OUT=$out scripts/prefill-vs-hf llama3.1-8b "1x8192" || rc=1
OUT=$out scripts/prefill-vs-hf openllama-3b "64x128 1x2048 4x2048" || rc=1
ab() {  # model batches prompt: tandem-bench's prefill rows, the option off then on, twice
  for round in 1 2; do
    for flag in false true; do
      echo "last_layer_sampled_rows_only=$flag round $round: $(
        "$bin/tandem-bench" --model "$1" --batch "$2" --prompt "$3" --new_tokens 1 \
          --last_layer_sampled_rows_only=$flag 2>&1 | grep -E '^\| [0-9]' | paste -sd' ')"
    done
  done
}
{
  ab /tmp/tandem-models/llama3.1-8b-16384 1 8192
  ab /tmp/tandem-models/openllama-3b 64 128
  ab /tmp/tandem-models/openllama-3b 1,4 2048
} | tee "$out/ab.txt"
for m in llama3.1-8b-16384:8191 openllama-3b:2047; do
  python3 tests/reference/compare_gpu.py --model "/tmp/tandem-models/${m%%:*}" --bench "$bin/tandem-bench" \
    --prompts 1 --steps 1 --lengths "${m##*:}" 2>&1 | tail -3 | tee -a "$out/compare.txt" || rc=1
done
"$bin/tandem-bench" --model /tmp/tandem-models/openllama-3b --batch 1,64 --prompt 128 \
  --new_tokens 128 2>&1 | grep -E '^\| [0-9]' | tee "$out/decode.txt"
exit $rc
