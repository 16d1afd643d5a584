#!/usr/bin/env bash
# Disaggregated prefill against colocated replicas on this machine's CPU: one coordinator and two
# CPU workers serving a generated tiny-llama checkpoint (4,096 positions), under a mixed load of
# two tandem-loadgen closed loops at once: decoding streams (BATCH of them, prompt 64, 512 new
# tokens) and long prompts (one at a time, 2,048 tokens, 1 new token). Each layout runs the same
# load: "colocated" (2 replicas that both prefill and decode) and "disaggregated" (1 prefill
# replica handing the KV-cache to 1 decode replica). Prints the decoding streams' ITL and the long
# prompts' TTFT per layout, and the coordinator's hand-off counters.
# usage: docs/results/disagg-cpu/run.sh [BUILD_DIR]   (default: build)   Output in $OUT.
# Environment: BATCH (8), REQUESTS (decoding streams per layout, 32).
set -u
cd "$(dirname "$0")/../../.."
bin=$PWD/${1:-build}/bin
out=${OUT:-/tmp/tandem-disagg-cpu}
batch=${BATCH:-8}
requests=${REQUESTS:-32}
mkdir -p "$out"
[ -f "$out/model/config.json" ] ||
  "$bin/tandem-make-model" --preset=tiny-llama --seed=1 --max_positions=4096 \
    --out="$out/model" > /dev/null || exit 1
"$bin/tandem-coordinator" --listen=127.0.0.1:0 --model_dir="$out/model" --stages=1 --replicas=2 \
  --max_batch=64 --max_slots=64 --metrics_address=127.0.0.1:0 > "$out/coordinator.log" 2>&1 &
pids=($!)
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
port=""
for _ in $(seq 100); do
  port=$(sed -n 's/^tandem-coordinator listening on port \([0-9]*\)$/\1/p' "$out/coordinator.log")
  [ -n "$port" ] && break
  sleep 0.1
done
metrics=$(sed -n 's/^tandem-coordinator metrics on port \([0-9]*\)$/\1/p' "$out/coordinator.log")
for w in 1 2; do
  "$bin/tandem-worker" --coordinator=127.0.0.1:$port --listen=127.0.0.1:0 --backend=cpu \
    --metrics_address= > "$out/worker$w.log" 2>&1 &
  pids+=($!)
done
for _ in $(seq 100); do
  [ "$(grep -c "serves with" "$out/coordinator.log")" -ge 2 ] && break
  sleep 0.1
done
sweep() {  # $1: run name; $2: prefill nodes; the rest: loadgen flags
  local name=$1 prefill=$2
  shift 2
  "$bin/tandem-loadgen" sweep --api=grpc --addr=127.0.0.1:$port --nodes=2 --parallelism=data \
    --prefill_nodes="$prefill" --progress=false --out="$out/$name" "$@" > "$out/$name.log" 2>&1
}
for layout in colocated disaggregated; do
  prefill=0
  [ "$layout" = disaggregated ] && prefill=1
  rm -rf "$out/$layout-streams" "$out/$layout-prompts"
  sweep "$layout-prompts" "$prefill" --batch=1 --requests=100000 --warmup=0 --prompt_lens=2048 \
    --output_lens=1 &
  prompts=$!
  sleep 1
  sweep "$layout-streams" "$prefill" --batch="$batch" --requests="$requests" --warmup=0 \
    --prompt_lens=64 --output_lens=512
  kill -TERM $prompts 2>/dev/null
  wait $prompts 2>/dev/null
  echo "== $layout: decoding streams"
  grep -E '^\| (nodes|2) ' "$out/$layout-streams/summary.md" | cut -d'|' -f2-10
done
grep -E '^tandem_(prefill_handoffs_total|kv_transfer_bytes_total|sequences_recomputed_total) ' \
  <(curl -s "127.0.0.1:$metrics/metrics")
grep -E '^tandem_prefill_handoff_seconds_(sum|count) ' <(curl -s "127.0.0.1:$metrics/metrics")
