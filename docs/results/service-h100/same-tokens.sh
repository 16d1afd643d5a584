#!/usr/bin/env bash
# Greedy tokens through the service against the engine's, on one GPU, from the repository root,
# with the binaries that `scripts/gpu-check` packs: PROMPTS prompts (default 24; random ids,
# 16 to 128 tokens) run one at a time by `tandem-bench --batch_invariant --dump_logits` (STEPS
# greedy tokens each, default 64), then all at once through one coordinator and one CUDA worker
# started with --batch_invariant (decode steps of many sequences, launched ahead, fed on the
# device), each by `tandem-cli generate --token_ids ... --ignore_eos`. Prints, per prompt, whether
# the service's tokens equal the engine's and where they first differ; WORKER_FLAG is added to
# the worker's flags (e.g. --launch_ahead=false). Writes prompts.json, engine.json, service.txt
# and same-tokens.md to $OUT.
set -u
cd "$(dirname "$0")/../../.."
export PACK=${PACK:-.carry-pack}
out=${OUT:-/tmp/tandem-same-tokens}
mkdir -p "$out"
source scripts/carry-unpack
bin=$PWD/.carry/bin
model=/tmp/tandem-models/openllama-3b
[ -f "$model/config.json" ] ||
  "$bin/tandem-make-model" --preset=openllama-3b --dtype=f16 --seed=1 --out="$model" > /dev/null ||
  exit 1
n=${PROMPTS:-24}
steps=${STEPS:-64}
python3 - "$model/config.json" "$n" "$steps" > "$out/prompts.json" <<'PY'
import json, random, sys
vocab = json.load(open(sys.argv[1]))["vocab_size"]
rng = random.Random(7)
prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(16, 129))]
           for _ in range(int(sys.argv[2]))]
print(json.dumps({"prompts": prompts, "steps": int(sys.argv[3])}))
PY
"$bin/tandem-bench" --model="$model" --batch_invariant --dump_logits "$out/prompts.json" \
  "$out/engine.json" || exit 1
source docs/results/serve-lib.sh
pids=()
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
work=$(mktemp -d)
start_coordinator "$work/coordinator.log" --listen=127.0.0.1:0 --model_dir="$model" --stages=1 \
  --replicas=1 --max_batch=64 --max_slots=64 --max_seq_len=1024 --metrics_address=
"$bin/tandem-worker" --coordinator=127.0.0.1:$port --listen=127.0.0.1:0 --backend=cuda --gpu=0 \
  --dtype=f16 --kv_memory_fraction=0.5 --metrics_address= --batch_invariant ${WORKER_FLAG:-} \
  > "$work/worker.log" 2>&1 &
pids+=($!)
wait_serving "$work/coordinator.log" 1 || {
  echo "no pipeline serves"; cp "$work"/*.log "$out/"; tail -5 "$work"/*.log; exit 1; }
python3 - "$out/prompts.json" > "$work/ids.txt" <<'PY'
import json, sys
for p in json.load(open(sys.argv[1]))["prompts"]:
    print(",".join(map(str, p)))
PY
i=0
clients=()
while read -r ids; do
  timeout 120 "$bin/tandem-cli" generate --addr=127.0.0.1:$port --token_ids="$ids" \
    --max_new_tokens="$steps" --ignore_eos --show_ids > /dev/null 2> "$work/service-$i.txt" &
  clients+=($!)
  i=$((i + 1))
done < "$work/ids.txt"
wait "${clients[@]}"
for j in $(seq 0 $((i - 1))); do
  sed -n 's/^ids: //p' "$work/service-$j.txt"
done > "$out/service.txt"
python3 - "$out/engine.json" "$out/service.txt" <<'PY' | tee "$out/same-tokens.md"
import json, sys
engine = [r["tokens"] for r in json.load(open(sys.argv[1]))["results"]]
service = [list(map(int, l.split())) for l in open(sys.argv[2])]
same = 0
for k, want in enumerate(engine):
    got = service[k] if k < len(service) else []
    if got == want:
        same += 1
        continue
    at = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]), min(len(got), len(want)))
    print(f"prompt {k}: first difference at token {at} of {len(want)} (service {got[at:at+3]}, engine {want[at:at+3]})")
print(f"{same} of {len(engine)} prompts: the service's greedy tokens equal tandem-bench's")
PY
grep -h "launch\|assignment" "$work/worker.log" | head -3
