#!/usr/bin/env bash
# The prefill budget at batch 64 (openllama-3b, f16, seed 1; prompt 128, 128 new tokens, 192
# requests over gRPC, decode-ahead on), on an nvidia-h100-x1 machine from the repository root, with
# the binaries `PACK=.carry-pack-budget scripts/gpu-check build-gpu-budget` packs: one coordinator
# per --prefill_budget (0 = no bound, 128, 256) against one CUDA worker kept between them. Writes to
# $OUT budget.md (every sweep's summary) and budget-device.txt (times, exits).
set -u
cd "$(dirname "$0")/../../.."
export PACK=${PACK:-.carry-pack-budget}
out=${OUT:-/tmp/tandem-budget-out}
mkdir -p "$out"
source scripts/carry-unpack
bin=$PWD/.carry/bin
model=/tmp/tandem-models/openllama-3b
t0=$SECONDS
[ -f "$model/config.json" ] ||
  "$bin/tandem-make-model" --preset=openllama-3b --dtype=f16 --seed=1 --out="$model" > /dev/null || exit 1
"$bin/tandem-worker" --coordinator=127.0.0.1:50051 --listen=127.0.0.1:50060 --backend=cuda \
  --gpu=0 --dtype=f16 --kv_memory_fraction=0.5 --metrics_address=127.0.0.1:19470 \
  >> "$out/worker.log" 2>&1 &
worker=$!
trap 'kill $worker 2>/dev/null' EXIT
runs=$(mktemp -d)
for budget in 0 128 256; do
  "$bin/tandem-coordinator" --listen=127.0.0.1:50051 --model_dir="$model" --stages=1 \
    --replicas=1 --max_batch=64 --max_slots=64 --max_seq_len=1024 --prefill_budget="$budget" \
    >> "$out/coordinator-$budget.log" 2>&1 &
  coordinator=$!
  for _ in $(seq 240); do
    grep -q "serves with" "$out/coordinator-$budget.log" && break
    sleep 0.5
  done
  timeout 150 "$bin/tandem-loadgen" sweep --api=grpc --addr=127.0.0.1:50051 --nodes=1 \
    --batch=64 --requests=192 --warmup=4 --prompt_lens=128 --output_lens=128 \
    --progress=false --worker_metrics=127.0.0.1:19470 --out="$runs/budget-$budget" \
    >> "$out/loadgen.log" 2>&1
  echo "budget $budget exit $? at $((SECONDS - t0)) s" | tee -a "$out/budget-device.txt"
  { echo "## prefill_budget $budget, b64"; cat "$runs/budget-$budget/summary.md"; echo; } >> "$out/budget.md"
  kill "$coordinator"; wait "$coordinator" 2>/dev/null
done
tail -5 "$out/loadgen.log" >> "$out/budget-device.txt"
