#!/usr/bin/env bash
# Made the results in this folder, on an nvidia-h100-x1 machine, from the repository root, with the
# binaries that `PACK=.carry-pack-http scripts/gpu-check build-gpu-http` packs. The openllama-3b
# shape (f16, seed 1) on one CUDA worker; one coordinator serving gRPC (127.0.0.1:50051) and the
# OpenAI-compatible HTTP API (127.0.0.1:8000); the same closed-loop sweep (prompt 128, 128 new
# tokens, EOS ignored) through each API, at batch 1 and 64, twice, alternating
# gRPC, HTTP, gRPC, HTTP so that drift shows. Writes device.txt, the logs and every run's
# summary.md and results.json to $OUT.
# Environment: PACK (default .carry-pack-http).
set -u
cd "$(dirname "$0")/../../.."
export PACK=${PACK:-.carry-pack-http}
out=${OUT:-/tmp/tandem-openai-out}
mkdir -p "$out"
source scripts/carry-unpack
bin=$PWD/.carry/bin
model=/tmp/tandem-models/openllama-3b
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$out/device.txt"
t0=$SECONDS
if [ ! -f "$model/config.json" ]; then
  "$bin/tandem-make-model" --preset=openllama-3b --dtype=f16 --seed=1 --out="$model" > /dev/null || exit 1
  echo "generated openllama-3b in $((SECONDS - t0)) s" | tee -a "$out/device.txt"
fi
pids=()
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; pids=(); }
trap stop_all EXIT
"$bin/tandem-coordinator" --listen=127.0.0.1:50051 --http_listen=127.0.0.1:8000 \
  --model_dir="$model" --stages=1 --replicas=1 --max_batch=64 --max_slots=64 --max_seq_len=1024 \
  --metrics_address=127.0.0.1:9464 >> "$out/coordinator.log" 2>&1 &
pids+=($!)
"$bin/tandem-worker" --coordinator=127.0.0.1:50051 --listen=127.0.0.1:50060 --backend=cuda \
  --gpu=0 --dtype=f16 --kv_memory_fraction=0.5 --metrics_address=127.0.0.1:19470 \
  >> "$out/worker.log" 2>&1 &
pids+=($!)
for _ in $(seq 240); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:8000/health)" = 200 ] && break
  sleep 0.5
done
echo "serving after $((SECONDS - t0)) s" | tee -a "$out/device.txt"
sweep() {  # $1: name; $2: api; $3: batch; $4: requests
  local addr=127.0.0.1:50051
  [ "$2" = openai ] && addr=http://127.0.0.1:8000
  timeout 120 "$bin/tandem-loadgen" sweep --api="$2" --addr="$addr" --nodes=1 --batch="$3" \
    --requests="$4" --warmup=4 --prompt_lens=128 --output_lens=128 --progress=false \
    --worker_metrics=127.0.0.1:19470 --out="/tmp/$1" >> "$out/loadgen.log" 2>&1
  echo "$1 exit $?" | tee -a "$out/device.txt"
  mkdir -p "$out/$1" && cp /tmp/$1/summary.md /tmp/$1/results.json "$out/$1/" 2>/dev/null
}
for round in 1 2; do
  sweep "grpc-b1-r$round" grpc 1 24
  sweep "http-b1-r$round" openai 1 24
  sweep "grpc-b64-r$round" grpc 64 384
  sweep "http-b64-r$round" openai 64 384
done
echo "total $((SECONDS - t0)) s" | tee -a "$out/device.txt"
