# Sourced by the docs/results scripts that start a coordinator on this machine (bash; needs $bin,
# the folder of the tandem binaries, and an array pids of the processes to stop on exit).
#
# start_coordinator LOG ARGS...: starts tandem-coordinator with ARGS in the background, its output
# in LOG, and returns once it listens, with its ports in port (gRPC), metrics and http (empty
# where it serves none).
start_coordinator() {
  local log=$1
  shift
  "$bin/tandem-coordinator" "$@" > "$log" 2>&1 &
  pids+=($!)
  port=""
  for _ in $(seq 100); do
    port=$(sed -n 's/^tandem-coordinator listening on port \([0-9]*\)$/\1/p' "$log")
    [ -n "$port" ] && break
    sleep 0.1
  done
  metrics=$(sed -n 's/^tandem-coordinator metrics on port \([0-9]*\)$/\1/p' "$log")
  http=$(sed -n 's/^tandem-coordinator http on port \([0-9]*\)$/\1/p' "$log")
}

# wait_serving LOG N: waits (two minutes at most) until the coordinator's LOG says that N
# pipelines serve.
wait_serving() {
  for _ in $(seq 600); do
    [ "$(grep -c "serves with" "$1")" -ge "$2" ] && return 0
    sleep 0.2
  done
  return 1
}
