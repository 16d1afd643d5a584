#!/usr/bin/env bash
# Runs on the GPU machine (one H100), from the repository root, after
# `PACK=... scripts/gpu-check` packed the binaries: where an 8,192-token prefill of the
# llama3.1-8b shape goes and what holds its clock. Writes to $OUT:
#   kernels.txt  each kernel of the first 24 of a 4-layer pass, µs (ncu gpu__time_duration, clocks
#                not fixed), the layer's sum by kernel
#   clocks.csv   power, SM clock and the clock-event reasons every 50 ms during a 32-layer
#                tandem-bench 1 x 8192 run, and a count of each (clock, power cap) state
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-/tmp/tandem-gpu-out}
mkdir -p "$out"
source scripts/carry-unpack
bin=$PWD/.carry/bin
small=/tmp/tandem-models/llama3.1-8b-16384-l4 full=/tmp/tandem-models/llama3.1-8b-16384
[ -f $small/config.json ] ||
  "$bin/tandem-make-model" --preset llama3.1-8b --out $small --max_positions 16384 --num_layers 4 >/dev/null
[ -f $full/config.json ] ||
  "$bin/tandem-make-model" --preset llama3.1-8b --out $full --max_positions 16384 >/dev/null
/usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum \
  -k 'regex:Prefill|Norm|Qkv|SwiGlu|nvjet|gemm|Gemm|Embed' -c 24 \
  "$bin/tandem-bench" --model $small --batch 1 --prompt 8192 --new_tokens 1 > /tmp/ncu.txt 2>&1
python3 - /tmp/ncu.txt > "$out/kernels.txt" <<'PY'
import re, sys
name, rows = None, []
for line in open(sys.argv[1]):
    m = re.match(r"^  (\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line)
    if m:
        name = m.group(1)
        continue
    m = re.search(r"gpu__time_duration.sum\s+(\S+)\s+([\d.,]+)", line)
    if m and name:
        v = float(m.group(2).replace(",", "")) * (1000 if m.group(1) == "ms" else 1)
        rows.append((name, v))
        name = None
for n, v in rows:
    print(f"{v:9.1f}  {n[:100]}")
PY
cat "$out/kernels.txt"
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks_event_reasons.sw_power_cap,temperature.gpu \
  --format=csv,noheader -lms 50 > "$out/clocks.csv" &
smi=$!
"$bin/tandem-bench" --model $full --batch 1 --prompt 8192 --new_tokens 1 2>&1 | tail -1
kill $smi
echo "samples: SM clock, power cap"
awk -F', ' '{print $3, "cap", $4}' "$out/clocks.csv" | sort | uniq -c | sort -rn | head -12
