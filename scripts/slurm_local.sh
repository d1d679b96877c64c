#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, from Debian's packages, for
# bfexp's Slurm tests (CI runs `scripts/slurm_local.sh up` from .ci/run).
#
#   scripts/slurm_local.sh up      install (apt-get) if needed, configure, start; idempotent
#   scripts/slurm_local.sh down    cancel every job, stop the daemons
#   scripts/slurm_local.sh status  sinfo and squeue
#
# One node (this host) in one partition `debug`. The node advertises more CPUs
# than the machine has (SlurmdParameters=config_overrides) so that jobs of more
# ranks than cores can run oversubscribed, as bfexp's local runs do. No cgroups
# (a container has none to give): processes are tracked by the Linux process
# tree. srun's MPI plugin defaults to PMIx (mpi4py + Open MPI 5 need it).
# Needs root (apt-get, daemons).
set -euo pipefail

ACTION=${1:-up}
NODE=$(hostname -s)
CPUS=${SLURM_LOCAL_CPUS:-32}
CONF_DIR=/etc/slurm
STATE=/var/spool/slurmctld
SPOOL=/var/spool/slurmd
LOG_DIR=/var/log/slurm

need_root() {
    if [ "$(id -u)" != 0 ]; then
        echo "slurm_local.sh: needs root (it installs packages and starts daemons)" >&2
        exit 2
    fi
}

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && dpkg -s libpmix2 libpmix-dev >/dev/null 2>&1; then
        return
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q slurm-wlm munge libpmix2 libpmix-dev >/dev/null
}

memory_mb() {
    awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo
}

configure() {
    mkdir -p "$CONF_DIR" "$STATE" "$SPOOL" "$LOG_DIR"
    cat >"$CONF_DIR/slurm.conf" <<EOF
# Written by bfexp's scripts/slurm_local.sh: a one-node test cluster.
ClusterName=bfexp-local
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE
SlurmdSpoolDir=$SPOOL
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmix
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
InactiveLimit=0
MinJobAge=5
NodeName=$NODE CPUs=$CPUS RealMemory=$(memory_mb) State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
}

start_munge() {
    if pgrep -x munged >/dev/null; then
        return
    fi
    if [ ! -s /etc/munge/munge.key ]; then
        (command -v mungekey >/dev/null && mungekey --create --force) \
            || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
    chmod 0700 /etc/munge
    chmod 0400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged
}

start_slurm() {
    pgrep -x slurmctld >/dev/null || slurmctld
    pgrep -x slurmd >/dev/null || slurmd
    for _ in $(seq 1 60); do
        if sinfo -h -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
            return
        fi
        sleep 1
    done
    # a node left down by an earlier run: bring it back
    scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
    for _ in $(seq 1 30); do
        sinfo -h -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)' && return
        sleep 1
    done
    echo "slurm_local.sh: the node did not come up; see $LOG_DIR/slurmctld.log and slurmd.log" >&2
    sinfo >&2 || true
    exit 1
}

down() {
    scancel --full --quiet -u root 2>/dev/null || true
    for daemon in slurmd slurmctld; do
        pkill -x "$daemon" 2>/dev/null || true
    done
    for _ in $(seq 1 20); do
        pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || break
        sleep 0.5
    done
    pkill -x munged 2>/dev/null || true
}

case "$ACTION" in
    up)
        need_root
        install
        configure
        start_munge
        start_slurm
        sinfo
        ;;
    down)
        need_root
        down
        ;;
    status)
        sinfo && squeue
        ;;
    *)
        echo "usage: $0 up|down|status" >&2
        exit 2
        ;;
esac
