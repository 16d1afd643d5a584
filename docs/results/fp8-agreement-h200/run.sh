#!/usr/bin/env bash
# Next-token agreement of the FP8 precisions with fp16 on the llama3.1-8b shape (random weights,
# one GPU), from the repository root, with the binaries that `BINS="tandem-bench tandem-make-model
# <the TESTS>" PACK=.carry-pack-agree scripts/gpu-check build` packs: the GPU suites in TESTS
# first, then `tandem-bench --agreement` for bf16, FP8 weights, the FP8 KV-cache, and both, each
# against fp16 weights and an fp16 KV-cache in the same process (PROMPTS prompts of the lengths
# LENGTHS, STEPS decode steps each, fed the fp16 stage's greedy tokens). Results to $OUT.
set -u
cd "$(dirname "$0")/../../.."
source docs/results/gpu-lib.sh
gpu_setup /tmp/tandem-fp8-agreement .carry-pack-agree
# shellcheck disable=SC2086
gpu_tests 240 ${TESTS-fp8_kernels_test kv_pages_test cuda_stage_fp8_test}
m=${MODEL:-llama3.1-8b}
gpu_model "$m"
# bf16 weights and KV-cache against fp16 first: the drift of a precision everyone serves in, as a
# scale for FP8's on random weights (whose 32 untrained layers compound every rounding).
# PRECISIONS: others, separated by ';'.
precisions=("--test_dtype=bf16" "--quantization=fp8" "--kv_cache_dtype=fp8"
            "--quantization=fp8 --kv_cache_dtype=fp8")
[ -n "${PRECISIONS:-}" ] && IFS=';' read -r -a precisions <<< "$PRECISIONS"
for precision in "${precisions[@]}"; do
  echo "== $m $precision" | tee -a "$out/agreement.md"
  # shellcheck disable=SC2086
  timeout 300 "$bin/tandem-bench" --model "$models/$m" --dtype f16 --agreement "${PROMPTS:-16}" \
    --prompt "${LENGTHS:-128,512,2048}" --new_tokens "$((${STEPS:-32} + 1))" $precision \
    2>&1 | tee -a "$out/agreement.md"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  echo "done at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
done
exit $rc
