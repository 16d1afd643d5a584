#!/usr/bin/env bash
# Structured outputs at scale: 1,024 generations under 32 seeded random JSON Schemas at
# temperature 1, from one coordinator and one CPU worker serving a tiny random-weight model (a
# 512-token byte-level vocabulary, so that token masks are cheap), every output parsed and
# validated by ajv (npm, installed into the build folder; exit 77, reported as skipped, when npm
# cannot reach a registry, a failure with CI=true: tests/skip.sh).
# usage: structured_outputs_test.sh BIN_DIR WORK_DIR
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../skip.sh"
bin=$1 work=$2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work"
source "$here/node_test_lib.sh"
npm_packages ajv@8

"$bin/tandem-make-model" --preset=tiny-gpt2 --max_positions=512 --out="$run/model" --seed=7 \
  >/dev/null
# 64 slots: eight requests of n = 8 in one batch.
"$bin/tandem-coordinator" --listen=127.0.0.1:0 --http_listen=127.0.0.1:0 --metrics_address= \
  --model_dir="$run/model" --max_slots=64 >"$run/coordinator.log" 2>&1 &
pids+=($!)
http=http://127.0.0.1:$(port_of "$run/coordinator.log" http)
"$bin/tandem-worker" --coordinator=127.0.0.1:$(port_of "$run/coordinator.log" listening) \
  --listen=127.0.0.1:0 >"$run/worker.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "$http/health")" = 200 ] && break
  sleep 0.1
done
cp "$here/structured_outputs_client.mjs" "$work/"
# 32 schemas x 4 requests x n = 8, from seed 35.
node "$work/structured_outputs_client.mjs" "$http/v1" 32 4 8 35 || fail "the generations"
