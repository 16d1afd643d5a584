#!/usr/bin/env bash
# The switches that keep skips from hiding failures: tests/skip.sh (a shell test's missing
# requirement is a skip, exit 77, but a failure with CI=true) and scripts/gpu-require (a GPU test's
# "[  SKIPPED ]" fails a GPU script's run with TANDEM_REQUIRE_GPU=1, its default).
# usage: skip_switches_test.sh REPO_ROOT WORK_DIR
set -uo pipefail
root=$1 work=$2
mkdir -p "$work"
failures=0
expect() {  # expect WANT_STATUS DESCRIPTION COMMAND...
  local want=$1 what=$2; shift 2
  "$@" > "$work/out.txt" 2>&1
  local got=$?
  if [ "$got" != "$want" ]; then
    echo "FAIL: $what: status $got, want $want"; cat "$work/out.txt"; failures=$((failures + 1))
  else
    echo "ok: $what"
  fi
}

skipping=(bash -c "source '$root/tests/skip.sh'; skip 'npm is not installed'")
expect 77 "a missing requirement skips outside CI" env -u CI "${skipping[@]}"
expect 77 "CI=false still skips" env CI=false "${skipping[@]}"
expect 1 "CI=true turns the skip into a failure" env CI=true "${skipping[@]}"
grep -q "npm is not installed" "$work/out.txt" ||
  { echo "FAIL: the failure does not say why"; failures=$((failures + 1)); }

cat > "$work/skipped.log" <<'LOG'
[ RUN      ] CudaStageTest.Decode
[  SKIPPED ] CudaStageTest.Decode (0 ms)
[==========] 1 test from 1 test suite ran. (0 ms total)
[  PASSED  ] 0 tests.
[  SKIPPED ] 1 test, listed below:
[  SKIPPED ] CudaStageTest.Decode
LOG
cat > "$work/ran.log" <<'LOG'
[ RUN      ] CudaStageTest.Decode
[       OK ] CudaStageTest.Decode (12 ms)
[==========] 1 test from 1 test suite ran. (12 ms total)
[  PASSED  ] 1 test.
LOG
expect 1 "a skipped GPU test fails by default" env -u TANDEM_REQUIRE_GPU \
  bash -c "source '$root/scripts/gpu-require'; gpu_tests_ran '$work/skipped.log' cuda_stage_test"
grep -q "CudaStageTest.Decode" "$work/out.txt" ||
  { echo "FAIL: the skipped test is not named"; failures=$((failures + 1)); }
for switch in 1 0; do
  want=$((switch == 1))
  expect $want "TANDEM_REQUIRE_GPU=$switch with a skip" env TANDEM_REQUIRE_GPU=$switch \
    bash -c "source '$root/scripts/gpu-require'; gpu_tests_ran '$work/skipped.log' cuda_stage_test"
  expect 0 "TANDEM_REQUIRE_GPU=$switch, every test ran" env TANDEM_REQUIRE_GPU=$switch \
    bash -c "source '$root/scripts/gpu-require'; gpu_tests_ran '$work/ran.log' cuda_stage_test"
done
exit $((failures > 0))
