#!/usr/bin/env bash
# On the GPU machine, from the repository root, after run_gpu.sh trained MODEL: scores the model
# through tandem (one coordinator with the HTTP API, one CUDA worker) on the held-out windows that
# perplexity_hf.py scores, once per precision in PRECISIONS (default "fp16 fp8 fp16-kv8 fp8-kv8":
# fp16 weights; FP8 weights quantized at load; each of those with the FP8 KV-cache,
# --kv_cache_dtype fp8). Results to $OUT: hf_tokens.json (the windows), tandem_<precision>.json,
# and the processes' logs.
# Environment: BIN (tandem binaries, default .carry/bin), MODEL, DATA, OUT, PRECISIONS.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=${BIN:-$PWD/.carry/bin}
data=${DATA:-.acc-data}
model=${MODEL:-/tmp/tandem-acc-model}
out=${OUT:-/tmp/tandem-acc}
mkdir -p "$out"
here=tools/accuracy
if [ ! -f "$out/hf_tokens.json" ]; then
  python3 "$here/perplexity_hf.py" --model "$model" --heldout "$data/heldout.txt" \
    --tokens_out "$out/hf_tokens.json" --out "$out/hf_float16_sdpa.json" | tail -1
fi
pids=()
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; pids=(); }
trap stop_all EXIT
for precision in ${PRECISIONS:-fp16 fp8 fp16-kv8 fp8-kv8}; do
  quantization="" kv=auto
  case $precision in
    fp8) quantization=fp8 ;;
    fp16-kv8) kv=fp8 ;;
    fp8-kv8) quantization=fp8 kv=fp8 ;;
  esac
  "$bin/tandem-coordinator" --listen=127.0.0.1:50051 --http_listen=127.0.0.1:8000 \
    --model_dir="$model" --stages=1 --replicas=1 --max_batch=16 --max_slots=16 \
    --max_seq_len=1024 --kv_cache_dtype=$kv > "$out/coordinator_$precision.log" 2>&1 &
  pids+=($!)
  "$bin/tandem-worker" --coordinator=127.0.0.1:50051 --listen=127.0.0.1:50060 --backend=cuda \
    --gpu=0 --dtype=f16 --quantization="$quantization" --kv_memory_fraction=0.3 \
    > "$out/worker_$precision.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 240); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:8000/health)" = 200 ] && break
    sleep 0.5
  done
  python3 "$here/perplexity_tandem.py" --url http://127.0.0.1:8000 --tokens "$out/hf_tokens.json" \
    --label "tandem $precision" --out "$out/tandem_$precision.json" 2>&1 | tail -3
  stop_all
done
