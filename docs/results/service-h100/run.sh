#!/usr/bin/env bash
# Made the results in this folder, on an nvidia-h100-x1 machine, from the repository root, with the
# binaries that `PACK=.carry-pack-serve scripts/gpu-check build-gpu-serve` packs. The openllama-3b
# shape (f16, seed 1): first the engine alone (tandem-bench, batch 1, 8 and 64, prompt 128, 128
# new tokens), then the same work through one coordinator and one CUDA worker (tandem-loadgen's
# closed-loop sweep over gRPC, EOS ignored, 64 requests per batch size, 192 at batch 64), once
# with the coordinator's decode-ahead (the default) and once with --decode_ahead=false, the
# worker kept between the two. Writes to $OUT device.txt (times, exits), bench.txt and bench.json,
# sweeps.md (every sweep's summary), runs.tar.gz (their results.json) and logs.tar.gz.
# Environment: PACK (default .carry-pack-serve).
set -u
cd "$(dirname "$0")/../../.."
export PACK=${PACK:-.carry-pack-serve}
out=${OUT:-/tmp/tandem-service-out}
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
"$bin/tandem-bench" --model="$model" --batch=1,8,64 --prompt=128 --new_tokens=128 \
  --json="$out/bench.json" > "$out/bench.txt" 2>&1
echo "bench exit $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
"$bin/tandem-worker" --coordinator=127.0.0.1:50051 --listen=127.0.0.1:50060 --backend=cuda \
  --gpu=0 --dtype=f16 --kv_memory_fraction=0.5 --metrics_address=127.0.0.1:19470 \
  >> "$out/worker.log" 2>&1 &
worker=$!
trap 'kill $worker 2>/dev/null' EXIT
runs=$(mktemp -d)
sweep() {  # $1: name; $2: --decode_ahead
  "$bin/tandem-coordinator" --listen=127.0.0.1:50051 --model_dir="$model" --stages=1 \
    --replicas=1 --max_batch=64 --max_slots=64 --max_seq_len=1024 --decode_ahead="$2" \
    >> "$out/coordinator-$1.log" 2>&1 &
  local coordinator=$!
  for _ in $(seq 240); do
    grep -q "serves with" "$out/coordinator-$1.log" && break
    sleep 0.5
  done
  echo "$1 serving at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
  local batch requests
  for point in "1 64" "8 64" "64 192"; do
    read -r batch requests <<< "$point"
    timeout 150 "$bin/tandem-loadgen" sweep --api=grpc --addr=127.0.0.1:50051 --nodes=1 \
      --batch="$batch" --requests="$requests" --warmup=4 --prompt_lens=128 --output_lens=128 \
      --progress=false --worker_metrics=127.0.0.1:19470 --out="$runs/$1-b$batch" \
      >> "$out/loadgen.log" 2>&1
    echo "$1 b$batch exit $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
    { echo "## $1 b$batch"; cat "$runs/$1-b$batch/summary.md"; echo; } >> "$out/sweeps.md"
  done
  kill "$coordinator"; wait "$coordinator" 2>/dev/null
}
sweep ahead true
sweep plain false
kill "$worker"; wait "$worker" 2>/dev/null
tar -C "$runs" -czf "$out/runs.tar.gz" . && tar -C "$out" -czf "$out/logs.tar.gz" --remove-files \
  worker.log loadgen.log coordinator-ahead.log coordinator-plain.log
echo "total $((SECONDS - t0)) s" | tee -a "$out/device.txt"
