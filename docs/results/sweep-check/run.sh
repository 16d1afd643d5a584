#!/usr/bin/env bash
# The sweep's correctness check on one GPU in fp16 without --batch_invariant: one CUDA worker, the
# openllama-3b shape (random weights), a closed-loop sweep over batch 1, 8, 64 and 128 (prompt 128,
# 128 new tokens, 64 requests each) over gRPC and the same over the OpenAI API. Each output is
# judged against its prompt's reference run by the agreement rule (README: a first difference at a
# reference top-2 gap below --tie_tolerance is a near-tie, listed with its gap). A correct build
# says "correctness: pass" over both APIs; a build with a wrong-token bug says FAIL (exit 3).
# With PLANTED=1 the same runs follow with .carry/bin/tandem-coordinator-planted, a coordinator
# built with such a bug (README.md in this folder says which).
# Runs from the repository root on the GPU machine, with the binaries scripts/gpu-check packs.
# Writes device.txt, the summaries and the logs to $OUT.
set -u
cd "$(dirname "$0")/../../.."
out=${OUT:-/tmp/tandem-sweep-check}
mkdir -p "$out"
source scripts/carry-unpack
bin=$PWD/.carry/bin
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$out/device.txt"
model=/tmp/tandem-models/openllama-3b
t0=$SECONDS
if [ ! -f "$model/config.json" ]; then
  "$bin/tandem-make-model" --preset=openllama-3b --dtype=f16 --seed=1 --out="$model" > /dev/null || exit 1
fi
run() {  # $1: the coordinator binary's suffix ("" or -planted)
  local coord=$1
  "$bin/tandem-worker" --coordinator=127.0.0.1:50051 --listen=127.0.0.1:50060 --backend=cuda \
    --gpu=0 --dtype=f16 --kv_memory_fraction=0.8 > "$out/worker$coord.log" 2>&1 &
  local worker=$!
  "$bin/tandem-coordinator$coord" --listen=127.0.0.1:50051 --http_listen=127.0.0.1:8080 \
    --model_dir="$model" --stages=1 --replicas=1 --max_batch=128 --max_slots=128 \
    --max_seq_len=1024 > "$out/coordinator$coord.log" 2>&1 &
  local coordinator=$!
  for _ in $(seq 240); do
    grep -q "serves with" "$out/coordinator$coord.log" && break
    sleep 0.5
  done
  local runs
  runs=$(mktemp -d)
  for api in grpc openai; do
    local addr=127.0.0.1:50051
    [ "$api" = openai ] && addr=http://127.0.0.1:8080
    timeout 280 "$bin/tandem-loadgen" sweep --api=$api --addr=$addr --nodes=1 \
      --batch=1,8,64,128 --requests=64 --warmup=4 --prompt_lens=128 --output_lens=128 \
      --out="$runs/$api" > "$out/loadgen$coord-$api.log" 2>&1
    echo "coordinator$coord $api: sweep exit $? at $((SECONDS - t0)) s: $(grep '^correctness:' "$out/loadgen$coord-$api.log")" |
      tee -a "$out/device.txt"
    cp "$runs/$api/summary.md" "$out/summary$coord-$api.md" 2>/dev/null
  done
  kill $worker $coordinator 2>/dev/null
  wait $worker $coordinator 2>/dev/null
}
run ""
[ "${PLANTED:-0}" = 1 ] && run -planted
exit 0
