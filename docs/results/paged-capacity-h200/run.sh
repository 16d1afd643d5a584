#!/usr/bin/env bash
# The paged KV-cache's capacity targets through the service on one GPU, from the repository root,
# with the binaries that `BINS="tandem-coordinator tandem-worker tandem-loadgen tandem-make-model"
# PACK=.carry-pack-cap scripts/gpu-check build` packs. The llama3.1-8b shape (random weights, f16):
#   PART=a: the coordinator with default flags (pages of 16 since 2026-11-29) starts; a 100,000-token prompt;
#           256 concurrent chats of ~1,000 tokens; 400 concurrent sequences of 512 + 512 tokens in a
#           pool the size of an H100's (--kv_pages, see KV_PAGES), with the most sequences running
#           at once read from the coordinator's /metrics every 0.2 s.
#   PART=b: the mixed-length workload with pages against the best fixed-slot layout that fits the
#           same pool (prefix caching off in both, the load generator's prompts repeat; the
#           fixed-slot coordinator queues what its slots cannot take, --max_waiting 4096);
#           MIXED_REQUESTS requests (default 256) from MIXED_CLIENTS clients (default 256); MODEL
#           openllama-3b runs it on that shape (context 2,048, an H100's pool of its pages);
#           SLOTS=false leaves the fixed-slot run out; KV_FP8=true adds pages of FP8 codes
#           (--kv_cache_dtype fp8) in the same memory: twice the pages; MAX_SLOTS bounds the
#           sequences the paged runs hold at once (default 512).
#   WORKER_FLAGS: extra flags for the worker (every run), e.g. --quantization=fp8.
#   PART=c: a 2,000-token shared system prompt, 64 requests, prefix caching off and on.
# Writes to $OUT: device.txt, <part>.md (the sweeps' summaries and the peaks), logs.tar.gz.
set -u
cd "$(dirname "$0")/../../.."
export PACK=${PACK:-.carry-pack-cap}
out=${OUT:-/tmp/tandem-paged-capacity}
mkdir -p "$out"
source scripts/carry-unpack
source docs/results/serve-lib.sh
bin=$PWD/.carry/bin
preset=${MODEL:-llama3.1-8b}
model=/tmp/tandem-models/$preset
part=${PART:-a}
# An H100 has ~60 GB free after the 8B's weights; 56 GB of it in pages of 16 positions of
# 128 KiB each (every layer's K and V) is 26,700 pages. The H200 holds twice that: the runs use
# the H100's pool so that the figures speak for the smaller GPU. openllama-3b: ~72 GB free after
# its weights, 65 GB of it in pages of 16 positions of 325 KiB (26 layers of 3,200-wide K and V)
# is 12,200 pages; its context is 2,048.
if [ "$preset" = openllama-3b ]; then
  kv_pages=${KV_PAGES:-12200}
  context=2048
else
  kv_pages=${KV_PAGES:-26700}
  context=8192
fi
log=$out/$part.md
logs=$out/logs
mkdir -p "$logs"
pids=()
trap 'kill ${pids[*]} 2>/dev/null' EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$out/device.txt"
t0=$SECONDS
if [ ! -f "$model/config.json" ]; then
  "$bin/tandem-make-model" --preset "$preset" --dtype f16 --seed 1 --out "$model" > /dev/null || exit 1
  echo "generated the model in $((SECONDS - t0)) s" | tee -a "$out/device.txt"
fi
"$bin/tandem-worker" --coordinator=127.0.0.1:50051 --listen=127.0.0.1:50060 --backend=cuda --gpu=0 \
  --dtype=f16 --metrics_address=127.0.0.1:19470 ${WORKER_FLAGS:-} > "$logs/worker.log" 2>&1 &
pids+=($!)

# peak_watch FILE: writes the largest tandem_running_sequences and tandem_kv_pages{state="used"}
# seen on the coordinator's /metrics every 0.2 s into FILE until killed.
peak_watch() {
  python3 - "$1" <<'PY' &
import re, sys, time, urllib.request
peak_run = peak_used = 0
while True:
    try:
        text = urllib.request.urlopen("http://127.0.0.1:19464/metrics", timeout=2).read().decode()
        for line in text.splitlines():
            if line.startswith("tandem_running_sequences"):
                peak_run = max(peak_run, float(line.split()[-1]))
            if line.startswith("tandem_kv_pages") and 'state="used"' in line:
                peak_used = max(peak_used, float(line.split()[-1]))
        open(sys.argv[1], "w").write(f"peak running sequences {peak_run:.0f}, peak used pages {peak_used:.0f}\n")
    except Exception:
        pass
    time.sleep(0.2)
PY
  watcher=$!
}

coordinator() {  # $1: name; the rest: flags
  local name=$1
  shift
  start_coordinator "$logs/coordinator-$name.log" --listen=127.0.0.1:50051 --model_dir="$model" \
    --metrics_address=127.0.0.1:19464 "$@"
  coord=${pids[-1]}
  if wait_serving "$logs/coordinator-$name.log" 1; then
    echo "$name: serving at $((SECONDS - t0)) s ($*)" | tee -a "$log"
  else
    echo "$name: NOT serving at $((SECONDS - t0)) s ($*)" | tee -a "$log"
    tail -5 "$logs/coordinator-$name.log" | tee -a "$log"
  fi
}
stop_coordinator() { kill "$coord" 2>/dev/null; wait "$coord" 2>/dev/null; }

# CHECK=false skips the correctness check's reference runs (tandem-loadgen --check=false), which
# take much of each part's time; the figures recorded here were made with the check.
sweep() {  # $1: name; $2: timeout; the rest: loadgen flags
  local name=$1 limit=$2
  shift 2
  peak_watch "$logs/peak-$name.txt"
  timeout "$limit" "$bin/tandem-loadgen" sweep --api=grpc --addr=127.0.0.1:50051 --nodes=1 \
    --progress=false --worker_metrics=127.0.0.1:19470 --out="$logs/run-$name" \
    --check="${CHECK:-true}" "$@" \
    >> "$logs/loadgen.log" 2>&1
  local st=$?
  kill "$watcher" 2>/dev/null
  { echo "## $name (exit $st at $((SECONDS - t0)) s): $*"; cat "$logs/peak-$name.txt" 2>/dev/null
    grep -E "^\||^Correctness|^Server" "$logs/run-$name/summary.md" 2>/dev/null; echo; } >> "$log"
  echo "$name exit $st at $((SECONDS - t0)) s"
}

if [ "$part" = a ]; then
  coordinator default
  sweep long-prompt 120 --batch=1 --requests=1 --warmup=0 --prompt_pool=1 --prompt_lens=100000 \
    --output_lens=16
  sweep chats-256-default 150 --batch=256 --requests=256 --warmup=0 --prompt_lens=500 \
    --output_lens=500
  stop_coordinator
  # Prefix caching off: the load generator's prompts repeat (a pool of 16), and shared pages would
  # flatter the count.
  coordinator capacity --kv_page_size=16 --kv_pages="$kv_pages" --max_seq_len=8192 \
    --max_slots=512 --max_batch=512 --prefill_budget=8192 --prefix_caching=false
  sweep concurrent-400 180 --batch=400 --requests=400 --warmup=0 --prompt_lens=512 \
    --output_lens=512
  stop_coordinator
elif [ "$part" = b ]; then
  # The fixed-slot layout that fits the same pool at the context: for the 8B, 26,700 x 16 / 8,192
  # = 52 slots; for openllama-3b, 12,200 x 16 / 2,048 = 95.
  slots=$((kv_pages * 16 / context))
  # Seed 2's pool of 16: prompts of 210-2,748 tokens (mean 679), outputs of 7-1,897 (mean 458).
  # (Seed 1's holds one output of 7,811 tokens that alone outlasts the rest of the run.)
  mixed=(--workload=mixed --seed=2 --batch="${MIXED_CLIENTS:-256}" --requests="${MIXED_REQUESTS:-256}"
         --warmup=4 --prompt_lens=500 --output_lens=200)
  if [ "${SLOTS:-true}" = true ]; then
    coordinator mixed-slots --kv_page_size=0 --max_seq_len="$context" --max_slots="$slots" \
      --max_batch="$slots" --prefill_budget=8192 --max_waiting=4096
    sweep mixed-slots 420 "${mixed[@]}"
    stop_coordinator
  fi
  max_slots=${MAX_SLOTS:-512}
  coordinator mixed-pages --kv_page_size=16 --kv_pages="$kv_pages" --max_seq_len="$context" \
    --max_slots="$max_slots" --max_batch="$max_slots" --prefill_budget=8192 --prefix_caching=false
  sweep mixed-pages 300 "${mixed[@]}"
  stop_coordinator
  if [ "${KV_FP8:-false}" = true ]; then
    # The same memory as FP8 codes: twice the pages (--kv_cache_dtype fp8).
    coordinator mixed-pages-fp8 --kv_page_size=16 --kv_pages="$((kv_pages * 2))" \
      --max_seq_len="$context" --max_slots="$max_slots" --max_batch="$max_slots" \
      --prefill_budget=8192 --prefix_caching=false --kv_cache_dtype=fp8
    sweep mixed-pages-fp8 300 "${mixed[@]}"
    stop_coordinator
  fi
elif [ "$part" = c ]; then
  coordinator prefix-off --kv_page_size=16 --kv_pages="$kv_pages" --max_seq_len=8192 \
    --max_slots=512 --max_batch=512 --prefill_budget=8192 --prefix_caching=false
  sweep prefix-off 100 --workload=shared_prefix --shared_prefix_len=2000 --batch=64 --requests=64 \
    --warmup=4 --prompt_lens=64 --output_lens=32
  stop_coordinator
  coordinator prefix-on --kv_page_size=16 --kv_pages="$kv_pages" --max_seq_len=8192 \
    --max_slots=512 --max_batch=512 --prefill_budget=8192
  sweep prefix-on 100 --workload=shared_prefix --shared_prefix_len=2000 --batch=64 --requests=64 \
    --warmup=4 --prompt_lens=64 --output_lens=32
  stop_coordinator
fi
kill "${pids[@]}" 2>/dev/null
wait 2>/dev/null
cp "$log" "$out/" 2>/dev/null
tar -C "$out" -czf "$out/logs-$part.tar.gz" --remove-files logs
