#!/usr/bin/env bash
# The Slurm batch scripts against a real Slurm (Debian's slurm-wlm + munge), started on this
# machine by the test and always stopped again (trap EXIT), pass or fail.
#
#   slurm_job_test.sh het     BIN_DIR WORK_DIR   slurm/tandem-het.sbatch with CPU workers (2 worker
#                                                nodes x 2) runs to COMPLETED; the run folder holds
#                                                per-rank logs and results equal to a 1-stage run
#                                                of the same prompts outside Slurm.
#   slurm_job_test.sh plain   BIN_DIR WORK_DIR   the same for slurm/tandem.sbatch (2 nodes x 1).
#   slurm_job_test.sh scancel BIN_DIR WORK_DIR   scancel while the workload runs leaves no process
#                                                of the job behind.
#
# Needs root or password-less sudo (slurmd runs as root); exits 77 (skipped) without, fails
# instead with CI=true (tests/skip.sh).
set -uo pipefail

mode=${1:?mode: het, plain or scancel}
bin_dir=$(cd "${2:?BIN_DIR}" && pwd)
work=${3:?WORK_DIR}
here=$(cd "$(dirname "$0")" && pwd)
slurm_dir=$(cd "$here/../../slurm" && pwd)

# shellcheck source=../skip.sh
source "$here/../skip.sh"
if [ "$(id -u)" -ne 0 ] && ! sudo -n true 2>/dev/null; then
  skip "needs root or password-less sudo to run slurmd"
fi

# shellcheck source=cluster.sh
source "$here/cluster.sh"
# tandem_run_prompts and friends, for the reference run.
# shellcheck source=../../slurm/lib.sh
source "$slurm_dir/lib.sh"

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

rm -rf "$work"
mkdir -p "$work"
work=$(cd "$work" && pwd)
cluster_dir="$work/cluster"
local_pids=()

on_exit() {
  local rc=$?
  if [ -n "${SLURM_CONF:-}" ] && [ -n "${job_id:-}" ]; then
    scancel "$job_id" 2>/dev/null || true
  fi
  local p
  for p in "${local_pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  wait 2>/dev/null
  cluster_stop "$cluster_dir"
  if [ $rc -ne 0 ] && [ $rc -ne 77 ]; then
    echo "---- logs (test failed, exit $rc) ----" >&2
    local f
    for f in "$work"/*.out "$work"/run/logs/*.log "$cluster_dir"/log/slurmctld.log; do
      [ -f "$f" ] && { echo "== $f" >&2; tail -20 "$f" >&2; }
    done
  fi
  exit $rc
}
trap on_exit EXIT

for b in tandem-coordinator tandem-worker tandem-cli tandem-make-model; do
  [ -x "$bin_dir/$b" ] || fail "$bin_dir/$b is not built"
done
cluster_install || fail "cannot install slurm-wlm and munge"
cluster_start "$cluster_dir" || fail "the Slurm daemons did not start"
cluster_wait_idle || fail "the Slurm nodes did not come up"

TANDEM_BIN_DIR=$bin_dir
export MAX_NEW_TOKENS=12
"$bin_dir/tandem-make-model" --preset=tiny-llama --seed=1 --out="$work/model" >/dev/null ||
  fail "tandem-make-model"

# Polls a job until it leaves the queue's active states; prints the final state of every
# component (one per line).
wait_job() {
  local id=$1 limit=$2 t states
  for t in $(seq 1 "$limit"); do
    states=$(scontrol show job "$id" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p')
    if [ -n "$states" ] && ! grep -qE 'PENDING|RUNNING|CONFIGURING|COMPLETING|SUSPENDED' <<<"$states"; then
      echo "$states"
      return 0
    fi
    sleep 1
  done
  echo "TIMEOUT $states"
  return 1
}

# The job's own processes, whatever else runs on this machine (another tandem, another job):
# those whose environment holds SLURM_JOB_ID of one of `job_ids` (the job and, for a
# heterogeneous job, its components) and this cluster's SLURM_CONF. slurmd puts both into every
# process of a job: the batch script, the steps, and what they start. One "PID COMMAND" line each.
job_ids=()
our_processes() {
  [ ${#job_ids[@]} -gt 0 ] || fail "our_processes: the job's ids are not known yet"
  local ids env pid
  ids=$(IFS='|'; echo "${job_ids[*]}")
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    [ "$pid" = $$ ] || [ "$pid" = "$BASHPID" ] && continue
    env=$(tr '\0' '\n' 2>/dev/null <"/proc/$pid/environ") || continue
    grep -qxE "SLURM_JOB_ID=($ids)" <<<"$env" && grep -qxF "SLURM_CONF=$SLURM_CONF" <<<"$env" ||
      continue
    echo "$pid $(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline")"
  done
}

# The single-process reference: one coordinator and one worker holding every layer, outside Slurm.
reference_run() {
  local out=$1 cport="" t
  mkdir -p "$out"
  # Port 0: the coordinator binds a port of the kernel's choice and prints it.
  "$bin_dir/tandem-coordinator" --listen=127.0.0.1:0 --model_dir="$work/model" \
    --stages=1 --replicas=1 $(tandem_metrics_arg tandem-coordinator 0) \
    >"$out/coordinator.log" 2>&1 &
  local_pids+=($!)
  for t in $(seq 1 100); do
    cport=$(sed -n 's/^tandem-coordinator listening on port \([0-9]*\)$/\1/p' "$out/coordinator.log")
    [ -n "$cport" ] && break
    sleep 0.2
  done
  [ -n "$cport" ] || fail "the reference coordinator did not report its port: $out/coordinator.log"
  "$bin_dir/tandem-worker" --coordinator="127.0.0.1:$cport" --listen=127.0.0.1:0 \
    --advertise_host=127.0.0.1 --backend=cpu >"$out/worker.log" 2>&1 &
  local_pids+=($!)
  for t in $(seq 1 60); do
    grep -q '^pipelines {' <<<"$("$bin_dir/tandem-cli" topology --addr="127.0.0.1:$cport" 2>/dev/null)" &&
      break
    sleep 1
  done
  tandem_run_prompts "$out" "127.0.0.1:$cport" || fail "the reference run failed: $out"
  kill -TERM "${local_pids[@]}" 2>/dev/null
  wait 2>/dev/null
  local_pids=()
}

# prompt and output columns of results.csv, for comparing runs.
outputs_of() {
  python3 -c '
import csv, sys
for row in csv.DictReader(open(sys.argv[1], newline="")):
    print(repr((row["prompt"], row["exit_code"], row["finish"], row["token_ids"], row["output"])))' "$1"
}

submit() {
  local script=$1
  shift
  local cport wport
  cport=$(cluster_free_port)
  wport=$(cluster_free_port)
  (cd "$work" &&
    TANDEM_BIN_DIR="$bin_dir" MODEL_DIR="$work/model" RUN_DIR="$work/run" BACKEND=cpu \
    COORD_PORT=$cport WORKER_BASE_PORT=$wport COORD_METRICS_PORT=$(cluster_free_port) \
    WORKER_METRICS_BASE_PORT=$(cluster_free_port) READY_TIMEOUT=120 STOP_GRACE=5 \
    sbatch --parsable --time=10 "$@" "$slurm_dir/$script") | cut -d';' -f1
}

check_completed_run() {
  local states=$1 workers=$2
  echo "job $job_id: $(echo $states)"
  [ -n "$states" ] && ! grep -qv '^COMPLETED$' <<<"$states" ||
    fail "job $job_id ended as: $states"
  local id
  for id in $(scontrol show job "$job_id" | sed -n 's/^JobId=\([0-9]*\).*/\1/p'); do
    grep -q "^JobId=$id .*JobState=COMPLETED" "$cluster_dir/jobcomp.txt" ||
      fail "no COMPLETED record of job $id in the jobcomp file"
  done
  local run="$work/run"
  [ -s "$run/logs/coordinator.log" ] || fail "no coordinator log in $run/logs"
  local n
  n=$(ls "$run"/logs/worker-*.log 2>/dev/null | wc -l)
  [ "$n" -eq "$workers" ] || fail "$n worker logs in $run/logs, expected $workers"
  [ -s "$run/slurm/scontrol-show-job.txt" ] || fail "no scontrol record in $run/slurm"
  [ -s "$run/results.csv" ] && [ -s "$run/results.md" ] || fail "no results table in $run"
  reference_run "$work/reference"
  diff <(outputs_of "$work/reference/results.csv") <(outputs_of "$run/results.csv") ||
    fail "the job's outputs differ from the 1-stage reference"
  python3 -c '
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1], newline="")))
assert len(rows) >= 8, "%d results" % len(rows)
for r in rows:
    assert r["exit_code"] == "0" and r["token_ids"].strip(), "prompt " + r["index"] + " failed: " + repr(r)
' "$run/results.csv" || fail "bad results in $run/results.csv"
  echo "PASS: $(grep -c . "$run/results.csv") lines of results equal the reference; $n worker logs"
}

case "$mode" in
  het)
    job_id=$(submit tandem-het.sbatch -p cpu : -p gpu -N 2 --ntasks-per-node=2) ||
      fail "sbatch"
    states=$(wait_job "$job_id" 300)
    check_completed_run "$states" 4
    ;;
  plain)
    # Each worker splits its stage over two ranks (threads of the cpu backend): the outputs must
    # still equal the unsplit reference's.
    job_id=$(TENSOR_PARALLEL=2 submit tandem.sbatch -p gpu -N 2 --ntasks-per-node=1) ||
      fail "sbatch"
    states=$(wait_job "$job_id" 300)
    check_completed_run "$states" 2
    n=$(grep -l 'tensor parallel 2) serving' "$work"/run/logs/worker-*.log | wc -l)
    [ "$n" -eq 2 ] || fail "$n of 2 workers say they serve with tensor parallel 2"
    ;;
  scancel)
    # A workload that keeps the service busy until the job is cancelled.
    export SWEEP_CMD='while true; do "$TANDEM_BIN_DIR/tandem-cli" generate --addr="$TANDEM_ADDR" --prompt="keep going" --max_new_tokens=8 || exit 1; echo done >>"$RUN_DIR/busy"; done'
    job_id=$(submit tandem-het.sbatch -p cpu : -p gpu -N 2 --ntasks-per-node=1) ||
      fail "sbatch"
    for t in $(seq 1 180); do
      [ -s "$work/run/busy" ] && break
      state=$(scontrol show job "$job_id" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' | head -1)
      [ "$state" = PENDING ] || [ "$state" = RUNNING ] || fail "job $job_id is $state before the workload ran"
      sleep 1
    done
    [ -s "$work/run/busy" ] || fail "the workload did not start within 180 s"
    job_ids=($(scontrol show job "$job_id" | sed -n 's/^JobId=\([0-9]*\).*/\1/p'))
    procs=$(our_processes)
    grep -q tandem-coordinator <<<"$procs" && grep -q tandem-worker <<<"$procs" ||
      fail "the job's coordinator and workers are not among its processes while it runs: $procs"
    echo "workload running; processes: $(our_processes | wc -l)"
    # Every /metrics target the job lists for Prometheus answers with tandem's metrics.
    python3 - "$work/run/prometheus-targets.json" <<'EOF' ||
import json, sys, urllib.request
groups = json.load(open(sys.argv[1]))
targets = [t for g in groups for t in g["targets"]]
assert targets, "no targets"
for t in targets:
    body = urllib.request.urlopen("http://%s/metrics" % t, timeout=10).read().decode()
    assert "tandem_" in body, "no tandem_ metrics at " + t
print("%d /metrics targets answer" % len(targets))
EOF
      fail "the job's Prometheus targets do not all answer"
    # The job runs closed (SECURE=1, the default): a client without its CA and keys is refused,
    # one that sources RUN_DIR/tls/keys.env is served.
    coord=$(sed -n 's/^coordinator //p' "$work/run/endpoints.txt")
    ! "$bin_dir/tandem-cli" topology --addr="$coord" >/dev/null 2>&1 ||
      fail "a client without the job's CA and admin key was served"
    (source "$work/run/tls/keys.env" && "$bin_dir/tandem-cli" topology --addr="$coord" >/dev/null) ||
      fail "a client with the job's $work/run/tls/keys.env was refused"
    echo "closed: refused without the job's keys, served with keys.env"
    echo "scancel $job_id"
    scancel "$job_id"
    left=""
    for t in $(seq 1 20); do
      left=$(our_processes)
      [ -z "$left" ] && break
      sleep 1
    done
    [ -z "$left" ] || fail "processes left $t s after scancel: $left"
    echo "no process left ${t} s after scancel"
    states=$(wait_job "$job_id" 60)
    grep -q CANCELLED <<<"$states" || fail "job $job_id ended as: $states"
    echo "PASS: job $job_id $(echo $states)"
    ;;
  *) fail "unknown mode $mode" ;;
esac
