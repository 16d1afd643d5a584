#!/usr/bin/env bash
# Steps in flight per pipeline against the one-stage service, on a machine with two GPUs
# (nvidia-h100-x2), from the repository root, with the binaries that `scripts/gpu-check` packs.
# For each variant "STAGES:MICRO_BATCHES[:FLAG[:WORKER_FLAG[:LOADGEN_FLAG]]]" of VARIANTS (default
# "1:0 2:2 2:3 2:4"): a fresh coordinator (--stages, --micro_batches; 0 = one per stage; FLAG, e.g.
# --decode_ahead=false, added) and one CUDA worker per GPU (WORKER_FLAG added, e.g.
# --transport=grpc; the default links CUDA workers over NCCL; LOADGEN_FLAG added to
# tandem-loadgen's, e.g. --connection_per_client), the
# openllama-3b shape (f16, seed 1), tandem-loadgen's closed loop over gRPC at each point of POINTS
# (batch and requests, default "64 192,64 640"), prompt 128, 128 new tokens, EOS ignored.
# Writes to $OUT: device.txt, sweeps.md, summary.md (tokens/s and ITL of every variant and point,
# and each against the one-stage variant) and logs.tar.gz. STEP_TRACE=1: each worker writes a line
# per step (tandem-worker --step_trace, into logs.tar.gz).
set -u
cd "$(dirname "$0")/../../.."
export PACK=${PACK:-.carry-pack}
out=${OUT:-/tmp/tandem-service-2gpu-micro}
mkdir -p "$out"
source scripts/carry-unpack
source scripts/gpu-require
bin=$PWD/.carry/bin
model=/tmp/tandem-models/openllama-3b
work=$(mktemp -d)
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$out/device.txt"
t0=$SECONDS
[ -f "$model/config.json" ] ||
  "$bin/tandem-make-model" --preset=openllama-3b --dtype=f16 --seed=1 --out="$model" > /dev/null ||
  exit 1
source docs/results/serve-lib.sh
pids=()
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
IFS=, read -ra points <<< "${POINTS:-64 192,64 640}"
for variant in ${VARIANTS:-1:0 2:2 2:3 2:4}; do
  IFS=: read -r stages micro extra wextra lextra <<< "$variant"
  name="s$stages-m$micro${extra:+-$(tr -dc 'a-z0-9' <<< "$extra")}${wextra:+-$(tr -dc 'a-z0-9' <<< "$wextra")}${lextra:+-$(tr -dc 'a-z0-9' <<< "$lextra")}"
  pids=()
  start_coordinator "$work/coordinator-$name.log" --listen=127.0.0.1:0 --model_dir="$model" \
    --stages="$stages" --replicas=1 --micro_batches="$micro" --max_batch=64 --max_slots=64 \
    --max_seq_len=1024 --metrics_address= ${extra:+"$extra"}
  for gpu in $(seq 0 $((stages - 1))); do
    "$bin/tandem-worker" --coordinator=127.0.0.1:$port --listen=127.0.0.1:0 --backend=cuda \
      --gpu=$gpu --dtype=f16 --kv_memory_fraction=0.5 --metrics_address= ${wextra:+"$wextra"} \
      ${STEP_TRACE:+--step_trace=$work/steps-$name-gpu$gpu.tsv} \
      > "$work/worker-$name-$gpu.log" 2>&1 &
    pids+=($!)
  done
  wait_serving "$work/coordinator-$name.log" 1 ||
    echo "$name: no pipeline serves" | tee -a "$out/device.txt"
  echo "$name serving at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
  for point in "${points[@]}"; do
    read -r batch requests <<< "$point"
    timeout 200 "$bin/tandem-loadgen" sweep --api=grpc --addr=127.0.0.1:$port --nodes="$stages" \
      --batch="$batch" --requests="$requests" --warmup=4 --prompt_lens=128 --output_lens=128 \
      --progress=false --out="$work/$name-b$batch-r$requests" ${lextra:+"$lextra"} \
      >> "$work/loadgen.log" 2>&1
    echo "$name b$batch r$requests exit $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
    { echo "## $name, batch $batch, $requests requests"
      cat "$work/$name-b$batch-r$requests/summary.md"; echo; } >> "$out/sweeps.md"
  done
  kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null
done
python3 - "$work" "${VARIANTS:-1:0 2:2 2:3 2:4}" "${POINTS:-64 192,64 640}" > "$out/summary.md" <<'PY'
import json, sys
work, variants, points = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(",")
import re
print("| stages | micro-batches | flag | batch | requests | tok/s | × 1 stage | ITL p50 / p99 ms |")
print("|---|---|---|---|---|---|---|---|")
for point in points:
    batch, requests = point.split()
    base = None
    for v in variants:
        stages, micro, *more = v.split(":")
        extra = more[0] if more else ""
        wextra = more[1] if len(more) > 1 else ""
        lextra = more[2] if len(more) > 2 else ""
        name = f"s{stages}-m{micro}" + "".join("-" + re.sub("[^a-z0-9]", "", f) for f in (extra, wextra, lextra) if f)
        extra = " ".join(f for f in (extra, wextra, lextra) if f)
        try:
            r = json.load(open(f"{work}/{name}-b{batch}-r{requests}/results.json"))["configs"][0]
        except Exception:
            print(f"| {stages} | {micro} | {extra} | {batch} | {requests} | - | - | - |")
            continue
        if stages == "1" and base is None:
            base = r["tokens_per_s"]
        ratio = f'{r["tokens_per_s"] / base:.3f}' if base else "-"
        print(f'| {stages} | {micro} | {extra} | {batch} | {requests} | {r["tokens_per_s"]:,.0f} | {ratio} | '
              f'{r["itl_s"]["p50"] * 1e3:.2f} / {r["itl_s"]["p99"] * 1e3:.2f} |')
PY
cat "$out/summary.md"
tar -C "$work" -czf "$out/logs.tar.gz" . 2>/dev/null
echo "total $((SECONDS - t0)) s" | tee -a "$out/device.txt"
