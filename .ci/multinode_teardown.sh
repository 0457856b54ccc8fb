#!/usr/bin/env bash
# Stop the three-node test cluster of .ci/multinode_setup.sh and remove what it made: the daemons
# (by their pid files), the namespaces, the bridge, the /etc/hosts lines and the controller's state.
# Safe to run when nothing is there. --quiet: say nothing (setup calls it before building).
set -uo pipefail
cd "$(dirname "$0")"
# shellcheck source=multinode_env.sh
source ./multinode_env.sh
QUIET="${1:-}"
say() { [ "$QUIET" = --quiet ] || echo "multinode_teardown: $*"; }

for pidfile in "$MN_RUN"/slurmd-*.pid "$MN_RUN"/slurmctld.pid; do
  [ -s "$pidfile" ] || continue
  pid="$(cat "$pidfile")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null
    for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -9 "$pid" 2>/dev/null || true
    say "stopped $(basename "$pidfile" .pid) ($pid)"
  fi
  rm -f "$pidfile"
done
for ns in "${MN_NS[@]}"; do
  ip netns del "$ns" 2>/dev/null && say "removed namespace $ns"
done
ip link del "$MN_BRIDGE" 2>/dev/null && say "removed bridge $MN_BRIDGE"
if grep -q "$MN_TAG" /etc/hosts 2>/dev/null; then
  # /etc/hosts may be a bind mount: rewrite it in place rather than replacing the file
  kept="$(grep -v "$MN_TAG" /etc/hosts)"
  printf '%s\n' "$kept" > /etc/hosts
  say "removed the /etc/hosts lines"
fi
rm -rf "$MN_SPOOL/ctld"
exit 0
