#!/usr/bin/env bash
# The sweep's correctness check on a GPU in fp16 without --batch_invariant: one CUDA worker, the
# openllama-3b shape (random weights), one closed-loop sweep over batch 1, 8, 64 and 128 (prompt
# 128, 128 new tokens, 64 requests each) over gRPC and the same over the OpenAI API. Each output is
# judged against its prompt's reference run by the agreement rule (README: a first difference at
# a reference top-2 gap below --tie_tolerance is a near-tie, listed with its gap). A correct build
# says "correctness: pass" over gRPC; a build with a wrong-token bug says FAIL. Over the OpenAI API
# tokens are compared by their text, and the generator's small tokenizer decodes few of the 32,000
# ids of this random checkpoint, so most differing outputs there are "not checked" (the loadgen
# warns and counts them). Writes device.txt, the summaries and the logs to $OUT.
set -u
cd "$(dirname "$0")/../../.."
export PACK=${PACK:-.carry-pack-serve}
out=${OUT:-/tmp/tandem-sweep-check}
mkdir -p "$out"
source scripts/carry-unpack
bin=$PWD/.carry/bin
model=/tmp/tandem-models/openllama-3b
t0=$SECONDS
if [ ! -f "$model/config.json" ]; then
  "$bin/tandem-make-model" --preset=openllama-3b --dtype=f16 --seed=1 --out="$model" > /dev/null || exit 1
fi
"$bin/tandem-worker" --coordinator=127.0.0.1:50051 --listen=127.0.0.1:50060 --backend=cuda \
  --gpu=0 --dtype=f16 --kv_memory_fraction=0.5 > "$out/worker.log" 2>&1 &
worker=$!
"$bin/tandem-coordinator" --listen=127.0.0.1:50051 --http_listen=127.0.0.1:8080 \
  --model_dir="$model" --stages=1 --replicas=1 --max_batch=128 --max_slots=128 \
  --max_seq_len=1024 > "$out/coordinator.log" 2>&1 &
coordinator=$!
trap 'kill $worker $coordinator 2>/dev/null' EXIT
for _ in $(seq 240); do
  grep -q "serves with" "$out/coordinator.log" && break
  sleep 0.5
done
runs=$(mktemp -d)
for api in grpc openai; do
  addr=127.0.0.1:50051
  [ "$api" = openai ] && addr=http://127.0.0.1:8080
  timeout 280 "$bin/tandem-loadgen" sweep --api=$api --addr=$addr --nodes=1 \
    --batch=1,8,64,128 --requests=64 --warmup=4 --prompt_lens=128 --output_lens=128 \
    --out="$runs/$api" > "$out/loadgen-$api.log" 2>&1
  echo "$api: sweep exit $? at $((SECONDS - t0)) s: $(grep '^correctness:' "$out/loadgen-$api.log")" |
    tee -a "$out/device.txt"
  cp "$runs/$api/summary.md" "$out/summary-$api.md" 2>/dev/null
done
