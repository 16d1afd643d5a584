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
out=${OUT:-/tmp/tandem-fp8-gemm}
mkdir -p "$out"
export PACK=${PACK:-.carry-pack-fp8}
source scripts/carry-unpack
bin=$PWD/.carry/bin
models=/tmp/tandem-models
rc=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
export TANDEM_TEST_TMPDIR=/tmp/tandem-gpu-tests
mkdir -p "$TANDEM_TEST_TMPDIR"
t0=$SECONDS
for t in fp8_kernels_test cuda_stage_fp8_test; do
  echo "== $t" | tee -a "$out/tests.log"
  timeout 120 "$bin/$t" > "/tmp/$t.log" 2>&1
  st=$?
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]' "/tmp/$t.log" | tee -a "$out/tests.log"
  grep -E -A1 'FP8 GEMM scales|Skipped$' "/tmp/$t.log" | head -6 | tee -a "$out/tests.log"
  [ "$st" -eq 0 ] || { rc=1; grep -B12 -E '^\[  FAILED' "/tmp/$t.log" | head -80 >> "$out/tests.log"; }
done
m=llama3.1-8b
[ -f "$models/$m/config.json" ] ||
  "$bin/tandem-make-model" --preset "$m" --dtype f16 --seed 1 --out "$models/$m" > /dev/null || rc=1
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
