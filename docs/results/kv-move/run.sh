#!/usr/bin/env bash
# Live re-partition under load: one coordinator, two workers (one pipeline of one stage at the
# start, the other worker idle), tandem-loadgen's closed loop over gRPC, and the layout switched
# between one and two stages while requests run (tandem-cli set-topology). Every switch moves the
# running sequences with their KV-cache (--move_kv, the default). Prints the sweep's summary (its
# failures must be 0; with --batch_invariant workers its correctness column must show no
# mismatch), the coordinator's move lines (stash, import, pause) and its counters.
# usage: docs/results/kv-move/run.sh [BUILD_DIR]   (default: build)   Output in $OUT.
# Environment: PRESET (tiny-llama), BATCH (16), REQUESTS (400), PROMPT (32), OUTPUT (128),
# MAX_SEQ_LEN (512), SWITCHES ("2 1 2 1": the stage counts switched to, one every SWITCH_EVERY_S
# seconds, default 2), WORKER_FLAGS (--backend=cpu), WORKER_GPUS (the workers' --gpu, one each,
# space-separated).
# On the GPU machine (after scripts/gpu-check packed the binaries): BIN=carry PRESET=openllama-3b
# WORKER_FLAGS="--backend=cuda --gpu=0 --dtype=f16 --kv_memory_fraction=0.4 --batch_invariant"
# (both workers on the one GPU).
set -uo pipefail
cd "$(dirname "$0")/../../.."
if [ "${BIN:-}" = carry ]; then
  source scripts/carry-unpack
  bin=$PWD/.carry/bin
else
  bin=$PWD/${1:-build}/bin
fi
out=${OUT:-/tmp/tandem-kv-move}
batch=${BATCH:-16}
mkdir -p "$out" && rm -rf "$out/sweep"
[ -f "$out/model/config.json" ] ||
  "$bin/tandem-make-model" --preset="${PRESET:-tiny-llama}" --seed=1 --out="$out/model" > /dev/null ||
  exit 1
source docs/results/serve-lib.sh
read -ra gpus <<< "${WORKER_GPUS:-}"
pids=()
trap 'kill -9 "${pids[@]}" 2>/dev/null' EXIT
start_coordinator "$out/coordinator.log" --listen=127.0.0.1:0 --model_dir="$out/model" \
  --stages=1 --replicas=1 --max_slots="$batch" --max_batch="$batch" \
  --max_seq_len="${MAX_SEQ_LEN:-512}" --metrics_address=127.0.0.1:0
for i in 0 1; do
  # shellcheck disable=SC2086
  "$bin/tandem-worker" --coordinator=127.0.0.1:$port --listen=127.0.0.1:0 \
    ${WORKER_FLAGS:---backend=cpu} ${gpus[$i]:+--gpu=${gpus[$i]}} > "$out/worker-$i.log" 2>&1 &
  pids+=($!)
done
for _ in $(seq 300); do
  "$bin/tandem-cli" topology --addr=127.0.0.1:$port 2>/dev/null | grep -q '^pipelines {' && break
  sleep 0.2
done
"$bin/tandem-loadgen" sweep --api=grpc --addr=127.0.0.1:$port --batch="$batch" \
  --requests="${REQUESTS:-400}" --prompt_pool=32 --warmup=0 --prompt_lens="${PROMPT:-32}" \
  --output_lens="${OUTPUT:-128}" --progress=false --out="$out/sweep" > "$out/loadgen.log" 2>&1 &
loadgen=$!
for stages in ${SWITCHES:-2 1 2 1}; do
  sleep "${SWITCH_EVERY_S:-2}"
  kill -0 $loadgen 2>/dev/null || break
  echo "switching to $stages stage(s) at $(date +%T.%N)"
  "$bin/tandem-cli" set-topology --addr=127.0.0.1:$port --stages="$stages" --replicas=1 \
    > /dev/null || echo "set-topology failed"
done
wait $loadgen; echo "loadgen exit $?"
cat "$out/sweep/summary.md"
grep -E 'moving|stashed|moved sequences|recomputed' "$out/coordinator.log" | cut -c 1-200
curl -s "http://127.0.0.1:$metrics/metrics" |
  grep -E '^tandem_(sequences_migrated_total|kv_transfer_bytes_total|kv_move_seconds_(sum|count)|sequences_recomputed_total|requests_total)'
