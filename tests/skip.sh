# Sourced by the shell tests: `skip REASON` when something a test needs is missing (node, npm or
# its registry, a Debian tool, root for Slurm). Outside CI it exits 77, which ctest reports as
# skipped; with CI=true (as CI runs) it fails instead, so that a skip never hides a test.
skip() {
  if [ "${CI:-}" = true ]; then
    echo "FAILED: $* (CI=true: a test may not skip for want of what it needs)"
    exit 1
  fi
  echo "skipped: $*"
  exit 77
}
