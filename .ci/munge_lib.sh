# Shared by slurm_setup.sh and multinode_setup.sh (sourced; the caller defines `fail`): one munge
# daemon and key for every slurm daemon on this machine.

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
  chmod 0400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged || fail "munged did not start"
  for _ in $(seq 1 20); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
    sleep 0.5
  done
  fail "munge credentials do not round-trip (munged not answering)"
}
