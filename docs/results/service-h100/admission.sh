#!/usr/bin/env bash
# New requests held back for others to arrive and for the successors of sequences that end (the
# coordinator's --admission_quiet_ms and --admission_wait_ms) against admitted at once, on one GPU (nvidia-h100-x1), from the repository
# root, with the binaries that `scripts/gpu-check` packs: the engine alone (tandem-bench, batch 1,
# 8 and 64, prompt 128, 128 new tokens), then one coordinator and one CUDA worker per variant of
# VARIANTS (docs/results/service-2gpu/micro.sh's "1:0:FLAG" form; default: admitted at once, the
# default (0.5 ms) and 1 ms) at each point of POINTS (batch and requests), with the
# worker's step trace; then, per variant, how many steps carried prompts and how many prompts each
# carried. Writes to $OUT: bench.txt, device.txt, sweeps.md, summary.md, prompt-steps.txt and
# logs.tar.gz.
set -u
cd "$(dirname "$0")/../../.."
export PACK=${PACK:-.carry-pack}
out=${OUT:-/tmp/tandem-admission}
mkdir -p "$out"
source scripts/carry-unpack
bin=$PWD/.carry/bin
model=/tmp/tandem-models/openllama-3b
[ -f "$model/config.json" ] ||
  "$bin/tandem-make-model" --preset=openllama-3b --dtype=f16 --seed=1 --out="$model" > /dev/null ||
  exit 1
"$bin/tandem-bench" --model="$model" --batch=1,8,64 --prompt=128 --new_tokens=128 2>&1 |
  grep -E '^\|' > "$out/bench.txt"
cat "$out/bench.txt"
variants=${VARIANTS:-1:0:--admission_quiet_ms=0 1:0 1:0:--admission_quiet_ms=1}
OUT=$out STEP_TRACE=1 VARIANTS="$variants" POINTS="${POINTS:-1 64,8 64,64 192,64 640}" \
  docs/results/service-2gpu/micro.sh > /dev/null
# Each point against the engine's end-to-end tokens/s at its batch.
python3 - "$out/bench.txt" "$out/summary.md" <<'PY' | tee "$out/against-engine.md"
import sys
engine = {}
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.strip().strip("|").split("|")]
    if f[0].isdigit():
        engine[int(f[0])] = float(f[6])
print("| flag | batch | requests | service tok/s | engine e2e tok/s | service / engine | ITL p50 / p99 ms |")
print("|---|---|---|---|---|---|---|")
for line in open(sys.argv[2]):
    f = [x.strip() for x in line.strip().strip("|").split("|")]
    if len(f) < 8 or not f[3].isdigit() or f[5] == "-":
        continue
    tok, batch = float(f[5].replace(",", "")), int(f[3])
    print(f"| {f[2] or '(defaults)'} | {batch} | {f[4]} | {tok:,.0f} | {engine[batch]:,.0f} | "
          f"{tok / engine[batch]:.3f} | {f[7]} |")
PY
work=$(mktemp -d)
tar -C "$work" -xzf "$out/logs.tar.gz"
for f in "$work"/steps-*.tsv; do
  python3 - "$f" <<'PY'
import os, sys
rows = [l.split('\t') for l in open(sys.argv[1]) if l.strip()]
prompts = sorted(int(r[4]) for r in rows if int(r[4]) > 0)  # prompts of the steps with any
print(f"{os.path.basename(sys.argv[1])}: {len(rows)} steps, {len(prompts)} with prompts; "
      "prompts per such step (count:steps): "
      + " ".join(f"{n}:{prompts.count(n)}" for n in sorted(set(prompts))))
PY
done | tee "$out/prompt-steps.txt"
