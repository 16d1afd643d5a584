#!/usr/bin/env bash
# Runs on the GPU machine (one H100), from the repository root, after
# `PACK=... scripts/gpu-check` packed the binaries: the CUDA kernel and prefill attention tests,
# the kernel benchmarks (prefill attention alone and the prefill projections through cuBLAS and
# cuBLASLt's candidates, at the llama3.1-8b shape, 8,192 rows), decode of the openllama-3b shape
# at batch 1 and 64 (decode must not move), and tandem's prefill against HF transformers at
# 1 x 8192 on the llama3.1-8b shape (scripts/prefill-vs-hf). Output in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-/tmp/tandem-gpu-out}
mkdir -p "$out"
rc=0
TESTS="${TESTS-cuda_kernels_test prefill_attention_test cuda_stage_test}" \
  BENCH_MODELS="${BENCH_MODELS-openllama-3b}" BENCH_BATCHES=1,64 BENCH_GEMV=8 HF_MODELS= \
  scripts/gpu-run || rc=1
source scripts/carry-unpack
bin=$PWD/.carry/bin
"$bin/prefill_attention_test" --gtest_also_run_disabled_tests --gtest_filter='*Benchmark*' \
  2>&1 | grep -E 'prefill attention|OK|FAILED' | tee "$out/attention-bench.txt"
"$bin/cuda_kernels_test" --gtest_also_run_disabled_tests --gtest_filter='GemmBenchmark*' \
  2>&1 | grep -E 'gemm|lt #|OK|FAILED' | tee "$out/gemm-bench.txt"
MAX_POSITIONS=16384 OUT=$out scripts/prefill-vs-hf llama3.1-8b "${SHAPES:-1x8192}" || rc=1
exit $rc
