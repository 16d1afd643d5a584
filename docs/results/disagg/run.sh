#!/usr/bin/env bash
# Disaggregated prefill against colocated replicas: one coordinator and two workers serving a
# generated checkpoint (4,096 positions) under a mixed load. Long prompts (LONG tokens, 1 new
# token, PROMPT_BATCH at a time) come in all along through the OpenAI HTTP API (a tandem-loadgen
# that leaves the topology alone) while a tandem-loadgen sweep measures decoding streams (BATCH of
# them, prompt 64, OUTPUT new tokens) over two layouts of the two workers: colocated (2 replicas
# that both prefill and decode) and disaggregated (1 prefill replica handing the KV-cache to 1
# decode replica), its correctness check comparing the second layout's outputs with the first's.
# Prints the sweep's table and the hand-off counters.
# usage: docs/results/disagg/run.sh [BUILD_DIR]   (default: build)   Output in $OUT.
# Environment: PRESET (tiny-llama), BATCH (8), REQUESTS (decoding streams per layout, 32),
# OUTPUT (512), LONG (2048), PROMPT_BATCH (1), MAX_SLOTS (64), MAX_SEQ_LEN (0: the model's),
# WORKER_FLAGS (--backend=cpu), WORKER_GPUS (the workers' --gpu, one each, space-separated).
# On the GPU machine (after scripts/gpu-check packed the binaries): BIN=carry PRESET=openllama-3b
# MAX_SLOTS=24 MAX_SEQ_LEN=2304 WORKER_FLAGS="--backend=cuda --gpu=0 --dtype=f16
# --kv_memory_fraction=0.4 --batch_invariant" (both workers on the one GPU).
set -u
cd "$(dirname "$0")/../../.."
if [ "${BIN:-}" = carry ]; then
  source scripts/carry-unpack
  bin=$PWD/.carry/bin
else
  bin=$PWD/${1:-build}/bin
fi
out=${OUT:-/tmp/tandem-disagg}
mkdir -p "$out" && rm -rf "$out/sweep" "$out/prompts"
[ -f "$out/model/config.json" ] ||
  "$bin/tandem-make-model" --preset="${PRESET:-tiny-llama}" --seed=1 --max_positions=4096 \
    --out="$out/model" > /dev/null || exit 1
source docs/results/serve-lib.sh
read -ra gpus <<< "${WORKER_GPUS:-}"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
start_coordinator "$out/coordinator.log" --listen=127.0.0.1:0 --http_listen=127.0.0.1:0 \
  --model_dir="$out/model" --stages=1 --replicas=2 --max_batch=64 --max_slots="${MAX_SLOTS:-64}" \
  --max_seq_len="${MAX_SEQ_LEN:-0}" --metrics_address=127.0.0.1:0
for w in 1 2; do
  # shellcheck disable=SC2086
  "$bin/tandem-worker" --coordinator=127.0.0.1:$port --listen=127.0.0.1:0 \
    ${WORKER_FLAGS:---backend=cpu} ${gpus[$((w - 1))]:+--gpu=${gpus[$((w - 1))]}} \
    --metrics_address= > "$out/worker$w.log" 2>&1 &
  pids+=($!)
done
wait_serving "$out/coordinator.log" 2
"$bin/tandem-loadgen" sweep --api=openai --addr=http://127.0.0.1:$http \
  --batch="${PROMPT_BATCH:-1}" --requests=100000 --warmup=0 --prompt_lens="${LONG:-2048}" \
  --output_lens=1 --progress=false --out="$out/prompts" > "$out/prompts.log" 2>&1 &
pids+=($!)
sleep 1
"$bin/tandem-loadgen" sweep --api=grpc --addr=127.0.0.1:$port --nodes=2 --parallelism=data \
  --prefill_nodes=0,1 --batch="${BATCH:-8}" --requests="${REQUESTS:-32}" --warmup=0 \
  --prompt_lens=64 --output_lens="${OUTPUT:-512}" --progress=false --out="$out/sweep" \
  > "$out/sweep.log" 2>&1
echo "loadgen exit $?"
grep -E '^(Correctness|\| (nodes|2) )' "$out/sweep/summary.md" | cut -d'|' -f1-10
curl -s "127.0.0.1:$metrics/metrics" |
  grep -E '^tandem_(prefill_handoffs_total|prefill_handoff_seconds_(sum|count)|kv_streams_total|kv_stream_seconds_(sum|count)|kv_transfer_bytes_total|sequences_recomputed_total|prompt_tokens_total) '
