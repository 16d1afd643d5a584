#!/usr/bin/env bash
# KV-cache over NCCL between two GPUs (nvidia-h100-x2), from the repository root, with the binaries
# that `scripts/gpu-check` packs: the KV link's tests and bandwidth
# (nccl_kv_link_test), the CUDA stage's device-memory export and import (cuda_stage_test), then
# with one worker per GPU, the openllama-3b shape: disaggregated prefill against colocated replicas
# (docs/results/disagg/run.sh: 2,048-token prompts all along, 64 decoding streams of 256 tokens at
# batch 16) and live re-partition of 64 running sequences between one and two stages
# (docs/results/kv-move/run.sh, --batch_invariant workers, so that its check compares every output
# with an undisturbed run's). Prints the tests' lines, the sweeps' tables and the moves' log lines;
# writes $OUT/kv-nccl.tar.gz (every log).
# Environment: PACK (default .carry-pack), KV_OVER_NCCL (true; false: the same over gRPC).
set -u
cd "$(dirname "$0")/../../.."
export PACK=${PACK:-.carry-pack}
out=${OUT:-/tmp/tandem-kv-nccl}
mkdir -p "$out"
source scripts/carry-unpack
source scripts/gpu-require
bin=$PWD/.carry/bin
work=$(mktemp -d)
nccl=--kv_over_nccl=${KV_OVER_NCCL:-true}
t0=$SECONDS
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
for t in "nccl_kv_link_test" "cuda_stage_test --gtest_filter=*Kv*"; do
  read -r name args <<< "$t"
  # shellcheck disable=SC2086
  timeout 150 "$bin/$name" $args > "$work/$name.log" 2>&1
  rc=$?
  why=$(gpu_tests_ran "$work/$name.log" "$name") || rc="$rc+skipped"
  echo "$name: rc=$rc: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ test' "$work/$name.log" |
    tr '\n' ' ') ${why:-}"
  grep -E '^\[  FAILED  \] [A-Z]|^KV link:' "$work/$name.log"
done
echo "tests done at $((SECONDS - t0)) s"
flags="--backend=cuda --dtype=f16 --kv_memory_fraction=0.4 $nccl"
OUT=$work/disagg BIN=carry PRESET=openllama-3b MAX_SLOTS=24 MAX_SEQ_LEN=2304 BATCH=16 REQUESTS=64 \
  OUTPUT=256 WORKER_FLAGS="$flags" WORKER_GPUS="0 1" timeout 200 docs/results/disagg/run.sh
grep -h "imported the KV\|over gRPC" "$work"/disagg/worker*.log | tail -3
echo "disagg done at $((SECONDS - t0)) s"
OUT=$work/move BIN=carry PRESET=openllama-3b BATCH=64 REQUESTS=384 MAX_SEQ_LEN=512 \
  WORKER_FLAGS="$flags --batch_invariant" WORKER_GPUS="0 1" timeout 200 docs/results/kv-move/run.sh
grep -h "stashed\|imported the KV" "$work"/move/worker-*.log | cut -c 1-220 | tail -8
echo "move done at $((SECONDS - t0)) s"
rm -rf "$work"/*/model
tar -C "$work" -czf "$out/kv-nccl.tar.gz" .
