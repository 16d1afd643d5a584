#!/usr/bin/env bash
# The sweep of ../openllama-3b-h200x2 again with batch-invariant workers (tandem-worker
# --batch_invariant), on an nvidia-h200-x2 machine from the repository root; results in $OUT.
WORKER_FLAGS=--batch_invariant MICROBATCH_CHECK=0 exec bash docs/results/openllama-3b-h200x2/run.sh
