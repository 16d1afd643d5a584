#!/usr/bin/env bash
# Failover under load on this machine's CPU: one coordinator (default heartbeats), two CPU
# workers of a generated tiny-llama checkpoint (one serving, one spare), tandem-loadgen's closed
# loop (16 in flight, 1,000 requests of 32 prompt and 128 new tokens) over gRPC, and the serving
# worker killed (SIGKILL) a few seconds in. Prints the sweep's summary (its failures must be 0),
# the coordinator's resume counters, and the longest pause of any request's stream.
# usage: docs/results/failover-cpu/run.sh [BUILD_DIR]   (default: build)   Output in $OUT.
# On the GPU machine (after scripts/gpu-check packed the binaries): BIN=carry PRESET=openllama-3b
# WORKER_FLAGS="--backend=cuda --gpu=0 --dtype=f16 --kv_memory_fraction=0.4" (both workers on
# the one GPU).
set -uo pipefail
cd "$(dirname "$0")/../../.."
if [ "${BIN:-}" = carry ]; then
  source scripts/carry-unpack
  bin=$PWD/.carry/bin
else
  bin=$PWD/${1:-build}/bin
fi
out=${OUT:-/tmp/tandem-failover}
mkdir -p "$out" && rm -rf "$out/sweep"
[ -f "$out/model/config.json" ] ||
  "$bin/tandem-make-model" --preset="${PRESET:-tiny-llama}" --seed=1 --out="$out/model" > /dev/null ||
  exit 1
source docs/results/serve-lib.sh
pids=()
trap 'kill -9 "${pids[@]}" 2>/dev/null' EXIT
start_coordinator "$out/coordinator.log" --listen=127.0.0.1:0 --model_dir="$out/model" \
  --stages=1 --replicas=1 --max_slots=16 --max_batch=16 --metrics_address=127.0.0.1:0
for i in 0 1; do
  # shellcheck disable=SC2086
  "$bin/tandem-worker" --coordinator=127.0.0.1:$port --listen=127.0.0.1:0 \
    ${WORKER_FLAGS:---backend=cpu} > "$out/worker-$i.log" 2>&1 &
  pids+=($!)
  worker[$i]=$!
done
for _ in $(seq 300); do
  "$bin/tandem-cli" topology --addr=127.0.0.1:$port 2>/dev/null | grep -q '^pipelines {' && break
  sleep 0.2
done
"$bin/tandem-loadgen" sweep --api=grpc --addr=127.0.0.1:$port --batch=16 --requests=1000 --prompt_pool=64 \
  --warmup=0 --prompt_lens=32 --output_lens=128 --progress=false --out="$out/sweep" \
  > "$out/loadgen.log" 2>&1 &
loadgen=$!
sleep "${KILL_AFTER_S:-4}"
# KILL=0: the same run without the kill (the control for the sweep's correctness column).
serving=$("$bin/tandem-cli" topology --addr=127.0.0.1:$port | sed -n 's/.*worker_address: "127.0.0.1:\([0-9]*\)".*/\1/p' | head -1)
for i in 0 1; do
  if [ "${KILL:-1}" != 0 ] && grep -q "listening on port $serving\$" "$out/worker-$i.log"; then
    echo "killing worker $i (port $serving) at $(date +%T.%N)"
    kill -9 "${worker[$i]}"
  fi
done
wait $loadgen; echo "loadgen exit $?"
cat "$out/sweep/summary.md"
curl -s "http://127.0.0.1:$metrics/metrics" |
  grep -E '^tandem_(sequences_recomputed_total|recomputed_tokens_total|requests_total)'
