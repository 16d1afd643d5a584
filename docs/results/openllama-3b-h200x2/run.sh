#!/usr/bin/env bash
# Made the results in this folder, on an nvidia-h200-x2 machine, from the repository root, with
# the binaries and their libraries unpacked from .carry-svc/svc.tar.xz (built with
# -DTANDEM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90). Steps: generate the openllama-3b shape (f16,
# seed 1); a coordinator and two cuda workers (GPU 0 and 1); a short sweep over gRPC links (1 vs 2
# stages, greedy outputs compared); then the full sweep over NCCL links with GPU power and energy
# from the workers' /metrics. Writes device.txt, the logs, grpc-check.md, summary.md and
# sweep.tar.gz (the NCCL run folder) to $OUT.
set -u
root=$PWD
out=${OUT:-/tmp/tandem-svc-out}
mkdir -p "$out" /tmp/svc
tar -C /tmp/svc -xJf .carry-svc/svc.tar.xz
# A newer tandem-worker, when packed after svc.tar.xz.
[ -f .carry-svc/worker.tar.xz ] && tar -C /tmp/svc -xJf .carry-svc/worker.tar.xz
bin=/tmp/svc/bin
export LD_LIBRARY_PATH=/tmp/svc/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
model=/tmp/models/openllama-3b
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$out/device.txt"
nvidia-smi topo -m >> "$out/device.txt" 2>&1
t0=$SECONDS
"$bin/tandem-make-model" --preset=openllama-3b --dtype=f16 --seed=1 --out="$model" > /dev/null || exit 1
echo "generated openllama-3b in $((SECONDS - t0)) s" | tee -a "$out/device.txt"

pids=()
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; pids=(); }
trap stop_all EXIT
# $1: transport (grpc or nccl).
start() {
  "$bin/tandem-coordinator" --listen=127.0.0.1:50051 --model_dir="$model" --stages=1 --replicas=1 \
    --max_batch=64 --max_slots=64 --max_seq_len=1024 --metrics_address=127.0.0.1:9464 \
    >> "$out/coordinator-$1.log" 2>&1 &
  pids+=($!)
  for g in 0 1; do
    "$bin/tandem-worker" --coordinator=127.0.0.1:50051 --listen=127.0.0.1:5006$g \
      --backend=cuda --gpu=$g --dtype=f16 --kv_memory_fraction=0.5 --transport="$1" \
      --metrics_address=127.0.0.1:1947$g >> "$out/worker$g-$1.log" 2>&1 &
    pids+=($!)
  done
  # Both workers registered (CUDA and NVML up) before the sweep sets the topology.
  for _ in $(seq 120); do
    grep -q "registered with" "$out/worker0-$1.log" && grep -q "registered with" "$out/worker1-$1.log" && break
    sleep 0.5
  done
}
sweep() {  # $1: transport, then loadgen flags
  local t=$1
  shift
  timeout "$limit" "$bin/tandem-loadgen" sweep --addr=127.0.0.1:50051 \
    --worker_metrics=127.0.0.1:19470,127.0.0.1:19471 --nodes=1,2 --prompt_lens=128 \
    --progress=false "$@" >> "$out/loadgen-$t.log" 2>&1
}

start grpc
limit=90 sweep grpc --batch=8 --requests=8 --warmup=1 --output_lens=32 --out=/tmp/run-grpc
echo "grpc sweep exit $?" | tee -a "$out/device.txt"
cp /tmp/run-grpc/summary.md "$out/grpc-check.md" 2>/dev/null
stop_all

start nccl
limit=330 sweep nccl --batch=1,2,4,8,16,32,64 --requests=64 --warmup=4 --output_lens=128 \
  --out=/tmp/run-nccl
echo "nccl sweep exit $?" | tee -a "$out/device.txt"
cp /tmp/run-nccl/summary.md "$out/summary.md" 2>/dev/null
stop_all
tar -C /tmp -czf "$out/sweep.tar.gz" run-nccl run-grpc
echo "total $((SECONDS - t0)) s" | tee -a "$out/device.txt"
