#!/usr/bin/env bash
# One stage against two on a machine with two GPUs (nvidia-h100-x2), from the repository root, with
# the binaries that `scripts/gpu-check` packs. First the GPU tests that need
# two GPUs (the NCCL transport, the pipeline, real tandem-worker processes over NCCL), then the
# openllama-3b shape (f16, seed 1): the engine alone (tandem-bench on GPU 0, batch 1, 8 and 64,
# prompt 128, 128 new tokens), and the same work through one coordinator and two CUDA workers (one
# per GPU), first as one pipeline of one stage (the second worker idle), then re-partitioned
# (tandem-cli set-topology) into one pipeline of two stages with NCCL between the GPUs (the
# workers' default transport for CUDA; before --transport=auto it was gRPC):
# tandem-loadgen's closed loop over gRPC at batch 1, 8 and 64 (64, 64 and 192 requests, EOS
# ignored). Writes to $OUT: device.txt (GPUs, times, exits), tests.txt, bench.txt, sweeps.md (every
# point's summary), summary.md (service tok/s of both layouts and their ratio) and logs.tar.gz.
# Environment: PACK (default .carry-pack), SKIP_TESTS=1 leaves the tests out, POINTS (batch and
# requests per point, default "1 64,8 64,64 192"), STEP_TRACE=1 has each worker write a line per
# step (tandem-worker --step_trace, into logs.tar.gz).
set -u
cd "$(dirname "$0")/../../.."
export PACK=${PACK:-.carry-pack}
out=${OUT:-/tmp/tandem-service-2gpu}
mkdir -p "$out"
source scripts/carry-unpack
source scripts/gpu-require
bin=$PWD/.carry/bin
model=/tmp/tandem-models/openllama-3b
work=$(mktemp -d)
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$out/device.txt"
t0=$SECONDS
"$bin/tandem-make-model" --preset=openllama-3b --dtype=f16 --seed=1 --out="$model" > /dev/null &
make_model=$!
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  for t in nccl_transport_test pipeline_test cuda_pipeline_test; do
    TANDEM_TEST_TMPDIR=$work timeout 150 "$bin/$t" > "$work/$t.log" 2>&1
    rc=$?
    why=$(gpu_tests_ran "$work/$t.log" "$t") || rc="$rc+skipped"
    echo "$t: rc=$rc: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ test' "$work/$t.log" |
      tr '\n' ' ') ${why:-}" | tee -a "$out/tests.txt"
    grep -E '^\[  FAILED  \] [A-Z]' "$work/$t.log" >> "$out/tests.txt"
  done
  echo "tests done at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
fi
wait $make_model || exit 1
"$bin/tandem-bench" --model="$model" --batch=1,8,64 --prompt=128 --new_tokens=128 \
  --json="$out/bench.json" > "$out/bench.txt" 2>&1
echo "bench exit $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
source docs/results/serve-lib.sh
pids=()
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
start_coordinator "$work/coordinator.log" --listen=127.0.0.1:0 --model_dir="$model" --stages=1 \
  --replicas=1 --max_batch=64 --max_slots=64 --max_seq_len=1024
for gpu in 0 1; do
  "$bin/tandem-worker" --coordinator=127.0.0.1:$port --listen=127.0.0.1:0 --backend=cuda \
    --gpu=$gpu --dtype=f16 --kv_memory_fraction=0.5 --metrics_address= \
    ${STEP_TRACE:+--step_trace=$work/steps-gpu$gpu.tsv} \
    > "$work/worker-$gpu.log" 2>&1 &
  pids+=($!)
done
for stages in 1 2; do
  if [ "$stages" = 2 ]; then
    "$bin/tandem-cli" set-topology --addr=127.0.0.1:$port --stages=2 --replicas=1 > /dev/null ||
      echo "set-topology failed" | tee -a "$out/device.txt"
  fi
  wait_serving "$work/coordinator.log" "$stages" ||
    echo "no pipeline of $stages stage(s) serves" | tee -a "$out/device.txt"
  echo "$stages stage(s) serving at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
  IFS=, read -ra points <<< "${POINTS:-1 64,8 64,64 192}"
  for point in "${points[@]}"; do
    read -r batch requests <<< "$point"
    timeout 150 "$bin/tandem-loadgen" sweep --api=grpc --addr=127.0.0.1:$port --nodes="$stages" \
      --batch="$batch" --requests="$requests" --warmup=4 --prompt_lens=128 --output_lens=128 \
      --progress=false --out="$work/s$stages-b$batch" >> "$work/loadgen.log" 2>&1
    echo "$stages stage(s) b$batch exit $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
    { echo "## $stages stage(s), batch $batch"; cat "$work/s$stages-b$batch/summary.md"; echo; } \
      >> "$out/sweeps.md"
  done
done
kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null
python3 - "$work" "$out/bench.json" > "$out/summary.md" <<'PY'
import json, sys
work, bench = sys.argv[1], sys.argv[2]
try:
    engine = {r["batch"]: r for r in json.load(open(bench))["results"]}
except Exception:
    engine = {}
print("| batch | engine tok/s | 1 stage tok/s | 2 stages tok/s | 2 / 1 | ITL p50 / p99 ms, 1 stage | 2 stages |")
print("|---|---|---|---|---|---|---|")
for batch in (1, 8, 64):
    row = {}
    for stages in (1, 2):
        try:
            r = json.load(open(f"{work}/s{stages}-b{batch}/results.json"))["configs"][0]
            row[stages] = r
        except Exception as e:
            row[stages] = None
    e = engine.get(batch, {}).get("end_to_end_tok_s", float("nan"))
    def tps(s): return row[s]["tokens_per_s"] if row[s] else float("nan")
    def itl(s): return (f'{row[s]["itl_s"]["p50"] * 1e3:.2f} / {row[s]["itl_s"]["p99"] * 1e3:.2f}'
                        if row[s] else "-")
    print(f"| {batch} | {e:,.0f} | {tps(1):,.0f} | {tps(2):,.0f} | {tps(2) / tps(1):.3f} | "
          f"{itl(1)} | {itl(2)} |")
PY
cat "$out/summary.md"
tar -C "$work" -czf "$out/logs.tar.gz" --exclude='*.bin' --exclude='*.safetensors' . 2>/dev/null
echo "total $((SECONDS - t0)) s" | tee -a "$out/device.txt"
