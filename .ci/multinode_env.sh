# Names and addresses of the multi-node test cluster, shared by .ci/multinode_setup.sh and
# .ci/multinode_teardown.sh (tests/multinode/conftest.py reads the same values from /etc/hosts and
# the slurm.conf this writes).
MN_NODES=(saon1 saon2 saon3)          # slurm node names = hostnames inside the namespaces
MN_NS=(sao-n1 sao-n2 sao-n3)          # network namespaces
MN_ADDRS=(10.77.0.11 10.77.0.12 10.77.0.13)
MN_IFACE=eth0                         # each namespace's interface on the bridge
MN_BRIDGE=sao-br0
MN_CTL_NAME=sao-ctl
MN_CTL_ADDR=10.77.0.1
MN_CTL_PORT=6917                      # not 6817: the single-node cluster's controller may run beside it
MN_CONF=/etc/slurm-multinode/slurm.conf
MN_SPOOL=/var/spool/slurm-multinode
MN_LOG=/var/log/slurm-multinode
MN_RUN=/run/slurm-multinode
MN_TAG="# sao-multinode"
