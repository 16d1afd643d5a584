#!/usr/bin/env bash
# The CUDA stage on a paged KV-cache on one GPU, from the repository root, with binaries built for
# sm_90 and packed into $PACK/carry.tar.xz by scripts/gpu-check: the GPU suites of the
# paged stage, the paged kernels and the CUDA stage, the paged attention kernels against the
# contiguous ones, then tandem-bench on the llama3.1-8b shape (random weights) with contiguous
# slots and pages of 16 and 64 in one call. Results to $OUT: device.txt, tests.log,
# paged-attention.md, bench.md, bench-*.json.
set -u
cd "$(dirname "$0")/../../.."
source docs/results/gpu-lib.sh
gpu_setup /tmp/tandem-paged-cuda .carry-pack
# shellcheck disable=SC2086
gpu_tests 120 ${TESTS-cuda_stage_paged_test kv_pages_test cuda_stage_test}
timeout 150 "$bin/tandem-paged-attention-bench" --iters 10 > "$out/paged-attention.md" 2>&1 || rc=1
for m in ${MODELS-llama3.1-8b}; do
  [ -f "$models/$m/config.json" ] ||
    "$bin/tandem-make-model" --preset "$m" --dtype f16 --seed 1 --out "$models/$m" > /dev/null || { rc=1; continue; }
  echo "== $m" | tee -a "$out/bench.md"
  timeout 200 "$bin/tandem-bench" --model "$models/$m" --batch 1,64 --prompt ${PROMPTS-128,1024} \
    --new_tokens 128 --dtype f16 --kv_page_size 0,16,64 --json "$out/bench-$m.json" \
    >> "$out/bench.md" 2>&1 || rc=1
done
exit $rc
