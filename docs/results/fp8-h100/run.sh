#!/usr/bin/env bash
# FP8 (E4M3) linear weights on one GPU, from the repository root, with binaries already built and
# packed (scripts/gpu-check build -> .carry-pack/): the GPU suites of the FP8 kernels and of the
# CUDA stage with FP8 weights (plus the fp16 suites they sit beside), then tandem-bench fp16
# against FP8 (quantized at load, --quantization fp8) in the same call, two rounds each, for
# llama3.1-8b and openllama-3b at batch 1 and 64 (prompt 128, 128 new tokens, f16 activations).
# Results to $OUT: device.txt, tests.log, bench.md, bench-*.json.
set -u
cd "$(dirname "$0")/../../.."
out=${OUT:-/tmp/tandem-fp8}
mkdir -p "$out"
export PACK=${PACK:-.carry-pack}
source scripts/carry-unpack
source scripts/gpu-require
bin=$PWD/.carry/bin
lib=$PWD/.carry/lib
models=/tmp/tandem-models
rc=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
export TANDEM_TEST_TMPDIR=/tmp/tandem-gpu-tests
mkdir -p "$TANDEM_TEST_TMPDIR"
for t in ${TESTS-fp8_kernels_test cuda_stage_fp8_test cuda_kernels_test cuda_stage_test weight_upload_test}; do
  echo "== $t" | tee -a "$out/tests.log"
  "$bin/$t" > "/tmp/$t.log" 2>&1
  st=$?
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]' "/tmp/$t.log" | tee -a "$out/tests.log"
  [ "$st" -eq 0 ] || { rc=1; grep -B5 -E '^\[  FAILED' "/tmp/$t.log" | head -60 >> "$out/tests.log"; }
  if ! why=$(gpu_tests_ran "/tmp/$t.log" "$t"); then echo "$why" | tee -a "$out/tests.log"; rc=1; fi
done
for m in ${MODELS-llama3.1-8b openllama-3b}; do
  [ -f "$models/$m/config.json" ] ||
    "$bin/tandem-make-model" --preset "$m" --dtype f16 --seed 1 --out "$models/$m" > /dev/null || { rc=1; continue; }
  for round in 1 2; do
    for q in none fp8; do
      flag=""; [ "$q" = fp8 ] && flag="--quantization=fp8"
      echo "== $m weights $q round $round" | tee -a "$out/bench.md"
      LD_LIBRARY_PATH=$lib:/usr/local/cuda/lib64 "$bin/tandem-bench" --model "$models/$m" \
        --batch 1,64 --prompt 128 --new_tokens 128 --dtype f16 $flag \
        --json "$out/bench-$m-$q-$round.json" 2>&1 | tee -a "$out/bench.md" |
        grep -E 'tok/s|batch|linear weights' | head -20
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
  done
done
exit $rc
