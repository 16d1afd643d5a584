#!/usr/bin/env bash
# Made the results in this folder, on one nvidia-h200, from the repository root, with .acc-data
# (tools/accuracy/prepare_text.sh) and .carry-pack/carry.tar.xz (the stripped binaries named below
# and their bundled libraries) carried: the GPU tests of prompt logprobs on the CUDA stage (and
# two builds of that test with a planted bug each, which must fail), then the accuracy study's
# model trained and scored by HF (tools/accuracy/run_gpu.sh) and through tandem with fp16 and FP8
# weights (tools/accuracy/run_tandem.sh). Logs and results to $OUT.
set -u
cd "$(dirname "$0")/../../.."
out=${OUT:-/tmp/tandem-acc-tandem}
mkdir -p "$out"
PACK=.carry-pack source scripts/carry-unpack
export TANDEM_TEST_TMPDIR=/tmp/tandem-gpu-tests
mkdir -p "$TANDEM_TEST_TMPDIR"
t0=$SECONDS
for t in cuda_stage_prompt_test cuda_sampling_test cuda_stage_prompt_test_bug_next \
         cuda_stage_prompt_test_bug_piece; do
  timeout 120 ".carry/bin/$t" > "$out/$t.log" 2>&1
  echo "$t exit $? ($(grep -c '^\[       OK' "$out/$t.log") ok, $(grep -c '^\[  FAILED  \]' "$out/$t.log") failed lines)" \
    | tee -a "$out/summary.txt"
done
echo "tests done at $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
OUT=$out tools/accuracy/run_gpu.sh > "$out/run_gpu.log" 2>&1
echo "trained and scored by HF at $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
OUT=$out BIN=$PWD/.carry/bin tools/accuracy/run_tandem.sh > "$out/run_tandem.log" 2>&1
echo "scored through tandem at $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
cat "$out"/hf_*.json "$out"/tandem_*.json >> "$out/summary.txt" 2>/dev/null
