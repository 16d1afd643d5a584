#!/usr/bin/env bash
# The FP8 tensor-core GEMM (worker/cuda/fp8_gemm.*) on one GPU, from the repository root, with the
# binaries that `BINS="fp8_kernels_test cuda_stage_fp8_test tandem-bench tandem-make-model
# tandem-coordinator tandem-worker" PACK=.carry-pack-fp8 scripts/gpu-check build` packs and
# .acc-data (tools/accuracy/prepare_text.sh) carried: the FP8 kernel and stage suites; tandem-bench
# fp16 against FP8 weights on the llama3.1-8b shape (batch 1 and 64, prompt 128, 128 new tokens;
# then one prompt of 8,192); the accuracy model trained and scored by HF and through tandem in
# fp16 and FP8 (tools/accuracy). Results to $OUT: tests.log, bench.md, bench-*.json, summary.txt.
set -u
cd "$(dirname "$0")/../../.."
source docs/results/gpu-lib.sh
gpu_setup /tmp/tandem-fp8-gemm .carry-pack-fp8
TEST_EXTRA='FP8 GEMM scales|Skipped$' gpu_tests 120 fp8_kernels_test cuda_stage_fp8_test
m=llama3.1-8b
gpu_model "$m"
for q in none fp8; do
  flag=""; [ "$q" = fp8 ] && flag="--quantization=fp8"
  for shape in "1,64 128 128 decode" "1 8192 1 prefill"; do
    read -r batch prompt new name <<< "$shape"
    echo "== $m weights $q $name (batch $batch, prompt $prompt)" | tee -a "$out/bench.md"
    timeout 150 "$bin/tandem-bench" --model "$models/$m" --batch "$batch" --prompt "$prompt" \
      --new_tokens "$new" --dtype f16 $flag --json "$out/bench-$q-$name.json" >> "$out/bench.md" 2>&1 || rc=1
  done
done
echo "bench done at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
work=/tmp/tandem-acc-work
mkdir -p "$work"
DATA=.acc-data OUT=$work tools/accuracy/run_gpu.sh > "$work/run_gpu.log" 2>&1 || rc=1
DATA=.acc-data OUT=$work BIN=$bin tools/accuracy/run_tandem.sh > "$work/run_tandem.log" 2>&1 || rc=1
echo "accuracy done at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
for f in "$work"/hf_*sdpa.json "$work"/tandem_*.json; do
  [ -f "$f" ] && { echo "$f"; cat "$f"; echo; } >> "$out/summary.txt"
done
tail -5 "$work/run_tandem.log" >> "$out/summary.txt"
exit $rc
