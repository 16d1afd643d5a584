#!/usr/bin/env bash
# After a restructuring of the engine and the worker, on one GPU, from the repository root: the
# GPU test suites of the new build, tandem-bench of the previous build (OLD_PACK) against the new
# one (PACK) in the same call (openllama-3b at batch 1 and 64, llama3.1-8b at batch 1; prompt 128,
# 128 new tokens, f16), and the service's greedy tokens against the engine's
# (same-tokens.sh, 24 prompts). Results to $OUT: device.txt, tests.log, bench.md, same-tokens.md.
set -u
cd "$(dirname "$0")/../../.."
out=${OUT:-/tmp/tandem-restructure}
mkdir -p "$out"
export PACK=${PACK:-.carry-pack}
old_pack=${OLD_PACK:-.carry-pack-old}
source scripts/carry-unpack
source scripts/gpu-require
bin=$PWD/.carry/bin
old=/tmp/tandem-old
rm -rf "$old" && mkdir -p "$old" && tar -C "$old" -xJf "$old_pack/carry.tar.xz" || exit 1
models=/tmp/tandem-models
rc=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
export TANDEM_TEST_TMPDIR=/tmp/tandem-gpu-tests
mkdir -p "$TANDEM_TEST_TMPDIR"
for t in ${TESTS-cuda_kernels_test cuda_stage_test weight_upload_test prefill_attention_test cuda_sampling_test}; do
  echo "== $t" | tee -a "$out/tests.log"
  "$bin/$t" > "/tmp/$t.log" 2>&1
  st=$?
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]' "/tmp/$t.log" | tee -a "$out/tests.log"
  [ "$st" -eq 0 ] || { rc=1; grep -B5 -E '^\[  FAILED' "/tmp/$t.log" | head -60 >> "$out/tests.log"; }
  if ! why=$(gpu_tests_ran "/tmp/$t.log" "$t"); then echo "$why" | tee -a "$out/tests.log"; rc=1; fi
done
for m in ${MODELS-openllama-3b llama3.1-8b}; do
  [ -f "$models/$m/config.json" ] ||
    "$bin/tandem-make-model" --preset "$m" --dtype f16 --seed 1 --out "$models/$m" > /dev/null || { rc=1; continue; }
  batches=1,64; [ "$m" = llama3.1-8b ] && batches=1
  for round in 1 2; do
    for which in old new; do
      b=$bin; lib=$PWD/.carry/lib
      [ "$which" = old ] && b=$old/bin && lib=$old/lib
      echo "== $m $which round $round" | tee -a "$out/bench.md"
      LD_LIBRARY_PATH=$lib:/usr/local/cuda/lib64 "$b/tandem-bench" --model "$models/$m" \
        --batch "$batches" --prompt 128 --new_tokens 128 --dtype f16 2>&1 | tee -a "$out/bench.md" |
        grep -E 'tok/s|batch' | head -20
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
  done
done
OUT=$out/same-tokens docs/results/service-h100/same-tokens.sh > "$out/same-tokens.md" 2>&1 || rc=1
tail -5 "$out/same-tokens.md"
exit $rc
