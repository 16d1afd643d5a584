#!/usr/bin/env bash
# The sweep of ../openllama-3b-h200x2 again with batch-invariant workers (tandem-worker
# --batch_invariant), on an nvidia-h200-x2 machine; results in $OUT.
WORKER_FLAGS=--batch_invariant MICROBATCH_CHECK=0 \
  exec bash "$(dirname "$0")/../openllama-3b-h200x2/run.sh"
