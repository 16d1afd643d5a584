#!/usr/bin/env bash
# The check beside run.sh, on the same machine kind with the same pack: one CUDA worker started
# with --batch_invariant (a sequence's logits do not depend on the other sequences of its step),
# the coordinator with its default decode-ahead, and one closed-loop sweep over batch 1, 8 and 64
# (prompt 128, 128 new tokens, greedy, 32 requests per batch size), whose correctness column
# compares every request's tokens with those the same prompt got at batch 1. Writes device.txt and
# sweep.md to $OUT.
set -u
cd "$(dirname "$0")/../../.."
export PACK=${PACK:-.carry-pack-serve}
out=${OUT:-/tmp/tandem-service-invariant}
mkdir -p "$out"
source scripts/carry-unpack
bin=$PWD/.carry/bin
model=/tmp/tandem-models/openllama-3b
t0=$SECONDS
if [ ! -f "$model/config.json" ]; then
  "$bin/tandem-make-model" --preset=openllama-3b --dtype=f16 --seed=1 --out="$model" > /dev/null || exit 1
fi
"$bin/tandem-worker" --coordinator=127.0.0.1:50051 --listen=127.0.0.1:50060 --backend=cuda \
  --gpu=0 --dtype=f16 --kv_memory_fraction=0.5 --batch_invariant > "$out/worker.log" 2>&1 &
worker=$!
"$bin/tandem-coordinator" --listen=127.0.0.1:50051 --model_dir="$model" --stages=1 --replicas=1 \
  --max_batch=64 --max_slots=64 --max_seq_len=1024 > "$out/coordinator.log" 2>&1 &
coordinator=$!
trap 'kill $worker $coordinator 2>/dev/null' EXIT
for _ in $(seq 240); do
  grep -q "serves with" "$out/coordinator.log" && break
  sleep 0.5
done
runs=$(mktemp -d)
timeout 240 "$bin/tandem-loadgen" sweep --api=grpc --addr=127.0.0.1:50051 --nodes=1 \
  --batch=1,8,64 --requests=32 --warmup=4 --prompt_lens=128 --output_lens=128 --progress=false \
  --out="$runs/sweep" > "$out/loadgen.log" 2>&1
echo "sweep exit $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
cp "$runs/sweep/summary.md" "$out/sweep.md"
