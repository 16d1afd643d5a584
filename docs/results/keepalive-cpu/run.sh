#!/usr/bin/env bash
# Kept-alive HTTP requests against fresh connections, on this machine's CPU: one coordinator with
# the HTTP API and one CPU worker serving a generated tiny-llama checkpoint; PAIRS times, two
# non-streamed /v1/completions (token-id prompt, max_tokens 1) in one curl call, so that the
# second reuses the first's connection; prints the median latency of the first and the second
# request and their difference (the pattern of Nagle's algorithm against delayed ACKs would add
# ~40 ms to the second).
# usage: docs/results/keepalive-cpu/run.sh [BUILD_DIR]   (default: build)   Output in $OUT.
set -u
cd "$(dirname "$0")/../../.."
bin=$PWD/${1:-build}/bin
out=${OUT:-/tmp/tandem-keepalive}
pairs=${PAIRS:-40}
mkdir -p "$out"
[ -f "$out/model/config.json" ] ||
  "$bin/tandem-make-model" --preset=tiny-llama --seed=1 --out="$out/model" > /dev/null || exit 1
source docs/results/serve-lib.sh
pids=()
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
start_coordinator "$out/coordinator.log" --listen=127.0.0.1:0 --http_listen=127.0.0.1:0 \
  --model_dir="$out/model" --metrics_address=
"$bin/tandem-worker" --coordinator=127.0.0.1:$port --listen=127.0.0.1:0 --backend=cpu \
  --metrics_address= > "$out/worker.log" 2>&1 &
pids+=($!)
wait_serving "$out/coordinator.log" 1 || { echo "not serving"; exit 1; }
url=http://127.0.0.1:$http/v1/completions
body='{"model":"model","prompt":[5,6,7,8],"max_tokens":1}'
: > "$out/times.tsv"
for _ in $(seq "$pairs"); do
  curl -s -o /dev/null -o /dev/null -w '%{time_total} %{num_connects}\n' \
    -H 'Content-Type: application/json' -d "$body" "$url" "$url" | paste -sd' ' >> "$out/times.tsv"
done
python3 - "$out/times.tsv" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
first = [float(r[0]) * 1e3 for r in rows]
second = [float(r[2]) * 1e3 for r in rows]
reused = sum(1 for r in rows if r[3] == "0")
print(f"{len(rows)} pairs, second request on the first's connection in {reused}: "
      f"first p50 {statistics.median(first):.2f} ms, second p50 {statistics.median(second):.2f} ms, "
      f"second - first p50 {statistics.median(s - f for f, s in zip(first, second)):+.2f} ms, "
      f"max second {max(second):.2f} ms")
PY
