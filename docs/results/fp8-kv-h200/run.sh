#!/usr/bin/env bash
# The FP8 KV-cache on the CUDA backend (one GPU), from the repository root, with the binaries that
# `BINS="kv_pages_test cuda_stage_paged_test cuda_stage_test cuda_stage_fp8_test
# cuda_stage_prompt_test tandem-bench tandem-paged-attention-bench tandem-make-model"
# PACK=.carry-pack-kv8 scripts/gpu-check build` packs: the GPU suites in TESTS; decode attention
# through pages of fp16 and of FP8 codes alone (tandem-paged-attention-bench, 8B shape); and
# tandem-bench on the llama3.1-8b shape with the fp16 and the FP8 KV-cache (pages of 16) at
# batch 1 and 64 and prompts of 1,024 and 4,096 (PROMPTS); with ACCURACY=true (tandem-coordinator
# and tandem-worker packed too, .acc-data carried) the accuracy study's perplexities with the FP8
# KV-cache. Results to $OUT.
set -u
cd "$(dirname "$0")/../../.."
source docs/results/gpu-lib.sh
gpu_setup /tmp/tandem-fp8-kv .carry-pack-kv8
# shellcheck disable=SC2086
TEST_EXTRA='relative error at most' gpu_tests 240 \
  ${TESTS-kv_pages_test cuda_stage_paged_test cuda_stage_fp8_test cuda_stage_prompt_test cuda_stage_test}
if [ "${ATTENTION:-true}" = true ]; then
  timeout 200 "$bin/tandem-paged-attention-bench" --prefill=false --contexts 2048,8192 \
    --batches 1,64 > "$out/attention.md" 2>&1 || rc=1
  timeout 200 "$bin/tandem-paged-attention-bench" --contexts 4096 --batches 1 \
    > "$out/attention-prefill.md" 2>&1 || rc=1
fi
m=llama3.1-8b
gpu_model "$m"
for prompt in ${PROMPTS:-1024 4096}; do
  for kv in auto fp8; do
    echo "== $m KV-cache $kv (batch 1,64, prompt $prompt)" | tee -a "$out/bench.md"
    timeout 200 "$bin/tandem-bench" --model "$models/$m" --batch 1,64 --prompt "$prompt" \
      --new_tokens 128 --dtype f16 --kv_cache_dtype "$kv" ${BENCH_FLAGS:-} \
      --json "$out/bench-$kv-$prompt.json" >> "$out/bench.md" 2>&1 || rc=1
  done
done
echo "bench done at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
if [ "${ACCURACY:-false}" = true ]; then
  # The accuracy study's model trained afresh (tools/accuracy, .acc-data carried), scored by HF
  # and through tandem: fp16, FP8 weights, and each with the FP8 KV-cache.
  work=/tmp/tandem-acc-work
  mkdir -p "$work"
  DATA=.acc-data OUT=$work tools/accuracy/run_gpu.sh > "$work/run_gpu.log" 2>&1 || rc=1
  echo "trained at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
  DATA=.acc-data OUT=$work BIN=$bin tools/accuracy/run_tandem.sh > "$work/run_tandem.log" 2>&1 || rc=1
  echo "accuracy done at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
  for f in "$work"/hf_*.json "$work"/tandem_*.json; do
    [ -f "$f" ] && { echo "$f"; cat "$f"; echo; } >> "$out/summary.txt"
  done
  tail -8 "$work/run_tandem.log" >> "$out/summary.txt"
  grep -h "KV-cache" "$work"/worker_*.log | head -8 >> "$out/summary.txt"
fi
exit $rc
