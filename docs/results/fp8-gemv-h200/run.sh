#!/usr/bin/env bash
# The FP8 GEMV with 16 codes per lane (worker/cuda/gemv.cu) on one GPU, from the repository root,
# with the binaries that `BINS="kv_pages_test cuda_kernels_test cuda_stage_paged_test
# fp8_kernels_test cuda_stage_fp8_test tandem-bench tandem-make-model" PACK=.carry-pack-gemv
# scripts/gpu-check build` packs: the GPU suites named in TESTS; the GEMV sweep of FP8 weights
# (8 and 16 codes per lane, every launch shape) at 1 row; tandem-bench fp16 against FP8 weights
# (batch 1 and 64, prompt 128, 128 new tokens) for MODELS. Results to $OUT.
set -u
cd "$(dirname "$0")/../../.."
out=${OUT:-/tmp/tandem-fp8-gemv}
mkdir -p "$out"
export PACK=${PACK:-.carry-pack-gemv}
source scripts/carry-unpack
bin=$PWD/.carry/bin
models=/tmp/tandem-models
rc=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
export TANDEM_TEST_TMPDIR=/tmp/tandem-gpu-tests
mkdir -p "$TANDEM_TEST_TMPDIR"
t0=$SECONDS
for t in ${TESTS-kv_pages_test cuda_kernels_test cuda_stage_paged_test fp8_kernels_test cuda_stage_fp8_test}; do
  echo "== $t" | tee -a "$out/tests.log"
  timeout 200 "$bin/$t" > "/tmp/$t.log" 2>&1
  st=$?
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]' "/tmp/$t.log" | tee -a "$out/tests.log"
  [ "$st" -eq 0 ] || { rc=1; grep -B12 -E '^\[  FAILED' "/tmp/$t.log" | head -80 >> "$out/tests.log"; }
done
echo "tests done at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
for m in ${MODELS-llama3.1-8b openllama-3b}; do
  [ -f "$models/$m/config.json" ] ||
    "$bin/tandem-make-model" --preset "$m" --dtype f16 --seed 1 --out "$models/$m" > /dev/null || rc=1
  if [ "${SWEEP:-true}" = true ]; then
    echo "== $m GEMV sweep, FP8 weights, 1 row" | tee -a "$out/sweep.md"
    timeout 120 "$bin/tandem-bench" --model "$models/$m" --gemv_sweep --batch 1 --dtype f16 \
      --quantization fp8 --json "$out/sweep-$m.json" >> "$out/sweep.md" 2>&1 || rc=1
  fi
  for q in none fp8; do
    flag=""; [ "$q" = fp8 ] && flag="--quantization=fp8"
    echo "== $m weights $q decode (batch 1,64, prompt 128)" | tee -a "$out/bench.md"
    timeout 150 "$bin/tandem-bench" --model "$models/$m" --batch 1,64 --prompt 128 \
      --new_tokens 128 --dtype f16 $flag ${BENCH_FLAGS:-} --json "$out/bench-$m-$q.json" >> "$out/bench.md" 2>&1 || rc=1
  done
done
echo "bench done at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
exit $rc
