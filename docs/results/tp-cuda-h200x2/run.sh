#!/usr/bin/env bash
# Tensor parallelism on the CUDA backend over two GPUs of one host, from the repository root, with
# the binaries that
#   BINS="cuda_peer_all_reduce_test cuda_tensor_parallel_test cuda_stage_fp8_test
#         cuda_stage_paged_test cuda_stage_test tandem-bench tandem-make-model" \
#     PACK=.carry-pack-tp scripts/gpu-check build
# packs: the peer all-reduce and TP2-against-TP1 suites (and the FP8, paged and one-GPU stage
# suites; TESTS="..." picks), then tandem-bench on the llama3.1-8b shape whole and split over two
# GPUs, with the all-reduce over peer memory and with NCCL's, in one call. Results to $OUT.
set -u
cd "$(dirname "$0")/../../.."
out=${OUT:-/tmp/tandem-tp}
mkdir -p "$out"
export PACK=${PACK:-.carry-pack-tp}
source scripts/carry-unpack
bin=$PWD/.carry/bin
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$out/device.txt"
export TANDEM_TEST_TMPDIR=/tmp/tandem-gpu-tests
mkdir -p "$TANDEM_TEST_TMPDIR"
t0=$SECONDS
for t in ${TESTS:-cuda_peer_all_reduce_test cuda_tensor_parallel_test cuda_stage_fp8_test cuda_stage_paged_test cuda_stage_test}; do
  echo "== $t" | tee -a "$out/tests.log"
  timeout 150 "$bin/$t" > "$out/$t.log" 2>&1
  echo "exit $? at $((SECONDS - t0)) s" | tee -a "$out/tests.log"
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]' "$out/$t.log" | tee -a "$out/tests.log"
done
m=/tmp/tandem-models/${MODEL:-llama3.1-8b}
[ -f "$m/config.json" ] ||
  "$bin/tandem-make-model" --preset "${MODEL:-llama3.1-8b}" --dtype f16 --seed 1 --out "$m" > /dev/null
echo "model at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
# TP1 and TP2 with the all-reduce over peer memory (the default where the GPUs have peer
# access), then TP2 with NCCL's all-reduce alone.
timeout 100 "$bin/tandem-bench" --model "$m" --tensor_parallel 1,2 --batch ${BATCHES:-1,64} --prompt 128 \
  --new_tokens 64 --dtype f16 --json "$out/bench.json" > "$out/bench.md" 2>&1
echo "bench exit $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
TANDEM_ALL_REDUCE=nccl timeout 100 "$bin/tandem-bench" --model "$m" --tensor_parallel 2 \
  --batch ${BATCHES:-1,64} --prompt 128 --new_tokens 64 --dtype f16 --json "$out/bench-nccl.json" \
  > "$out/bench-nccl.md" 2>&1
echo "bench (NCCL all-reduce) exit $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
grep -E '^\|' "$out/bench.md" "$out/bench-nccl.md"
grep -A8 'PrintsLatencyAgainstNccl' "$out/cuda_peer_all_reduce_test.log" | grep '^|' 
