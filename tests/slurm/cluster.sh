# A throw-away Slurm cluster on one machine for the slurm tests: munged, slurmctld and three slurmd
# ("n1" in partition cpu, "n2" and "n3" in partition gpu), all on this host, with every file under
# one scratch folder. Nothing under /etc is read or written: the commands find the configuration
# through SLURM_CONF and munge through a private socket named in slurm.conf (AuthInfo).
#
# Sourced by the test scripts:
#   cluster_install            # slurm-wlm + munge from Debian if missing (root or sudo)
#   cluster_start DIR          # writes DIR/slurm.conf, starts the daemons, exports SLURM_CONF
#   cluster_stop DIR           # stops exactly the daemons cluster_start started (by pid file)
#   cluster_wait_idle          # waits until the three nodes are idle

cluster_sudo() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -n "$@"; fi
}

cluster_install() {
  local missing=()
  local p
  for p in slurm-wlm munge; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "cluster: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  cluster_sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
    { cluster_sudo apt-get update -qq &&
      cluster_sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
}

# A TCP port nobody listens on, from a range away from Slurm's and tandem's defaults.
cluster_free_port() {
  local p
  while true; do
    p=$((20000 + RANDOM % 20000))
    if [ -z "$(ss -Htln "sport = :$p" 2>/dev/null)" ]; then
      echo "$p"
      return
    fi
  done
}

cluster_start() {
  local dir=$1
  local host
  host=$(hostname -s)
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  mkdir -p "$dir/state" "$dir/spool" "$dir/log" "$dir/run"
  # munged insists that its key and the folder around it are private, and that every folder on the
  # way to its socket is searchable.
  mkdir -p -m 700 "$dir/munge"
  mkdir -p -m 755 "$dir/munge-socket"
  chmod 755 "$dir"
  if [ ! -s "$dir/munge/munge.key" ]; then
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1 count=128 status=none
    chmod 400 "$dir/munge/munge.key"
  fi
  munged --force --socket="$dir/munge-socket/munge.sock" --key-file="$dir/munge/munge.key" \
    --log-file="$dir/munge/munged.log" --pid-file="$dir/run/munged.pid" \
    --seed-file="$dir/munge/munged.seed" || return 1

  local ctl_port n1 n2 n3
  ctl_port=$(cluster_free_port)
  n1=$(cluster_free_port); n2=$(cluster_free_port); n3=$(cluster_free_port)
  : >"$dir/plugstack.conf"
  cat >"$dir/slurm.conf" <<EOF
# Written by tests/slurm/cluster.sh: three nodes on one host, short intervals.
ClusterName=tandemtest
SlurmctldHost=$host
SlurmctldPort=$ctl_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge-socket/munge.sock
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
PlugStackConfig=$dir/plugstack.conf
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_min_interval=100000,batch_sched_delay=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/jobcomp.txt
ReturnToService=2
KillWait=2
MinJobAge=600
InactiveLimit=0
MessageTimeout=10
SlurmdTimeout=60
NodeName=n1 NodeHostname=$host Port=$n1 CPUs=2 RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeHostname=$host Port=$n2 CPUs=2 RealMemory=1000 State=UNKNOWN
NodeName=n3 NodeHostname=$host Port=$n3 CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=cpu Nodes=n1 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
PartitionName=gpu Nodes=n2,n3 MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld -i || return 1
  local n
  for n in n1 n2 n3; do
    slurmd -N "$n" || return 1
  done
}

cluster_wait_idle() {
  local i
  for i in $(seq 1 60); do
    if [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle')" -ge 3 ]; then
      return 0
    fi
    sleep 1
  done
  echo "cluster: nodes not idle after 60 s:" >&2
  sinfo -N >&2 || true
  return 1
}

# Stops the daemons by the pids they wrote; each gets TERM, then KILL if it lingers.
cluster_stop() {
  local dir=$1
  local f pid
  for f in "$dir"/run/slurmd-*.pid "$dir/run/slurmctld.pid" "$dir/run/munged.pid"; do
    [ -s "$f" ] || continue
    pid=$(cat "$f")
    kill -TERM "$pid" 2>/dev/null || continue
    for _ in $(seq 1 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$f"
  done
}
