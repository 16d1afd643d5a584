#!/usr/bin/env bash
# A client in another language, made from the proto alone: installs @grpc/grpc-js and
# @grpc/proto-loader with npm into the build folder, starts a coordinator and a CPU worker, and
# runs node_client.js against them. Exits 77 (reported as skipped) when npm cannot reach a registry;
# fails instead with CI=true (tests/skip.sh).
# usage: node_client_test.sh BIN_DIR PROTO_DIR WORK_DIR
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../skip.sh"
bin=$1 proto=$2 work=$3
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work"
source "$here/node_test_lib.sh"
npm_packages @grpc/grpc-js @grpc/proto-loader
"$bin/tandem-make-model" --preset=tiny-gpt2 --out="$run/model" --seed=3 >/dev/null
"$bin/tandem-coordinator" --listen=127.0.0.1:0 --model_dir="$run/model" >"$run/c.log" 2>&1 &
pids+=($!)
addr=127.0.0.1:$(port_of "$run/c.log")
"$bin/tandem-worker" --coordinator="$addr" --listen=127.0.0.1:0 >"$run/w.log" 2>&1 &
pids+=($!)
port_of "$run/w.log" >/dev/null
for _ in $(seq 1 300); do
  grep -q "serves with" "$run/c.log" && break
  sleep 0.1
done
if ! NODE_PATH="$work/node_modules" node "$here/node_client.js" "$addr" "$proto" \
    "$here/health.proto"; then
  echo "--- coordinator"; cat "$run/c.log"; echo "--- worker"; cat "$run/w.log"
  exit 1
fi
