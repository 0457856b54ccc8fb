#!/usr/bin/env bash
# Start a three-node slurm cluster on this one machine for the multi-node tier (tests/multinode).
#
# Each node is a network namespace (sao-n1..3) with its own address on a private bridge (sao-br0,
# 10.77.0.0/24, reachable only inside this machine) and its own hostname (a UTS namespace), running
# its own slurmd (`slurmd -N saonK`); one slurmctld runs in the root namespace at 10.77.0.1, and the
# munge daemon of the single-node cluster (or one started here) signs for all of them. The namespaces
# share the filesystem and the pid space, so every slurmd has its own spool, pid and log file (%n).
# The cluster has its own slurm.conf (/etc/slurm-multinode/slurm.conf, clients use SLURM_CONF) and
# its own controller port, so the single-node cluster of .ci/slurm_setup.sh keeps running beside it.
# Node names resolve through /etc/hosts lines tagged "# sao-multinode".
#
# Idempotent: a healthy cluster (three idle nodes) is left alone; anything half-built is torn down
# (.ci/multinode_teardown.sh) and built again. Bounded: MULTINODE_SETUP_TIMEOUT seconds (default 90)
# for the nodes to come up. Exits non-zero with the reason (and the daemon logs) when it cannot:
# the tier then skips with that reason.
set -euo pipefail
cd "$(dirname "$0")"
# shellcheck source=multinode_env.sh
source ./multinode_env.sh
# shellcheck source=munge_lib.sh
source ./munge_lib.sh

TIMEOUT="${MULTINODE_SETUP_TIMEOUT:-90}"

fail() {
  echo "multinode_setup: $*" >&2
  # the tier's skip message quotes this line (tests/multinode/multinode_cluster.py)
  { mkdir -p "$MN_LOG" && echo "$*" > "$MN_LOG/setup_failed"; } 2>/dev/null
  for log in "$MN_LOG"/*.log; do
    [ -f "$log" ] && { echo "--- tail $log" >&2; tail -n 10 "$log" >&2; }
  done
  exit 1
}

idle_nodes() { SLURM_CONF="$MN_CONF" timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 == "idle"' | wc -l; }

rm -f "$MN_LOG/setup_failed" 2>/dev/null || true
[ "$(id -u)" = 0 ] || fail "needs root (network namespaces, a bridge and slurm daemons)"
command -v ip >/dev/null || fail "the ip command (iproute2) is missing"
command -v unshare >/dev/null || fail "unshare (util-linux) is missing"

if [ -f "$MN_CONF" ] && command -v sinfo >/dev/null && [ "$(idle_nodes)" = "${#MN_NODES[@]}" ]; then
  echo "multinode_setup: ${#MN_NODES[@]} nodes already idle"
  exit 0
fi

install_packages() {
  command -v apt-get >/dev/null || fail "slurm is not installed and apt-get is missing: install slurmctld slurmd slurm-client munge"
  echo "multinode_setup: installing slurmctld slurmd slurm-client munge"
  export DEBIAN_FRONTEND=noninteractive
  local apt="timeout 600 apt-get"   # bounded: a stuck mirror fails the setup, the tier then skips
  $apt install -y -q slurmctld slurmd slurm-client munge >/dev/null 2>&1 || {
    $apt update -q >/dev/null || fail "apt-get update failed (no package registry?)"
    $apt install -y -q slurmctld slurmd slurm-client munge >/dev/null || fail "apt-get install of slurm failed"
  }
}

for bin in slurmctld slurmd sbatch munged; do
  command -v "$bin" >/dev/null || { install_packages; break; }
done

bash ./multinode_teardown.sh --quiet   # whatever an earlier run left half-built

network() {
  ip link add "$MN_BRIDGE" type bridge || fail "cannot create a bridge (no CAP_NET_ADMIN?)"
  ip addr add "$MN_CTL_ADDR/24" dev "$MN_BRIDGE"
  ip link set "$MN_BRIDGE" up
  local i
  for i in "${!MN_NODES[@]}"; do
    local ns="${MN_NS[$i]}" veth="sao-v$((i + 1))"
    ip netns add "$ns" || fail "cannot create network namespace $ns"
    ip link add "$veth" type veth peer name "$MN_IFACE" netns "$ns" || fail "cannot create veth pair $veth"
    ip link set "$veth" master "$MN_BRIDGE" up
    ip -n "$ns" addr add "${MN_ADDRS[$i]}/24" dev "$MN_IFACE"
    ip -n "$ns" link set "$MN_IFACE" up
    ip -n "$ns" link set lo up
  done
}

hosts_file() {
  local i
  {
    echo "$MN_CTL_ADDR $MN_CTL_NAME $MN_TAG"
    for i in "${!MN_NODES[@]}"; do echo "${MN_ADDRS[$i]} ${MN_NODES[$i]} $MN_TAG"; done
  } >> /etc/hosts
}

write_conf() {
  local cpus node_lines="" i
  cpus="$(nproc)"
  for i in "${!MN_NODES[@]}"; do
    node_lines+="NodeName=${MN_NODES[$i]} NodeAddr=${MN_ADDRS[$i]} NodeHostname=${MN_NODES[$i]} CPUs=$cpus RealMemory=2000 State=UNKNOWN"$'\n'
  done
  mkdir -p "$(dirname "$MN_CONF")" "$MN_SPOOL/ctld" "$MN_LOG" "$MN_RUN"
  for node in "${MN_NODES[@]}"; do mkdir -p "$MN_SPOOL/$node"; done
  cat > "$MN_CONF" <<EOF
# Written by .ci/multinode_setup.sh: three nodes in network namespaces, controller in the root one.
ClusterName=sao-multinode
SlurmctldHost=$MN_CTL_NAME($MN_CTL_ADDR)
SlurmctldPort=$MN_CTL_PORT
SlurmdPort=6818
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
StateSaveLocation=$MN_SPOOL/ctld
SlurmdSpoolDir=$MN_SPOOL/%n
SlurmctldPidFile=$MN_RUN/slurmctld.pid
SlurmdPidFile=$MN_RUN/slurmd-%n.pid
SlurmctldLogFile=$MN_LOG/slurmctld.log
SlurmdLogFile=$MN_LOG/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=60
KillWait=5
MessageTimeout=20
$node_lines
PartitionName=debug Nodes=$(IFS=,; echo "${MN_NODES[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}


start_daemons() {
  # nsenter, not `ip netns exec`: that one remounts /sys, which hides the cgroup fs slurmd looks for.
  # the controller answers to its own name: its own UTS namespace, the root network namespace
  unshare --uts sh -c "hostname $MN_CTL_NAME && exec slurmctld -f $MN_CONF" || fail "slurmctld did not start"
  local i
  for i in "${!MN_NODES[@]}"; do
    local node="${MN_NODES[$i]}"
    nsenter --net="/run/netns/${MN_NS[$i]}" unshare --uts sh -c "hostname $node && exec slurmd -f $MN_CONF -N $node" \
      || fail "slurmd $node did not start"
  done
}

wait_idle() {
  local deadline=$((SECONDS + TIMEOUT)) idle=0
  while [ $SECONDS -lt $deadline ]; do
    idle="$(idle_nodes)"
    if [ "$idle" = "${#MN_NODES[@]}" ]; then
      echo "multinode_setup: nodes ${MN_NODES[*]} idle at ${MN_ADDRS[*]} (SLURM_CONF=$MN_CONF)"
      return 0
    fi
    SLURM_CONF="$MN_CONF" scontrol update NodeName="$(IFS=,; echo "${MN_NODES[*]}")" State=RESUME >/dev/null 2>&1 || true
    sleep 1
  done
  fail "$idle of ${#MN_NODES[@]} nodes idle after ${TIMEOUT}s"
}

network
hosts_file
write_conf
start_munge
start_daemons
wait_idle
