# Shared by slurm/tandem-het.sbatch and slurm/tandem.sbatch: settings and their defaults, address
# wiring, starting the coordinator and worker steps, the readiness poll, the workload, collecting
# the run folder and stopping everything that was started.
#
# Sourced by the batch scripts. Also executed per task by srun (`bash lib.sh worker-task`, `bash
# lib.sh count-gpus`), so that nothing needs to be installed on the compute nodes besides a shared
# file system holding this folder, the binaries, the model and the run folder.

# ------------------------------------------------------------------------------------------------
# Settings (environment; see the top of the batch scripts for the list).

tandem_defaults() {
  : "${MODE:=sweep}"                  # sweep: run the workload then stop; serve: serve until the end
  : "${BACKEND:=auto}"                # auto | cpu | cuda
  : "${COORD_PORT:=50051}"            # the coordinator's gRPC port
  : "${WORKER_BASE_PORT:=$((COORD_PORT + 100))}"  # worker k of node i: base + i * per_node + k
  : "${COORD_METRICS_PORT:=9464}"     # the coordinator's Prometheus /metrics
  : "${WORKER_METRICS_BASE_PORT:=$((COORD_METRICS_PORT + 1))}"  # numbered like WORKER_BASE_PORT
  : "${READY_TIMEOUT:=900}"           # seconds to wait for every worker to register and load
  : "${STOP_GRACE:=15}"               # seconds between TERM and KILL when stopping
  : "${MAX_NEW_TOKENS:=32}"           # per prompt, for the built-in workload
  : "${MODEL_PRESET:=tiny-llama}"     # used only when MODEL_DIR is unset
  : "${MODEL_SEED:=1}"
  : "${REPLICAS:=1}"
  : "${RUN_DIR:=${SLURM_SUBMIT_DIR:-$PWD}/runs/${SLURM_JOB_ID:-local}}"
  : "${SECURE:=1}"                    # 1: TLS and keys made for this job (tandem_make_credentials)
  export MODE BACKEND COORD_PORT WORKER_BASE_PORT COORD_METRICS_PORT WORKER_METRICS_BASE_PORT
  export READY_TIMEOUT STOP_GRACE MAX_NEW_TOKENS MODEL_PRESET MODEL_SEED REPLICAS RUN_DIR SECURE
}

tandem_log() { echo "[tandem $(date +%H:%M:%S)] $*" >&2; }
tandem_die() { tandem_log "error: $*"; exit 1; }

# The folder of the tandem binaries: TANDEM_BIN_DIR, else where tandem-coordinator is on PATH,
# else build/bin next to this folder.
tandem_find_bins() {
  if [ -z "${TANDEM_BIN_DIR:-}" ]; then
    local c
    if c=$(command -v tandem-coordinator 2>/dev/null); then
      TANDEM_BIN_DIR=$(dirname "$c")
    else
      TANDEM_BIN_DIR=$(cd "$TANDEM_SLURM_DIR/.." && pwd)/build/bin
    fi
  fi
  TANDEM_BIN_DIR=$(cd "$TANDEM_BIN_DIR" 2>/dev/null && pwd) ||
    tandem_die "TANDEM_BIN_DIR ${TANDEM_BIN_DIR} does not exist"
  local b
  for b in tandem-coordinator tandem-worker tandem-cli; do
    [ -x "$TANDEM_BIN_DIR/$b" ] || tandem_die "$TANDEM_BIN_DIR/$b is missing (set TANDEM_BIN_DIR)"
  done
  export TANDEM_BIN_DIR
}

# Whether a binary accepts a flag (flags appear in --helpfull as "--name"), so that optional
# features (metrics ports) are passed only to binaries that have them.
tandem_has_flag() {
  # Older builds exit 1 from --helpfull: look at the text only.
  local help
  help=$(timeout --foreground 20 "$TANDEM_BIN_DIR/$1" --helpfull </dev/null 2>&1)
  grep -q -- "--$2[ (=]" <<<"$help"
}

# An open job (SECURE=0) listens on every interface without a cluster secret, which the programs
# refuse unless told it is on purpose (--allow_insecure, where the binary has it).
tandem_insecure_arg() {
  if [ "${SECURE:-1}" != 1 ] && tandem_has_flag "$1" allow_insecure; then
    echo "--allow_insecure"
  fi
}

# The flag that puts a binary's Prometheus /metrics on a port, if it has one
# (--metrics_address host:port). Prints nothing for a binary without metrics.
tandem_metrics_arg() {
  if tandem_has_flag "$1" metrics_address; then
    echo "--metrics_address=0.0.0.0:$2"
  fi
}

# The address other nodes reach a Slurm node by: its NodeAddr (a host name or IP; on a cluster
# usually the node name itself).
tandem_node_addr() {
  local addr
  addr=$(scontrol show node "$1" 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' | head -1)
  echo "${addr:-$1}"
}

# "n2=addr n3=addr" for a Slurm node list, handed to the worker tasks so that they need no
# scontrol call of their own.
tandem_addr_map() {
  local n out=""
  for n in $(scontrol show hostnames "$1"); do
    out+="$n=$(tandem_node_addr "$n") "
  done
  echo "${out% }"
}

# GPUs a task of the worker step can use: the devices Slurm granted (CUDA_VISIBLE_DEVICES), else
# what nvidia-smi lists, else 0.
tandem_count_gpus() {
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && [ "${CUDA_VISIBLE_DEVICES}" != "NoDevFiles" ]; then
    echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

# Decides BACKEND and WORKERS_PER_NODE from a probe on one worker node ($@: the srun options that
# place one task there) and the tasks per node the allocation asked for ($1 of the rest).
tandem_plan_workers() {
  local alloc_tasks_per_node=$1
  shift
  local gpus
  gpus=$(srun "$@" --nodes=1 --ntasks=1 bash "$TANDEM_LIB" count-gpus 2>/dev/null | tail -1)
  gpus=${gpus:-0}
  if [ "$BACKEND" = auto ]; then
    if [ "$gpus" -gt 0 ]; then BACKEND=cuda; else BACKEND=cpu; fi
  fi
  local tp=${TENSOR_PARALLEL:-1}
  [[ "$tp" =~ ^[1-9][0-9]*$ ]] || tandem_die "TENSOR_PARALLEL=$tp: not a positive whole number"
  if [ -z "${WORKERS_PER_NODE:-}" ]; then
    if [ "$BACKEND" = cuda ] && [ "$gpus" -gt 0 ]; then
      # One worker per TENSOR_PARALLEL GPUs.
      [ $((gpus % tp)) -eq 0 ] ||
        tandem_die "TENSOR_PARALLEL=$tp does not divide the ${gpus} GPU(s) of a worker node"
      WORKERS_PER_NODE=$((gpus / tp))
    else
      WORKERS_PER_NODE=${alloc_tasks_per_node:-1}
    fi
  elif [ "$BACKEND" = cuda ] && [ $((WORKERS_PER_NODE * tp)) -gt "$gpus" ]; then
    tandem_die "WORKERS_PER_NODE=$WORKERS_PER_NODE x TENSOR_PARALLEL=$tp GPUs per node, but a worker node has ${gpus}"
  fi
  TENSOR_PARALLEL=$tp
  export BACKEND WORKERS_PER_NODE TENSOR_PARALLEL
  tandem_log "worker nodes: ${gpus} GPU(s) seen, backend ${BACKEND}, ${WORKERS_PER_NODE} worker(s) per node, tensor parallel ${TENSOR_PARALLEL}"
}

# The checkpoint: MODEL_DIR, else a random-weight one of MODEL_PRESET made into the run folder.
tandem_prepare_model() {
  if [ -n "${MODEL_DIR:-}" ]; then
    [ -f "$MODEL_DIR/config.json" ] || tandem_die "MODEL_DIR $MODEL_DIR has no config.json"
  else
    MODEL_DIR="$RUN_DIR/model"
    [ -x "$TANDEM_BIN_DIR/tandem-make-model" ] ||
      tandem_die "MODEL_DIR is unset and $TANDEM_BIN_DIR/tandem-make-model is missing"
    tandem_log "MODEL_DIR unset: writing a random ${MODEL_PRESET} checkpoint to $MODEL_DIR"
    "$TANDEM_BIN_DIR/tandem-make-model" --preset="$MODEL_PRESET" --seed="$MODEL_SEED" \
      --out="$MODEL_DIR" >"$RUN_DIR/logs/make-model.log" 2>&1 ||
      tandem_die "tandem-make-model failed: $(tail -3 "$RUN_DIR/logs/make-model.log")"
  fi
  MODEL_DIR=$(cd "$MODEL_DIR" && pwd)
  export MODEL_DIR
}

# Closes the job's service (SECURE=1, the default): a CA made for this job signs one certificate
# for every member (the job's node names and addresses, localhost), so the coordinator and the
# workers talk mutual TLS, and random keys guard the services: TANDEM_API_KEY (Inference),
# TANDEM_ADMIN_KEY (Admin), TANDEM_CLUSTER_SECRET (Registry, Worker, StageLink). Keys set at
# submission are kept. Every tandem program of the job reads the TLS files and the keys from the
# environment (TANDEM_TLS_CA, TANDEM_TLS_CERT, TANDEM_TLS_KEY and the keys; srun passes it on), so
# nothing secret appears on a command line. RUN_DIR/tls (mode 700) keeps the certificates and
# keys.env, which a client outside the job sources. The CA's key is deleted once it has signed.
tandem_make_credentials() {
  if [ "$SECURE" != 1 ]; then
    tandem_log "SECURE=$SECURE: no TLS and no keys; whoever reaches the ports can use the service"
    return 0
  fi
  command -v openssl >/dev/null 2>&1 ||
    tandem_die "SECURE=1 needs openssl where the batch script runs (or submit with SECURE=0)"
  tandem_has_flag tandem-coordinator tls_cert ||
    tandem_die "$TANDEM_BIN_DIR/tandem-coordinator has no --tls_cert; SECURE=0 runs it open"
  local dir="$RUN_DIR/tls" san="DNS:localhost,IP:127.0.0.1" n kv names
  (umask 077 && mkdir -p "$dir") && chmod 700 "$dir" || tandem_die "cannot make $dir"
  names=("${TANDEM_COORD_NODE:-}" "${TANDEM_COORD_HOST:-}" "$(hostname)"
         "$(hostname -f 2>/dev/null)")
  for kv in ${TANDEM_WORKER_ADDRS:-}; do names+=("${kv%%=*}" "${kv#*=}"); done
  for n in $(printf '%s\n' "${names[@]}" |
             grep -v -e '^$' -e '^localhost$' -e '^127\.0\.0\.1$' | sort -u); do
    if [[ $n =~ ^[0-9.]+$ || $n == *:* ]]; then san+=",IP:$n"; else san+=",DNS:$n"; fi
  done
  local ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' \
    "$san" >"$dir/member.ext"
  if ! (umask 077 &&
        openssl req -x509 "${ec[@]}" -days 30 -subj "/CN=tandem job ${SLURM_JOB_ID:-local} CA" \
          -keyout "$dir/ca.key" -out "$dir/ca.pem" \
          -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign &&
        openssl req "${ec[@]}" -subj "/CN=tandem job ${SLURM_JOB_ID:-local} member" \
          -keyout "$dir/member.key" -out "$dir/member.csr" &&
        openssl x509 -req -in "$dir/member.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
          -CAcreateserial -days 30 -out "$dir/member.pem" -extfile "$dir/member.ext") \
       >"$RUN_DIR/logs/openssl.log" 2>&1; then
    tandem_die "openssl could not make the job's certificates: $(tail -3 "$RUN_DIR/logs/openssl.log")"
  fi
  rm -f "$dir/ca.key" "$dir/member.csr" "$dir/ca.srl"
  export TANDEM_TLS_CA="$dir/ca.pem" TANDEM_TLS_CERT="$dir/member.pem"
  export TANDEM_TLS_KEY="$dir/member.key"
  : "${TANDEM_API_KEY:=$(openssl rand -hex 24)}"
  : "${TANDEM_ADMIN_KEY:=$(openssl rand -hex 24)}"
  : "${TANDEM_CLUSTER_SECRET:=$(openssl rand -hex 32)}"
  export TANDEM_API_KEY TANDEM_ADMIN_KEY TANDEM_CLUSTER_SECRET
  (umask 077 && {
    local v
    for v in TANDEM_TLS_CA TANDEM_API_KEY TANDEM_ADMIN_KEY; do
      printf 'export %s=%q\n' "$v" "${!v}"
    done
  } >"$dir/keys.env")
  tandem_log "closed: mutual TLS (CA $dir/ca.pem, names $san) and keys;" \
    "clients: source $dir/keys.env"
}

# ------------------------------------------------------------------------------------------------
# Processes. Every background process the batch script starts is recorded in TANDEM_PIDS and
# stopped by tandem_stop_all (TERM to the whole process tree, then KILL after STOP_GRACE).

TANDEM_PIDS=()
TANDEM_STOPPING=0

tandem_track() { TANDEM_PIDS+=("$1"); }

# Descendants of a pid, children first listed after their parent.
tandem_tree() {
  local p=$1 c
  echo "$p"
  for c in $(ps -o pid= --ppid "$p" 2>/dev/null); do
    tandem_tree "$c"
  done
}

tandem_alive() {
  local p
  for p in "$@"; do kill -0 "$p" 2>/dev/null && return 0; done
  return 1
}

# Waits up to $1 seconds for the pids that follow to end.
tandem_wait_gone() {
  local secs=$1 i
  shift
  for i in $(seq 1 $((secs * 10))); do
    tandem_alive "$@" || return 0
    sleep 0.1
  done
  return 1
}

# Stops what the batch script started: TERM to the tasks of every step of this job (through
# Slurm, which reaches every node; the batch shell itself is not signalled) and to the local
# process trees (the workload), then, after STOP_GRACE, the srun processes themselves (srun ends
# its step with KILL) and KILL to whatever is left.
tandem_stop_all() {
  local pids=() p
  for p in "${TANDEM_PIDS[@]}"; do
    kill -0 "$p" 2>/dev/null && pids+=($(tandem_tree "$p"))
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  tandem_log "stopping ${#pids[@]} process(es)"
  local local_pids=()
  for p in "${pids[@]}"; do
    [ "$(ps -o comm= -p "$p" 2>/dev/null)" = srun ] || local_pids+=("$p")
  done
  if [ -n "${SLURM_JOB_ID:-}" ]; then
    scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || true
  fi
  [ ${#local_pids[@]} -gt 0 ] && kill -TERM "${local_pids[@]}" 2>/dev/null
  if ! tandem_wait_gone "$STOP_GRACE" "${pids[@]}"; then
    kill -TERM "${pids[@]}" 2>/dev/null || true
    tandem_wait_gone 5 "${pids[@]}" || kill -KILL "${pids[@]}" 2>/dev/null || true
  fi
  wait 2>/dev/null || true
}

# Installed by the batch scripts: on scancel, the time limit (--signal=B:TERM@...), Ctrl-C of an
# interactive allocation, or any exit, stop everything and keep what was collected so far.
tandem_on_exit() {
  local rc=$?
  trap - EXIT TERM INT
  TANDEM_STOPPING=1
  tandem_stop_all
  tandem_collect_slurm || true
  tandem_log "run folder: $RUN_DIR (exit $rc)"
  exit "$rc"
}

tandem_on_signal() {
  tandem_log "received SIG$1: stopping"
  echo "SIG$1" >"$RUN_DIR/stopped-by-signal"
  exit $((128 + $2))
}

tandem_install_traps() {
  trap tandem_on_exit EXIT
  trap 'tandem_on_signal TERM 15' TERM
  trap 'tandem_on_signal INT 2' INT
  trap 'tandem_on_signal USR1 10' USR1
}

# Starts the coordinator as a step ($@: the srun options that place it on one node).
tandem_start_coordinator() {
  local args=(--listen="0.0.0.0:${COORD_PORT}" --model_dir="$MODEL_DIR"
              --stages="$STAGES" --replicas="$REPLICAS")
  [ -n "${COORD_CONFIG:-}" ] && args+=(--config="$COORD_CONFIG")
  local m
  m=$(tandem_insecure_arg tandem-coordinator)
  [ -n "$m" ] && args+=("$m")
  m=$(tandem_metrics_arg tandem-coordinator "$COORD_METRICS_PORT")
  [ -n "$m" ] && args+=("$m")
  # shellcheck disable=SC2206
  args+=(${COORD_EXTRA_ARGS:-})
  echo "$TANDEM_BIN_DIR/tandem-coordinator ${args[*]}" >"$RUN_DIR/logs/coordinator.cmd"
  srun "$@" --nodes=1 --ntasks=1 --kill-on-bad-exit=1 \
    --output="$RUN_DIR/logs/coordinator.log" --error="$RUN_DIR/logs/coordinator.log" \
    "$TANDEM_BIN_DIR/tandem-coordinator" "${args[@]}" &
  TANDEM_COORD_PID=$!
  tandem_track $TANDEM_COORD_PID
}

# Starts one worker per (node, local rank) as one step ($@: the srun options that place it).
tandem_start_workers() {
  # --overcommit: one worker per GPU even where the allocation asked for fewer tasks than GPUs.
  srun "$@" --nodes="$WORKER_NODES" --ntasks=$((WORKER_NODES * WORKERS_PER_NODE)) \
    --ntasks-per-node="$WORKERS_PER_NODE" --overcommit \
    --output="$RUN_DIR/logs/worker-%t-%N.log" --error="$RUN_DIR/logs/worker-%t-%N.log" \
    bash "$TANDEM_LIB" worker-task &
  TANDEM_WORKERS_PID=$!
  tandem_track $TANDEM_WORKERS_PID
}

# Runs inside each worker task (srun): picks its port from its node index and local rank and
# becomes tandem-worker.
tandem_worker_task() {
  local node_index=${SLURM_NODEID:?} local_rank=${SLURM_LOCALID:?}
  local port=$((WORKER_BASE_PORT + node_index * WORKERS_PER_NODE + local_rank))
  local mport=$((WORKER_METRICS_BASE_PORT + node_index * WORKERS_PER_NODE + local_rank))
  local host="" kv
  for kv in ${TANDEM_WORKER_ADDRS:-}; do
    [ "${kv%%=*}" = "$SLURMD_NODENAME" ] && host=${kv#*=}
  done
  host=${host:-$(hostname)}
  local args=(--coordinator="$TANDEM_COORD_ADDR" --listen="0.0.0.0:${port}"
              --advertise_host="${host}" --backend="$BACKEND")
  local insecure
  insecure=$(tandem_insecure_arg tandem-worker)
  [ -n "$insecure" ] && args+=("$insecure")
  # A closed job's workers load nothing but its checkpoint.
  [ "${SECURE:-0}" = 1 ] && tandem_has_flag tandem-worker model_root &&
    args+=(--model_root="$MODEL_DIR")
  local tp=${TENSOR_PARALLEL:-1}
  # A worker of TENSOR_PARALLEL ranks: GPUs (cuda) or threads (cpu) that split each layer.
  [ "$tp" -gt 1 ] && args+=(--tensor_parallel="$tp")
  if [ "$BACKEND" = cuda ]; then
    # TENSOR_PARALLEL GPUs per worker, from local_rank x TENSOR_PARALLEL: by index where the
    # worker takes one, else by narrowing the devices it sees to its entries of what Slurm
    # granted.
    local first=$((local_rank * tp))
    if tandem_has_flag tandem-worker gpu; then
      args+=(--gpu="$first")
    elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
      local devices
      IFS=, read -r -a devices <<<"$CUDA_VISIBLE_DEVICES"
      export CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${devices[*]:$first:$tp}")
    else
      export CUDA_VISIBLE_DEVICES=$(seq -s, "$first" $((first + tp - 1)))
    fi
  fi
  local m
  m=$(tandem_metrics_arg tandem-worker "$mport")
  [ -n "$m" ] && args+=("$m")
  # shellcheck disable=SC2206
  args+=(${WORKER_EXTRA_ARGS:-})
  echo "rank ${SLURM_PROCID} node ${SLURMD_NODENAME} (${host}) local ${local_rank}:" \
    "$TANDEM_BIN_DIR/tandem-worker ${args[*]}"
  exec "$TANDEM_BIN_DIR/tandem-worker" "${args[@]}"
}

# Fails at once when a step has ended (a worker or the coordinator died).
tandem_check_steps() {
  kill -0 "$TANDEM_COORD_PID" 2>/dev/null ||
    tandem_die "the coordinator step ended; see $RUN_DIR/logs/coordinator.log"
  kill -0 "$TANDEM_WORKERS_PID" 2>/dev/null ||
    tandem_die "the worker step ended; see $RUN_DIR/logs/worker-*.log"
}

# Waits until the coordinator's topology shows REPLICAS serving pipelines, which needs every
# worker registered and its layers loaded; then records the topology and the workers.
tandem_wait_ready() {
  local deadline=$((SECONDS + READY_TIMEOUT)) cli="$TANDEM_BIN_DIR/tandem-cli" n
  tandem_log "waiting for ${STAGES} x ${REPLICAS} workers at ${TANDEM_COORD_ADDR}"
  while true; do
    tandem_check_steps
    n=$(timeout --foreground 30 "$cli" topology --addr="$TANDEM_COORD_ADDR" 2>"$RUN_DIR/logs/ready-probe.log" |
        grep -c '^pipelines {')
    [ "${n:-0}" -ge "$REPLICAS" ] && break
    [ $SECONDS -lt $deadline ] ||
      tandem_die "not ready after ${READY_TIMEOUT} s ($n of ${REPLICAS} pipelines serve): $(tail -2 "$RUN_DIR/logs/ready-probe.log")"
    sleep 1
  done
  tandem_log "serving: ${TANDEM_COORD_ADDR}"
  "$cli" topology --addr="$TANDEM_COORD_ADDR" >"$RUN_DIR/topology.txt" 2>&1 || true
  "$cli" workers --addr="$TANDEM_COORD_ADDR" >"$RUN_DIR/workers.txt" 2>&1 || true
}

# ------------------------------------------------------------------------------------------------
# The workload.

# The built-in prompts: fixed, so that a run's greedy outputs can be compared with any other run of
# the same checkpoint.
tandem_default_prompts() {
  cat <<'EOF'
The quick brown fox
Once upon a time
In a distributed system, every node
Pipeline parallelism splits a model into
The capital of France is
def fibonacci(n):
Slurm schedules jobs on
1, 2, 3, 5, 8,
EOF
}

# CSV field: quoted, inner quotes doubled, newlines kept (RFC 4180).
tandem_csv() { local s=${1//\"/\"\"}; printf '"%s"' "$s"; }
# Markdown table cell: one line, pipes escaped.
tandem_md() { local s=${1//|/\\|}; s=${s//$'\n'/ }; printf '%s' "${s//$'\r'/ }"; }

# Sends every prompt (PROMPTS_FILE or the built-in list) through tandem-cli, greedy, one after the
# other; writes $1/results.csv and $1/results.md. Usage: tandem_run_prompts OUT_DIR ADDR.
tandem_run_prompts() {
  local out=$1 addr=$2
  local prompts=()
  if [ -n "${PROMPTS_FILE:-}" ]; then
    mapfile -t prompts <"$PROMPTS_FILE"
  else
    mapfile -t prompts < <(tandem_default_prompts)
  fi
  mkdir -p "$out"
  echo "index,prompt,max_new_tokens,exit_code,seconds,finish,token_ids,output" >"$out/results.csv"
  {
    echo "| # | prompt | exit | seconds | finish | output |"
    echo "|---|---|---|---|---|---|"
  } >"$out/results.md"
  local i=0 failed=0 p text rc t0 t1 secs ids finish err="$out/.prompt.err"
  for p in "${prompts[@]}"; do
    [ -n "$p" ] || continue
    t0=$(date +%s.%N)
    # stdout: the generated text; stderr: "ids: ..." and "[finish: ..., ...]".
    text=$("$TANDEM_BIN_DIR/tandem-cli" generate --addr="$addr" --prompt="$p" \
             --max_new_tokens="$MAX_NEW_TOKENS" --temperature=0 --show_ids 2>"$err")
    rc=$?
    t1=$(date +%s.%N)
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')
    ids=$(sed -n 's/^ids: *//p' "$err" | head -1)
    finish=$(sed -n 's/^\[finish: \([a-z]*\).*/\1/p' "$err" | head -1)
    if [ $rc -ne 0 ]; then
      failed=$((failed + 1))
      text=$(grep -v '^ids:' "$err" | tail -3)
      echo "prompt $i failed: $text" >&2
    fi
    printf '%d,%s,%d,%d,%s,%s,%s,%s\n' "$i" "$(tandem_csv "$p")" "$MAX_NEW_TOKENS" "$rc" "$secs" \
      "$finish" "$ids" "$(tandem_csv "$text")" >>"$out/results.csv"
    printf '| %d | %s | %d | %s | %s | %s |\n' "$i" "$(tandem_md "$p")" "$rc" "$secs" "$finish" \
      "$(tandem_md "$text")" >>"$out/results.md"
    i=$((i + 1))
  done
  rm -f "$err"
  tandem_log "workload: ${i} prompt(s), ${failed} failed; $out/results.csv"
  [ $failed -eq 0 ]
}

# The workload of MODE=sweep: SWEEP_CMD (run by bash with TANDEM_ADDR, RUN_DIR, STAGES, REPLICAS,
# TANDEM_BIN_DIR in its environment), else `tandem-loadgen sweep` when it is built, else the
# built-in prompts. Runs in the background so that signals reach the traps at once.
tandem_run_workload() {
  export TANDEM_ADDR=$TANDEM_COORD_ADDR STAGES REPLICAS
  local pid
  if [ -n "${SWEEP_CMD:-}" ]; then
    tandem_log "workload: $SWEEP_CMD"
    bash -c "$SWEEP_CMD" >"$RUN_DIR/logs/workload.log" 2>&1 &
    pid=$!
  elif [ -x "$TANDEM_BIN_DIR/tandem-loadgen" ]; then
    # The built-in prompts first (a results table of outputs to compare), then the sweep.
    # shellcheck disable=SC2086
    tandem_log "workload: built-in prompts, then tandem-loadgen sweep ${SWEEP_ARGS:-}"
    { tandem_run_prompts "$RUN_DIR" "$TANDEM_COORD_ADDR" &&
      "$TANDEM_BIN_DIR/tandem-loadgen" sweep --addr="$TANDEM_COORD_ADDR" --out="$RUN_DIR/sweep" \
        ${SWEEP_ARGS:-}; } >"$RUN_DIR/logs/workload.log" 2>&1 &
    pid=$!
  else
    tandem_log "workload: built-in prompts through tandem-cli"
    tandem_run_prompts "$RUN_DIR" "$TANDEM_COORD_ADDR" >"$RUN_DIR/logs/workload.log" 2>&1 &
    pid=$!
  fi
  tandem_track $pid
  echo running >"$RUN_DIR/workload-state"
  local rc=0
  wait $pid || rc=$?
  echo "exit $rc" >"$RUN_DIR/workload-state"
  return $rc
}

# MODE=serve: keeps serving until a step ends, the job is cancelled or reaches its time limit.
tandem_serve() {
  tandem_log "serving until the job ends (scancel ${SLURM_JOB_ID:-} to stop)"
  echo serving >"$RUN_DIR/workload-state"
  while kill -0 "$TANDEM_COORD_PID" 2>/dev/null && kill -0 "$TANDEM_WORKERS_PID" 2>/dev/null; do
    sleep 5 &
    wait $! || true
  done
  tandem_die "a step ended while serving; see $RUN_DIR/logs"
}

# ------------------------------------------------------------------------------------------------
# The run folder.

tandem_make_run_dir() {
  mkdir -p "$RUN_DIR/logs" "$RUN_DIR/slurm"
  RUN_DIR=$(cd "$RUN_DIR" && pwd)
  export RUN_DIR
}

# Where everything listens, and a Prometheus file_sd target list.
tandem_write_endpoints() {
  local n i k port metrics=() targets=()
  {
    echo "coordinator ${TANDEM_COORD_ADDR}"
    i=0
    for kv in $TANDEM_WORKER_ADDRS; do
      for k in $(seq 0 $((WORKERS_PER_NODE - 1))); do
        port=$((WORKER_BASE_PORT + i * WORKERS_PER_NODE + k))
        echo "worker ${kv%%=*} local ${k} ${kv#*=}:${port}"
      done
      i=$((i + 1))
    done
  } >"$RUN_DIR/endpoints.txt"
  if [ -n "$(tandem_metrics_arg tandem-coordinator 0)" ]; then
    metrics+=("\"${TANDEM_COORD_HOST}:${COORD_METRICS_PORT}\"")
  fi
  if [ -n "$(tandem_metrics_arg tandem-worker 0)" ]; then
    i=0
    for kv in $TANDEM_WORKER_ADDRS; do
      for k in $(seq 0 $((WORKERS_PER_NODE - 1))); do
        targets+=("\"${kv#*=}:$((WORKER_METRICS_BASE_PORT + i * WORKERS_PER_NODE + k))\"")
      done
      i=$((i + 1))
    done
  fi
  local IFS=,
  cat >"$RUN_DIR/prometheus-targets.json" <<EOF
[
  {"targets": [${metrics[*]}], "labels": {"job": "tandem-coordinator", "slurm_job_id": "${SLURM_JOB_ID:-}"}},
  {"targets": [${targets[*]}], "labels": {"job": "tandem-worker", "slurm_job_id": "${SLURM_JOB_ID:-}"}}
]
EOF
}

tandem_write_settings() {
  {
    local v
    for v in MODE BACKEND MODEL_DIR STAGES REPLICAS WORKERS_PER_NODE TENSOR_PARALLEL COORD_PORT WORKER_BASE_PORT \
             TANDEM_BIN_DIR TANDEM_COORD_ADDR SWEEP_CMD SWEEP_ARGS PROMPTS_FILE MAX_NEW_TOKENS; do
      printf '%s=%q\n' "$v" "${!v:-}"
    done
    env | grep '^SLURM' | sort
  } >"$RUN_DIR/settings.env"
}

# Slurm's records of the job. sacct answers only where accounting (slurmdbd) is configured.
tandem_collect_slurm() {
  [ -n "${SLURM_JOB_ID:-}" ] || return 0
  scontrol show job "$SLURM_JOB_ID" >"$RUN_DIR/slurm/scontrol-show-job.txt" 2>&1 || true
  local nodes n
  nodes="${SLURM_JOB_NODELIST:-}${SLURM_JOB_NODELIST_HET_GROUP_1:+,$SLURM_JOB_NODELIST_HET_GROUP_1}"
  for n in $(scontrol show hostnames "$nodes" 2>/dev/null | sort -u); do
    scontrol show node "$n" 2>&1 || true
  done >"$RUN_DIR/slurm/scontrol-show-node.txt"
  if command -v sacct >/dev/null 2>&1 &&
     timeout --foreground 20 sacct -j "$SLURM_JOB_ID" --format=JobID,JobName%20,Partition,State,ExitCode,Elapsed,NodeList%30,AllocTRES%60 \
       >"$RUN_DIR/slurm/sacct.txt.tmp" 2>&1; then
    mv "$RUN_DIR/slurm/sacct.txt.tmp" "$RUN_DIR/slurm/sacct.txt"
  else
    rm -f "$RUN_DIR/slurm/sacct.txt.tmp"
  fi
}

# ------------------------------------------------------------------------------------------------
# Entry points for srun tasks.

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  TANDEM_LIB=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
  case "${1:-}" in
    worker-task) tandem_worker_task ;;
    count-gpus) tandem_count_gpus ;;
    *) echo "usage: lib.sh worker-task|count-gpus (run by srun from the tandem batch scripts)" >&2
       exit 2 ;;
  esac
fi
