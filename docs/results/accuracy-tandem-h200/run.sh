#!/usr/bin/env bash
# Made the results in this folder, on one nvidia-h200, from the repository root, with
# .carry-pack/carry.tar.xz carried (bin/, each that is there: the stripped tandem-coordinator, tandem-worker,
# cuda_stage_prompt_test, cuda_sampling_test, and cuda_stage_prompt_test_bug_piece, the prompt
# test built with a planted bug that must fail; lib/: their bundled libraries; acc-data/ or
# .acc-data carried: what tools/accuracy/prepare_text.sh made): the GPU tests of prompt logprobs on the CUDA stage, then
# the accuracy study's model trained and scored by HF (tools/accuracy/run_gpu.sh) and through
# tandem with fp16 and FP8 weights (tools/accuracy/run_tandem.sh). Writes $OUT/summary.txt and
# $OUT/logs.tgz (every log and result).
set -u
cd "$(dirname "$0")/../../.."
out=${OUT:-/tmp/tandem-acc-tandem}
work=/tmp/tandem-acc-work
mkdir -p "$out" "$work"
PACK=.carry-pack source scripts/carry-unpack
export TANDEM_TEST_TMPDIR=/tmp/tandem-gpu-tests
mkdir -p "$TANDEM_TEST_TMPDIR"
data=.acc-data
[ -d .carry/acc-data ] && data=.carry/acc-data
t0=$SECONDS
for t in cuda_stage_prompt_test cuda_sampling_test cuda_stage_prompt_test_bug_piece; do
  [ -x ".carry/bin/$t" ] || continue
  timeout 120 ".carry/bin/$t" > "$work/$t.log" 2>&1
  echo "$t exit $?: $(grep -c '^\[       OK' "$work/$t.log") ok, $(grep -c '^\[  FAILED  \].*ms)' "$work/$t.log") failed" \
    | tee -a "$out/summary.txt"
done
echo "tests done at $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
DATA=$data OUT=$work tools/accuracy/run_gpu.sh > "$work/run_gpu.log" 2>&1
echo "trained and scored by HF at $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
DATA=$data OUT=$work BIN=$PWD/.carry/bin tools/accuracy/run_tandem.sh \
  > "$work/run_tandem.log" 2>&1
echo "scored through tandem at $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
for f in "$work"/hf_*sdpa.json "$work"/hf_*eager.json "$work"/tandem_*.json; do
  [ -f "$f" ] && { cat "$f"; echo; } >> "$out/summary.txt"
done
tar -C "$work" --exclude=hf_tokens.json -czf "$out/logs.tgz" .
