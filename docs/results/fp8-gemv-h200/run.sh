#!/usr/bin/env bash
# The FP8 GEMV with 16 codes per lane (worker/cuda/gemv.cu) on one GPU, from the repository root,
# with the binaries that `BINS="kv_pages_test cuda_kernels_test cuda_stage_paged_test
# fp8_kernels_test cuda_stage_fp8_test tandem-bench tandem-make-model" PACK=.carry-pack-gemv
# scripts/gpu-check build` packs: the GPU suites named in TESTS; the GEMV sweep of FP8 weights
# (8 and 16 codes per lane, every launch shape) at 1 row; tandem-bench fp16 against FP8 weights
# (batch 1 and 64, prompt 128, 128 new tokens) for MODELS. Results to $OUT.
set -u
cd "$(dirname "$0")/../../.."
source docs/results/gpu-lib.sh
gpu_setup /tmp/tandem-fp8-gemv .carry-pack-gemv
# shellcheck disable=SC2086
gpu_tests 200 ${TESTS-kv_pages_test cuda_kernels_test cuda_stage_paged_test fp8_kernels_test cuda_stage_fp8_test}
for m in ${MODELS-llama3.1-8b openllama-3b}; do
  gpu_model "$m"
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
