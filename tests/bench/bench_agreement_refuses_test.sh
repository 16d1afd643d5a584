#!/usr/bin/env bash
# tandem-bench --agreement refuses what it cannot compare before it touches a GPU, naming the
# problem, with exit status 1: a checkpoint of FP8 weights (no fp16 weights to compare against),
# an unknown --test_dtype or --quantization, an FP8 KV-cache without pages, a negative number of
# prompts (which must not run the ordinary benchmark instead).
# usage: bench_agreement_refuses_test.sh TANDEM_MAKE_MODEL TANDEM_BENCH WORK_DIR
set -u
make_model=$1 bench=$2 dir=$3
rm -rf "$dir" && mkdir -p "$dir"
"$make_model" --preset tiny-llama --quantization fp8 --seed 1 --out "$dir/fp8" > /dev/null || exit 1
"$make_model" --preset tiny-llama --seed 1 --out "$dir/f32" > /dev/null || exit 1
fail=0
expect() {  # TEXT ARGS...: tandem-bench ARGS exits 1 and prints TEXT
  local text=$1 out st
  shift
  out=$("$bench" "$@" 2>&1)
  st=$?
  if [ "$st" -ne 1 ] || ! grep -qF -- "$text" <<< "$out"; then
    echo "FAIL: tandem-bench $*: exit $st, expected 1 and '$text'; it printed: $out"
    fail=1
  else
    echo "ok: $* -> $text"
  fi
}
expect "holds FP8 weights" --model "$dir/fp8" --agreement 2
expect "--test_dtype" --model "$dir/f32" --agreement 2 --test_dtype f8
expect "--quantization: 'int4'" --model "$dir/f32" --agreement 2 --quantization int4
expect "needs the paged KV-cache" --model "$dir/f32" --agreement 2 --kv_cache_dtype fp8 \
  --kv_page_size 0
expect "--agreement -3: the number of prompts to compare must be >= 1" --model "$dir/f32" \
  --agreement -3
exit $fail
