#!/usr/bin/env bash
# Made the results in this folder, on an nvidia-h200-x2 machine, from the repository root, with the
# binaries and their shared libraries that scripts/gpu-check packs into .carry-pack/ (built with
# -DTANDEM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90). Steps: generate the
# openllama-3b shape (f16, seed 1); a coordinator and two cuda workers (GPU 0 and 1) linked over
# NCCL; the sweep over 1 and 2 nodes (pipeline stages), batch 1..64, with GPU power and energy
# from the workers' /metrics; then, with the coordinator restarted with --micro_batches=2, a short
# sweep at batch 8 over 1 and 2 nodes, where one stage runs the same two micro-batches of 4 that
# two stages run. Writes device.txt, the logs, summary.md, microbatch-check.md and sweep.tar.gz
# (both run folders) to $OUT.
# Environment: WORKER_FLAGS (extra tandem-worker flags), MICROBATCH_CHECK=0 skips the second part.
set -u
cd "$(dirname "$0")/../../.."
worker_flags=${WORKER_FLAGS:-}
out=${OUT:-/tmp/tandem-svc-out}
mkdir -p "$out"
source scripts/carry-unpack
bin=$PWD/.carry/bin
model=/tmp/tandem-models/openllama-3b
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$out/device.txt"
nvidia-smi topo -m >> "$out/device.txt" 2>&1
t0=$SECONDS
if [ ! -f "$model/config.json" ]; then
  "$bin/tandem-make-model" --preset=openllama-3b --dtype=f16 --seed=1 --out="$model" > /dev/null || exit 1
  echo "generated openllama-3b in $((SECONDS - t0)) s" | tee -a "$out/device.txt"
fi

pids=()
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; pids=(); }
trap stop_all EXIT
start() {  # $1: log suffix; then extra coordinator flags
  local tag=$1
  shift
  "$bin/tandem-coordinator" --listen=127.0.0.1:50051 --model_dir="$model" --stages=1 --replicas=1 \
    --max_batch=64 --max_slots=64 --max_seq_len=1024 --metrics_address=127.0.0.1:9464 "$@" \
    >> "$out/coordinator$tag.log" 2>&1 &
  pids+=($!)
  for g in 0 1; do
    "$bin/tandem-worker" --coordinator=127.0.0.1:50051 --listen=127.0.0.1:5006$g \
      --backend=cuda --gpu=$g --dtype=f16 --kv_memory_fraction=0.5 --transport=nccl \
      --metrics_address=127.0.0.1:1947$g $worker_flags >> "$out/worker$g$tag.log" 2>&1 &
    pids+=($!)
  done
  # Both workers registered (CUDA and NVML up) before the sweep sets the topology.
  for _ in $(seq 120); do
    grep -q "registered with" "$out/worker0$tag.log" && grep -q "registered with" "$out/worker1$tag.log" && break
    sleep 0.5
  done
}
sweep() {  # $1: seconds allowed; then loadgen flags
  local limit=$1
  shift
  timeout "$limit" "$bin/tandem-loadgen" sweep --addr=127.0.0.1:50051 \
    --worker_metrics=127.0.0.1:19470,127.0.0.1:19471 --nodes=1,2 --prompt_lens=128 \
    --progress=false "$@" >> "$out/loadgen.log" 2>&1
}

start ""
sweep 420 --batch=1,2,4,8,16,32,64 --requests=64 --warmup=4 --output_lens=128 --out=/tmp/run-nccl
echo "sweep exit $?" | tee -a "$out/device.txt"
cp /tmp/run-nccl/summary.md "$out/summary.md" 2>/dev/null
curl -s 127.0.0.1:19470/metrics > "$out/worker0.metrics" 2>/dev/null
stop_all

if [ "${MICROBATCH_CHECK:-1}" != 0 ]; then
  start "-mb2" --micro_batches=2
  sweep 120 --batch=8 --requests=32 --warmup=4 --output_lens=128 --out=/tmp/run-microbatch2
  echo "micro-batch check exit $?" | tee -a "$out/device.txt"
  cp /tmp/run-microbatch2/summary.md "$out/microbatch-check.md" 2>/dev/null
  stop_all
fi
tar -C /tmp -czf "$out/sweep.tar.gz" run-nccl $(test -d /tmp/run-microbatch2 && echo run-microbatch2)
echo "total $((SECONDS - t0)) s" | tee -a "$out/device.txt"
