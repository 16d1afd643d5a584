# Sourced by the docs/results scripts that run on the GPU machine, from the repository root (bash):
# the steps every one of them takes first.
#
# gpu_setup OUT_DEFAULT PACK_DEFAULT: the results folder out ($OUT, else OUT_DEFAULT) made; the
# binaries of $PACK (else PACK_DEFAULT) unpacked (scripts/carry-unpack), bin their folder; models
# the folder of generated checkpoints; rc=0; t0 the start; the GPU's name, memory and driver in
# $out/device.txt; TANDEM_TEST_TMPDIR for the GPU tests.
gpu_setup() {
  out=${OUT:-$1}
  mkdir -p "$out"
  export PACK=${PACK:-$2}
  source scripts/carry-unpack || exit 1
  bin=$PWD/.carry/bin
  models=/tmp/tandem-models
  rc=0
  t0=$SECONDS
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader |
    tee "$out/device.txt"
  export TANDEM_TEST_TMPDIR=/tmp/tandem-gpu-tests
  mkdir -p "$TANDEM_TEST_TMPDIR"
}

# gpu_tests LIMIT TEST...: runs each GPU test binary (LIMIT seconds at most), its summary lines
# (and the failures' context) appended to $out/tests.log and printed; rc=1 where one fails. The
# lines matching $TEST_EXTRA (an extended regular expression, where set) are kept too.
gpu_tests() {
  local limit=$1 t st
  shift
  for t in "$@"; do
    echo "== $t" | tee -a "$out/tests.log"
    timeout "$limit" "$bin/$t" > "/tmp/$t.log" 2>&1
    st=$?
    grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]' "/tmp/$t.log" | tee -a "$out/tests.log"
    if [ -n "${TEST_EXTRA:-}" ]; then
      grep -E -A1 "$TEST_EXTRA" "/tmp/$t.log" | head -6 | tee -a "$out/tests.log"
    fi
    if [ "$st" -ne 0 ]; then
      rc=1
      grep -B12 -E '^\[  FAILED' "/tmp/$t.log" | head -80 | tee -a "$out/tests.log"
    fi
  done
  echo "tests done at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
}

# gpu_model PRESET: generates the preset's checkpoint (f16, seed 1) into $models/PRESET unless it
# is there; rc=1 where that fails.
gpu_model() {
  [ -f "$models/$1/config.json" ] ||
    "$bin/tandem-make-model" --preset "$1" --dtype f16 --seed 1 --out "$models/$1" > /dev/null ||
    rc=1
}
