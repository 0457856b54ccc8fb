#!/usr/bin/env bash
# Start a single-node slurm cluster on this machine for the slurm test tier (tests/slurm).
#
# Installs slurmctld, slurmd, slurm-client and munge from Debian packages when missing, writes a
# one-node slurm.conf (proctrack/linuxproc and task/none: no cgroups needed inside a container;
# MpiDefault=none: our rank bootstrap reads SLURM_PROCID/SLURM_LOCALID itself), starts munged,
# slurmctld and slurmd, and waits until `sinfo` shows the node idle. Idempotent: a running healthy
# cluster is left alone. Exits non-zero with the reason and the daemon logs when it cannot.
#
# Env: SLURM_SETUP_TIMEOUT (seconds to wait for the node, default 90).
set -euo pipefail

TIMEOUT="${SLURM_SETUP_TIMEOUT:-90}"
CONF=/etc/slurm/slurm.conf
LOGDIR=/var/log/slurm
NODE="$(hostname -s)"

# shellcheck source=munge_lib.sh
source "$(dirname "$0")/munge_lib.sh"

fail() {
  echo "slurm_setup: $*" >&2
  for log in "$LOGDIR/slurmctld.log" "$LOGDIR/slurmd.log" /var/log/munge/munged.log; do
    [ -f "$log" ] && { echo "--- tail $log" >&2; tail -n 15 "$log" >&2; }
  done
  exit 1
}

node_state() { sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n1 | tr -d '*~#'; }

if command -v sinfo >/dev/null && [ "$(node_state)" = "idle" ]; then
  echo "slurm_setup: node $NODE already idle"
  exit 0
fi

install_packages() {
  command -v apt-get >/dev/null || fail "slurm is not installed and apt-get is missing: install slurmctld slurmd slurm-client munge by hand"
  echo "slurm_setup: installing slurmctld slurmd slurm-client munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null || fail "apt-get update failed (no package registry?)"
  apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null || fail "apt-get install of slurm failed"
}

for bin in slurmctld slurmd sbatch munged; do
  command -v "$bin" >/dev/null || { install_packages; break; }
done

write_conf() {
  local cpus mem_mb
  cpus="$(nproc)"
  mem_mb="$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)"
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd "$LOGDIR"
  cat > "$CONF" <<EOF
# Written by .ci/slurm_setup.sh: one node that is controller and compute node at once.
ClusterName=sao-ci
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=60
KillWait=10
NodeName=$NODE CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}


start_daemons() {
  # Daemons this script started on an earlier run may hold stale config: ask them to stop by pid file.
  for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
    if [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      kill "$(cat "$pidfile")" && sleep 1
    fi
  done
  slurmctld || fail "slurmctld did not start"
  slurmd || fail "slurmd did not start"
}

wait_idle() {
  local deadline=$((SECONDS + TIMEOUT)) state=""
  while [ $SECONDS -lt $deadline ]; do
    state="$(node_state)"
    case "$state" in
      idle) echo "slurm_setup: node $NODE idle ($(sinfo -h -o '%P %D %c CPUs'))"; return 0 ;;
      down|drained|draining|drain) scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 1
  done
  fail "node $NODE is '${state:-unknown}' after ${TIMEOUT}s, not idle"
}

write_conf
start_munge
start_daemons
wait_idle
