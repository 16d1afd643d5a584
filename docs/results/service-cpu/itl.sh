#!/usr/bin/env bash
# The service against its stage on this machine's CPU: one coordinator and one CPU worker with
# --step_trace serving a generated tiny-llama checkpoint, tandem-loadgen's closed loop at batch 1
# (REQUESTS requests, prompt 128, 128 new tokens, EOS ignored) over gRPC; prints the client's ITL
# next to the stage's compute time per decode step from the trace.
# usage: docs/results/service-cpu/itl.sh [BUILD_DIR]   (default: build)   Output in $OUT.
# Environment: BATCH (1), REQUESTS (64), COORDINATOR_FLAGS (extra flags, e.g. --decode_ahead=false),
# WORKER_FLAGS (e.g. --cpu_threads=2).
set -u
cd "$(dirname "$0")/../../.."
bin=$PWD/${1:-build}/bin
out=${OUT:-/tmp/tandem-service-cpu}
batch=${BATCH:-1}
requests=${REQUESTS:-64}
mkdir -p "$out" && rm -rf "$out/sweep" "$out/steps.tsv"
[ -f "$out/model/config.json" ] ||
  "$bin/tandem-make-model" --preset=tiny-llama --seed=1 --out="$out/model" > /dev/null || exit 1
source docs/results/serve-lib.sh
pids=()
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
# shellcheck disable=SC2086
start_coordinator "$out/coordinator.log" --listen=127.0.0.1:0 --model_dir="$out/model" \
  --stages=1 --replicas=1 --max_batch=64 --max_slots=64 --metrics_address= ${COORDINATOR_FLAGS:-}
"$bin/tandem-worker" --coordinator=127.0.0.1:$port --listen=127.0.0.1:0 --backend=cpu \
  --metrics_address= --step_trace="$out/steps.tsv" ${WORKER_FLAGS:-} > "$out/worker.log" 2>&1 &
pids+=($!)
wait_serving "$out/coordinator.log" 1
"$bin/tandem-loadgen" sweep --api=grpc --addr=127.0.0.1:$port --nodes=1 --batch="$batch" \
  --requests="$requests" --warmup=4 --prompt_lens=128 --output_lens=128 --progress=false \
  --out="$out/sweep" > "$out/loadgen.log" 2>&1
echo "loadgen exit $?"
grep -E '^\| (nodes|1) ' "$out/sweep/summary.md" | cut -d'|' -f2-9
python3 - "$out/steps.tsv" "$out/sweep/results.csv" <<'PY'
import csv, sys
rows = [l.split('\t') for l in open(sys.argv[1]) if l.strip()]
c = sorted(float(r[6]) for r in rows if int(r[4]) == 0)
itl = float(next(csv.DictReader(open(sys.argv[2])))["itl_p50_s"]) * 1e3
p50 = c[len(c) // 2]
print(f"decode steps: {len(c)}, stage compute ms p50 {p50:.4f} p90 {c[int(0.9 * len(c))]:.4f}; "
      f"client ITL p50 {itl:.4f} ms = {itl / p50:.2f} x the stage's compute")
PY
