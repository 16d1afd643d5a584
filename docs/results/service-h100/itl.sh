#!/usr/bin/env bash
# Where the inter-token latency's tail at batch 64 comes from: one coordinator (decode-ahead on,
# the default) and one CUDA worker with --step_trace, the openllama-3b shape (f16, seed 1),
# tandem-loadgen's closed loop at batch 64 (192 requests, prompt 128, 128 new tokens, EOS
# ignored), then the steps' compute times split by whether a step carried prompt rows, next to
# the client's ITL percentiles. Run on the GPU machine from the repository root with the binaries
# of `PACK=... scripts/gpu-check`. Environment: PACK, OUT, COORDINATOR_FLAGS (extra flags, e.g.
# --prefill_budget=128).
set -u
cd "$(dirname "$0")/../../.."
out=${OUT:-/tmp/tandem-itl}
mkdir -p "$out"
source scripts/carry-unpack
bin=$PWD/.carry/bin
model=/tmp/tandem-models/openllama-3b
[ -f "$model/config.json" ] ||
  "$bin/tandem-make-model" --preset=openllama-3b --dtype=f16 --seed=1 --out="$model" > /dev/null ||
  exit 1
rm -f "$out/steps.tsv"
"$bin/tandem-worker" --coordinator=127.0.0.1:50051 --listen=127.0.0.1:50060 --backend=cuda \
  --gpu=0 --dtype=f16 --kv_memory_fraction=0.5 --metrics_address=127.0.0.1:19470 \
  --step_trace="$out/steps.tsv" > "$out/worker.log" 2>&1 &
worker=$!
# shellcheck disable=SC2086
"$bin/tandem-coordinator" --listen=127.0.0.1:50051 --model_dir="$model" --stages=1 --replicas=1 \
  --max_batch=64 --max_slots=64 --max_seq_len=1024 ${COORDINATOR_FLAGS:-} \
  > "$out/coordinator.log" 2>&1 &
coordinator=$!
trap 'kill $worker $coordinator 2>/dev/null' EXIT
for _ in $(seq 240); do
  grep -q "serves with" "$out/coordinator.log" && break
  sleep 0.5
done
timeout 150 "$bin/tandem-loadgen" sweep --api=grpc --addr=127.0.0.1:50051 --nodes=1 --batch=64 \
  --requests=192 --warmup=4 --prompt_lens=128 --output_lens=128 --progress=false \
  --out="$out/sweep" > "$out/loadgen.log" 2>&1
echo "loadgen exit $?"
grep -E '^\| 1 ' "$out/sweep/summary.md"
python3 - "$out/steps.tsv" <<'PY'
import sys
rows = [l.split('\t') for l in open(sys.argv[1]) if l.strip()]
def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p / 100 * len(v)))] if v else float('nan')
steps = [(int(r[2]), int(r[3]), int(r[4]), float(r[6])) for r in rows]
for name, sel in (("all", steps), ("with prompt rows", [s for s in steps if s[2] > 0]),
                  ("decode only", [s for s in steps if s[2] == 0])):
    c = [s[3] for s in sel]
    print(f"{name}: {len(sel)} steps, compute ms p50 {pct(c, 50):.2f} p90 {pct(c, 90):.2f} "
          f"p99 {pct(c, 99):.2f} max {max(c) if c else float('nan'):.2f}")
# Gaps between step ends: what a sequence in every step sees between its tokens.
ends = [int(r[0]) for r in rows]
gaps = [(b - a) / 1000 for a, b in zip(ends, ends[1:])]
print(f"gap between step ends ms: p50 {pct(gaps, 50):.2f} p90 {pct(gaps, 90):.2f} "
      f"p99 {pct(gaps, 99):.2f} max {max(gaps):.2f}")
big = [s for s in steps if s[2] > 0]
if big:
    print("prompt rows per prompt step: p50", pct([s[2] for s in big], 50), "max", max(s[2] for s in big),
          "; tokens p50", pct([s[1] for s in big], 50), "max", max(s[1] for s in big))
PY
